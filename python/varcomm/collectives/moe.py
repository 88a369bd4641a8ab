"""Expert-parallel MoE dispatch and combine over varcomm's all-to-all-v.

Experts are sharded contiguously over ranks: with E experts on n ranks, rank
r owns experts [r * E/n, (r + 1) * E/n). Every (token, k) assignment is sent
to the rank owning expert ``topk_ids[token, k]``; there it is grouped by
local expert. One message per rank pair: no count exchange. Each routed row
carries its local expert index in 4 bytes of extra elements appended to the
token (rows keep the tokens' dtype, so the header's dtype and shape check
applies), so the receiver can group rows per expert without a second message.
Every chunk's header also carries num_experts, and a combine's (and each
backward's) which dispatch it undoes (the core's A2APlan::agree): a rank that
differs fails the call on every rank, a rank it sends no rows included.

    expert_tokens, tokens_per_expert, handle = dispatch(comm, tokens, topk_ids, topk_weights, E)
    # expert_tokens[: tokens_per_expert[0]] go to local expert 0, and so on
    outputs = run_local_experts(expert_tokens, tokens_per_expert)
    y = combine(comm, outputs, handle)  # [T, H']: sum_k weight[t, k] * output of (t, k)

Both are differentiable (torch.autograd.Function): the backward of dispatch
is a combine-like all-to-all-v of the gradients and vice versa, and the
gradient reaches ``topk_weights`` through combine's weighted sum. Like every
collective, the backward all-to-alls must run on every rank: tokens (and the
expert outputs) must require grad on all ranks or on none.

CPU or CUDA tokens. With ``topk_ids`` on the host, the routing metadata
(counts per destination) is computed and read there, and the all-to-alls run
on the tokens' device, ordered on the current stream (collectives/alltoall.py):
outputs are exact-sized. With ``topk_ids`` on the GPU, ``dispatch`` and
``combine`` hand over to ``moe_device``, where the counts never leave the
device (no host sync; bound-sized, expert-major outputs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _C, arrays
from ..errors import InvalidArgument, MessageMismatch
from . import a2a_autograd, alltoall

if TYPE_CHECKING:
    from ..comm import Communicator
    from .moe_device import DeviceMoEHandle

__all__ = ["dispatch", "combine", "MoEHandle"]


@dataclass
class MoEHandle:
    """What combine (and both backwards) need to undo a dispatch."""

    comm: Communicator
    num_tokens: int  # T on this rank
    topk: int  # K
    order: torch.Tensor  # [T*K] flat (t, k) indices sorted by expert: the send order
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    perm: torch.Tensor  # [R] received row index of each expert_tokens row
    tokens_per_expert: torch.Tensor  # [E/n] int64
    topk_weights: torch.Tensor  # [T, K], as given (may require grad)
    place: Any = None  # the tokens' device memory (arrays.DeviceMemory.place), None for host memory
    call: int = 0  # the dispatch's collective number (the same on every rank): _undoing


# What each all-to-all is called in the errors every rank gets: (operation, input, backward).
_DISPATCH = ("moe.dispatch", "packing of tokens", False)
_COMBINE = ("moe.combine", "expert_outputs", False)
_DISPATCH_BACK = ("moe.dispatch's backward", "gradient", True)
_COMBINE_BACK = ("moe.combine's backward", "gradient", True)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with C-contiguous strides. An empty tensor counts as contiguous to
    torch whatever its strides, and a byte view of a column-strided one fails."""
    return t.contiguous() if t.numel() else t.new_empty(t.shape)


def _num_experts(num_experts: int) -> tuple[int, int, str, str]:
    """What every rank's dispatch chunks carry and check (alltoall.agreeing), so that a
    rank that receives no rows from a peer with another num_experts fails too."""
    return alltoall.AGREE_NUM_EXPERTS, num_experts, "num_experts", ": every rank must pass the same num_experts"


def _undoing(kind: int, call: int) -> tuple[int, int, str, str]:
    """What the all-to-alls undoing a dispatch carry and check: which dispatch (its
    collective number, the same on every rank), and which of them it is (`kind`:
    combine, or either backward). A rank that passes the handle of another dispatch
    than its peers fails on every rank, where equal row counts went through silently."""
    return kind, call, "the handle of dispatch call", (
        ": a rank combined with the handle of another dispatch (each combine takes the handle its own "
        "dispatch returned, in this step), or the ranks are out of step")


_BACKWARD_RULE = ("; every rank must run backward through moe.dispatch and moe.combine (tokens and expert outputs "
                  "requiring grad on all ranks or on none), in the same order")


def _all_to_all_v(comm: Communicator, x: torch.Tensor, splits: list[int], place: Any, label: tuple[str, str, bool],
                  expect: list[int] | None = None, *,
                  agree: tuple[int, int, str, str] = (0, 0, "", "")) -> tuple[torch.Tensor, list[int]]:
    """all_to_all_v of a tensor, in `place`'s memory (None: the host): the
    result is a tensor there too. `expect`: the rows each rank must send
    back (what this rank sent it, or received from it, in the step undone)."""
    if place is not None:
        x = arrays.device_memory().to(x, place)
    return a2a_autograd.exchange(
        comm, x, splits, label, expect=expect, rule=_BACKWARD_RULE if label[2] else "", agree=agree,
        why="the ranks are out of step (a peer ran another moe.dispatch, moe.combine or collective here), or a "
            "peer passed a handle from another dispatch")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, place: Any) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype) if place is None else arrays.device_memory().empty(shape, dtype, place)


def _route(topk_ids: torch.Tensor, num_experts: int, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, k) pairs routed to an expert, sorted by expert (stable), and
    the rows for each rank. A -1 is a masked pair (DeepEP's convention, a
    dropped token): not sent, and it adds nothing in combine."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        bad = flat[(flat < -1) | (flat >= num_experts)]
        raise InvalidArgument(f"topk_ids must lie in [0, {num_experts}), or be -1 for a masked (dropped) "
                              f"(token, k) pair; got {int(bad[0])} ({bad.numel()} such)")
    order = torch.sort(flat, stable=True).indices
    order = order[int((flat < 0).sum()):]  # the -1s sort first
    per_rank = num_experts // n
    splits = torch.bincount(flat[order] // per_rank, minlength=n).tolist()
    return flat, order, splits


# The core's words for a chunk of packed rows that does not match (collectives.cpp, AllToAll's mismatch text).
_CHUNK = re.compile(r"the chunk from rank (\d+) is (\w+) of shape \(\d+, (\d+)\), but rank \d+'s [^;]*? is \w+ "
                    r"with rows of shape \(\d+,\)")


def _peer_tokens(core: str, rank: int, dtype: torch.dtype, H: int) -> str:
    """The core's text about the packed rows (their width adds the expert
    index's elements, which depend on the dtype) in tokens' terms, each
    mismatching source where the core names it; its other parts (a peer's
    refusal) stay as they are."""
    mine = f"rank {rank}'s are {str(dtype).removeprefix('torch.')} [T, {H}]"

    def tokens(m: re.Match[str]) -> str:
        theirs = getattr(torch, m.group(2), None)
        if not isinstance(theirs, torch.dtype):
            return m.group(0)
        width = int(m.group(3)) - -(-4 // theirs.itemsize)  # (the expert index's elements, as packed below)
        return f"rank {m.group(1)}'s tokens are {m.group(2)} [T, {width}] where {mine}"

    text = _CHUNK.sub(tokens, core.removeprefix(f"moe.dispatch on rank {rank}: "))
    return text.replace("every rank must pass the same dtype and trailing shape",
                        "every rank must pass tokens of one dtype and hidden size H")


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, handle_box: list[Any], topk_ids: torch.Tensor,
                num_experts: int, comm: Any) -> Any:
        n = comm.world_size
        per_rank = num_experts // n
        T, H = tokens.shape
        K = topk_ids.shape[1]
        place = arrays.device_memory().place(tokens)
        flat, order, send_splits = _route(topk_ids.to(tokens.device), num_experts, n)
        src_rows = order // K
        local_expert = (flat[order] % per_rank).to(torch.int32)
        # One row per (token, k): the token's elements, then its local expert
        # index (an int32) in the bytes of `extra` more elements of the
        # tokens' dtype. The rows keep the tokens' dtype and width, so the
        # message header carries them and a rank whose tokens differ in either
        # raises MessageMismatch (rows packed as bytes matched whenever their
        # byte counts did: float32 [T, 4] and float16 [T, 8] went through,
        # reinterpreted). num_experts travels in the header (agree).
        x = _dense(tokens.detach())
        isz = x.element_size()
        hb = H * isz
        extra = -(-4 // isz)
        wb = (H + extra) * isz
        packed = _empty((order.numel(), H + extra), x.dtype, place)
        pb = packed.view(torch.uint8).reshape(-1, wb)
        pb[:, :hb] = x.view(torch.uint8).reshape(T, hb).index_select(0, src_rows)
        pb[:, hb:hb + 4] = local_expert.view(torch.uint8).reshape(-1, 4)
        call = comm._c.collectives  # the number this dispatch's all-to-all takes (core: next_collective)
        try:
            recv, recv_splits = _all_to_all_v(comm, packed, send_splits, place, _DISPATCH,
                                              agree=_num_experts(num_experts))
        except MessageMismatch as e:
            if "same dtype and trailing shape" not in str(e):
                raise  # a peer's refusal, not its tokens
            # The core describes the packed rows, whose width is H plus the
            # expert index's elements (their count depends on the dtype): say
            # it in the tokens' terms. (A peer in another collective, as a
            # combine, is told apart before shapes are compared: its call kind.)
            err = MessageMismatch(f"moe.dispatch on rank {comm.rank}: {_peer_tokens(str(e), comm.rank, x.dtype, H)}")
            err.peer = e.peer
            raise err from None
        rb = recv.view(torch.uint8).reshape(-1, wb)
        # A copy of its own (offset 0, 4-aligned): contiguous() keeps one row's
        # slice in place, at byte hb, which view(int32) refuses unless 4 | hb.
        le = rb[:, hb:hb + 4].clone(memory_format=torch.contiguous_format).view(torch.int32).reshape(-1).to(torch.int64)
        perm = torch.sort(le, stable=True).indices
        tokens_per_expert = torch.bincount(le, minlength=per_rank)
        # H = 0: no bytes to view as x.dtype (nor a -1 to infer from 0 elements)
        expert_tokens = rb[:, :hb].index_select(0, perm).view(x.dtype) if H else recv.new_empty((perm.numel(), 0))
        handle_box.append((order, send_splits, recv_splits, perm, tokens_per_expert, T, K, place, call))
        ctx.comm = comm
        ctx.meta = (order, send_splits, recv_splits, perm, T, K, place, call)
        ctx.mark_non_differentiable(tokens_per_expert)
        return expert_tokens, tokens_per_expert

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _g_counts: Any) -> Any:
        order, send_splits, recv_splits, perm, T, K, place, call = ctx.meta
        g = _unpermute(grad, perm)
        back, _ = _all_to_all_v(ctx.comm, g, recv_splits, place, _DISPATCH_BACK, send_splits,  # in send order
                                agree=_undoing(alltoall.AGREE_DISPATCH_BACK, call))
        gtok = back.new_zeros((T,) + tuple(grad.shape[1:]))
        gtok.index_add_(0, order // K, back)
        return gtok, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, expert_outputs: torch.Tensor, comm: Any, order: torch.Tensor, send_splits: list[int],
                recv_splits: list[int], perm: torch.Tensor, T: int, K: int, place: Any, call: int) -> torch.Tensor:
        y = _unpermute(_dense(expert_outputs.detach()), perm)  # back to received order
        try:  # [T*K, H'] in send (expert-sorted) order
            back, _ = _all_to_all_v(comm, y, recv_splits, place, _COMBINE, send_splits,
                                    agree=_undoing(alltoall.AGREE_COMBINE, call))
        except MessageMismatch as e:
            if "same dtype and trailing shape" not in str(e):
                raise
            err = MessageMismatch(f"{e} (or the ranks are out of step: a peer ran moe.dispatch or another "
                                  f"collective where this rank ran moe.combine)")
            err.peer = e.peer
            raise err from None
        tk = back.new_zeros((T * K,) + tuple(back.shape[1:]))  # masked (-1) pairs stay 0
        tk[order] = back  # (t, k) order
        ctx.comm = comm
        ctx.meta = (order, send_splits, recv_splits, perm, place, expert_outputs.device, call)
        return tk.reshape((T, K) + tuple(back.shape[1:]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        order, send_splits, recv_splits, perm, place, device, call = ctx.meta
        g = grad.reshape((-1,) + tuple(grad.shape[2:])).index_select(0, order).contiguous()
        recv, _ = _all_to_all_v(ctx.comm, g, send_splits, place, _COMBINE_BACK, recv_splits,  # received order
                                agree=_undoing(alltoall.AGREE_COMBINE_BACK, call))
        return (recv.index_select(0, perm).to(device),) + (None,) * 9


def _unpermute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out[perm] = x
    return out


@alltoall._in_step
def dispatch(comm: Communicator, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int) -> tuple[torch.Tensor, torch.Tensor, MoEHandle | DeviceMoEHandle]:
    """Send each (token, k) to the rank owning expert ``topk_ids[token, k]``.

    tokens [T, H] (any fixed-size dtype), topk_ids [T, K] ints in [0, E) or
    -1 for a masked pair (not sent; it adds 0 in combine, as in DeepEP),
    topk_weights [T, K] (kept for combine). Returns ``expert_tokens`` [R, H]
    grouped by local expert (rows for local expert 0 first, ...; within an
    expert, by source rank then by (token, k)), ``tokens_per_expert`` [E/n]
    int64, and the handle combine needs. ``num_experts`` must be a multiple of
    the world size; rank r owns experts [r * E/n, (r + 1) * E/n) (local
    expert j is global expert r * E/n + j).

    ``topk_ids`` on the GPU: the device-routed form (moe_device.dispatch): no
    count reaches the host, ``expert_tokens`` is bound-sized and expert-major,
    ``tokens_per_expert`` is on the device."""
    for name, t in (("tokens", tokens), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"moe.dispatch: {name} must be a torch.Tensor, not {type(t).__name__} "
                                  "(torch.as_tensor(...) it)")
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise InvalidArgument(f"moe.dispatch: num_experts must be an int, not {type(num_experts).__name__} "
                              f"({num_experts!r})")
    num_experts = int(num_experts)
    if topk_ids.is_cuda:
        from . import moe_device

        return moe_device.dispatch(comm, tokens, topk_ids, topk_weights, num_experts)
    n = comm.world_size
    if num_experts <= 0 or num_experts % n:
        raise InvalidArgument(f"num_experts={num_experts} must be a positive multiple of the world size {n}")
    if num_experts >= 1 << 20:  # (every chunk's header carries it in 20 bits: alltoall.agreeing)
        raise InvalidArgument(f"num_experts={num_experts}: at most {(1 << 20) - 1} experts")
    if tokens.dim() != 2:
        raise InvalidArgument(f"tokens must be [T, H], got shape {tuple(tokens.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens.shape[0]:
        raise InvalidArgument(f"topk_ids must be [T, K] with T={tokens.shape[0]}, got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise InvalidArgument(f"topk_ids must be an integer tensor (expert indices), not {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise InvalidArgument(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    box: list[Any] = []
    # Function.apply is unannotated in torch.
    expert_tokens, tokens_per_expert = _Dispatch.apply(tokens, box, topk_ids, num_experts, comm)  # type: ignore[no-untyped-call]
    order, send_splits, recv_splits, perm, tpe, T, K, place, call = box[0]
    handle = MoEHandle(comm, T, K, order, send_splits, recv_splits, perm, tpe, topk_weights, place, call)
    return expert_tokens, tokens_per_expert, handle


@alltoall._in_step
def combine(comm: Communicator, expert_outputs: torch.Tensor, handle: MoEHandle | DeviceMoEHandle) -> torch.Tensor:
    """Return every expert output to its token's rank and reduce it:
    ``y[t] = sum_k topk_weights[t, k] * output(t, k)``, tokens in their
    original order. ``expert_outputs`` [R, H'] rows match dispatch's
    ``expert_tokens`` rows (H' may differ from H). Differentiable in
    ``expert_outputs`` and in ``topk_weights``."""
    if not isinstance(handle, MoEHandle):
        from . import moe_device

        if not isinstance(handle, moe_device.DeviceMoEHandle):
            raise InvalidArgument(f"combine: handle must be the third value dispatch returned, not "
                                  f"{type(handle).__name__}")
    if handle.comm is not comm:
        # Its splits and ranks are that communicator's: over another, rows go to the wrong ranks.
        err = InvalidArgument(f"moe.combine: the handle is from a dispatch over another communicator "
                              f"(rank {handle.comm.rank} of {handle.comm.world_size}); combine over the one its "
                              f"dispatch used")
        # Refused where the peers' combines wait (the handle's communicator),
        # not on the one passed by mistake, whose next call it would eat.
        if isinstance(handle, MoEHandle):
            _C.all_to_all_refuse(handle.comm._c, 0)
        else:  # the device form's refusal: an empty launch
            from . import alltoall_device

            alltoall_device.refuse(handle.comm, expert_outputs, handle.stream, None)
        err._refused_to_peers = True  # type: ignore[attr-defined]
        raise err
    if not isinstance(expert_outputs, torch.Tensor):
        raise InvalidArgument(f"moe.combine: expert_outputs must be a torch.Tensor, not "
                              f"{type(expert_outputs).__name__} (torch.as_tensor(...) it)")
    if not (expert_outputs.dtype.is_floating_point or expert_outputs.dtype.is_complex):
        # The weights are applied in the outputs' dtype: 0.5 became 0, every token's sum 0.
        raise InvalidArgument(f"combine: expert_outputs are {expert_outputs.dtype}, and the topk_weights would be "
                              "cast to it (0.5 -> 0); pass floating-point expert outputs (expert_outputs.float())")
    if not isinstance(handle, MoEHandle):
        return moe_device.combine(comm, expert_outputs, handle)
    if expert_outputs.shape[0] != handle.perm.numel():
        raise InvalidArgument(f"expert_outputs has {expert_outputs.shape[0]} rows; dispatch delivered "
                              f"{handle.perm.numel()}")
    h = handle
    per_tk: torch.Tensor = _Combine.apply(  # type: ignore[no-untyped-call]  # unannotated in torch
        expert_outputs, comm, h.order, h.send_splits, h.recv_splits, h.perm, h.num_tokens, h.topk, h.place, h.call)
    dropped = torch.ones(h.num_tokens * h.topk, dtype=torch.bool, device=h.order.device)
    dropped[h.order] = False
    return weighted_sum(per_tk, h.topk_weights, dropped)


def weighted_sum(per_tk: torch.Tensor, topk_weights: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * per_tk[t, k] over the pairs not dropped ([T*K] bool:
    a masked pair's weight is not read, so an inf or NaN there is not a NaN
    in y), in float32 at least (bf16 products and sums lose the weights'
    precision: a 0.3 is 0.30078125 in bf16), returned in the outputs' dtype."""
    acc = torch.promote_types(per_tk.dtype, torch.float32)
    w = topk_weights.to(acc).masked_fill(dropped.reshape(topk_weights.shape), 0)
    return (per_tk.to(acc) * w.reshape(w.shape + (1,) * (per_tk.dim() - 2))).sum(dim=1).to(per_tk.dtype)
