"""MoE dispatch and combine with the routing on the GPU: no count ever
reaches the host (collectives/alltoall_device.py underneath).

    expert_tokens, tokens_per_expert, handle = dispatch(comm, tokens, topk_ids, topk_weights, E)
    # expert_tokens is bound-sized and expert-major: local expert e's rows are
    # expert_tokens[off[e] : off[e] + tokens_per_expert[e]], off = exclusive cumsum
    y = combine(comm, expert_outputs, handle)   # [T, H']: sum_k weight[t, k] * output of (t, k)

The routing (a stable sort of the (token, k) pairs by expert, the rows per
expert as a scatter-add, not ``bincount``, which syncs on CUDA) runs as torch
ops on the tokens' stream; the exchange is one ``all_to_all_vdev_2d`` for
dispatch and one ``all_to_all_vdev_2d_offset`` for combine, so the whole
step can be captured in a CUDA graph (call it once first) and replayed with
new ``topk_ids``. Both are torch.autograd.Functions: dispatch's backward is
a combine of the gradients, combine's a dispatch (zeros past the received
rows). ``tokens_per_expert`` is int64 on the device.

``alloc(shape, dtype)``: where outputs come from (default ``torch.empty``
on the tokens' device); graph capture wants them from the graph's pool, as
torch gives inside ``torch.cuda.graph``. Tensors not on a GPU are accepted
with an explicit ``stream=`` (memory the GPU addresses: the CPU stand-in
driver in tests); then every exchange is followed by a host synchronize,
since CPU torch ops are not ordered on a CUDA stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import _C
from ..errors import InvalidArgument
from . import alltoall_device as D
from .moe import weighted_sum

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["dispatch", "combine", "DeviceMoEHandle"]

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass
class DeviceMoEHandle:
    """What combine (and both backwards) need; every tensor is on the device."""

    comm: Communicator
    num_tokens: int
    topk: int
    experts_per_rank: int
    order: torch.Tensor  # [T*K] (t, k) indices sorted by expert: the send order
    send_splits: torch.Tensor  # [E] rows per global expert (int64)
    splits_offsets: torch.Tensor  # [2, E]: dispatch's out_splits_offsets (expert-major)
    tokens_per_expert: torch.Tensor  # [E / world] int64
    topk_weights: torch.Tensor
    stream: int | None
    alloc: Alloc
    dropped: torch.Tensor  # [T*K] bool, (t, k) order: pairs not sent (a -1, or an id outside [0, E))
    # [1] int64: the dispatch's call number, written by its kernel (graph replays too); combine and both
    # backwards carry and check it, so a handle of another dispatch than the peers' is out of step.
    dispatch_no: torch.Tensor


def _alloc_like(x: torch.Tensor, alloc: Alloc | None) -> Alloc:
    if alloc is not None:
        return alloc
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=x.device)


def _dispatch_rows(comm: Communicator, x: torch.Tensor, splits: torch.Tensor, ne: int, out: torch.Tensor,
                   oso: torch.Tensor, stream: int | None, dispatch_no: torch.Tensor, backward: bool = False) -> None:
    D.all_to_all_vdev_2d(comm, x, splits, ne, out=out, out_splits_offsets=oso, stream=stream, _backward=backward,
                         _dispatch=dispatch_no)
    D.torch_after(comm, x, stream)


def _combine_rows(comm: Communicator, x: torch.Tensor, so: torch.Tensor, ne: int, out: torch.Tensor,
                  stream: int | None, alloc: Alloc, dispatch_no: torch.Tensor, backward: bool = False) -> None:
    bso = alloc((2, so.shape[-1]), torch.int64)
    D.all_to_all_vdev_2d_offset(comm, x, so, ne, out=out, out_splits_offsets=bso, stream=stream, _backward=backward,
                                _dispatch=dispatch_no)
    D.torch_after(comm, x, stream)


def _zero_rows(x: torch.Tensor, rows: torch.Tensor) -> None:
    """Zero the rows where the bool mask `rows` is set, on the device (no sync)."""
    x.masked_fill_(rows.reshape((-1,) + (1,) * (x.dim() - 1)), 0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, h: DeviceMoEHandle, x: torch.Tensor, rows: int) -> Any:
        out = h.alloc((rows,) + tuple(tokens.shape[1:]), tokens.dtype)
        _dispatch_rows(h.comm, x, h.send_splits, h.experts_per_rank, out, h.splits_offsets, h.stream, h.dispatch_no)
        ctx.h = h
        ctx.hidden = tuple(tokens.shape[1:])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        h: DeviceMoEHandle = ctx.h
        back = h.alloc((h.order.numel(),) + ctx.hidden, grad.dtype)
        _combine_rows(h.comm, grad.contiguous(), h.splits_offsets, h.experts_per_rank, back, h.stream, h.alloc,
                      h.dispatch_no, backward=True)
        _zero_rows(back, h.dropped.index_select(0, h.order))  # never sent: nothing came back
        gtok = torch.zeros((h.num_tokens,) + ctx.hidden, dtype=grad.dtype, device=grad.device)
        gtok.index_add_(0, h.order // h.topk, back)
        return gtok, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, expert_outputs: torch.Tensor, h: DeviceMoEHandle) -> torch.Tensor:
        trailing = tuple(expert_outputs.shape[1:])
        back = h.alloc((h.order.numel(),) + trailing, expert_outputs.dtype)
        _combine_rows(h.comm, expert_outputs.detach().contiguous(), h.splits_offsets, h.experts_per_rank, back,
                      h.stream, h.alloc, h.dispatch_no)
        tk = torch.empty_like(back)
        tk[h.order] = back  # (t, k) order
        _zero_rows(tk, h.dropped)  # masked pairs add 0 (their rows of back were never written)
        ctx.h = h
        ctx.rows = expert_outputs.shape[0]
        return tk.reshape((h.num_tokens, h.topk) + trailing)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        h: DeviceMoEHandle = ctx.h
        trailing = tuple(grad.shape[2:])
        g = grad.reshape((-1,) + trailing).index_select(0, h.order).contiguous()
        gout = h.alloc((ctx.rows,) + trailing, grad.dtype)
        gout.zero_()  # rows past what arrived get no gradient
        oso = h.alloc((2, h.splits_offsets.shape[-1]), torch.int64)
        _dispatch_rows(h.comm, g, h.send_splits, h.experts_per_rank, gout, oso, h.stream, h.dispatch_no,
                       backward=True)
        return gout, None


@D.refusing
def dispatch(comm: Communicator, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, *, stream: int | None = None, alloc: Alloc | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, DeviceMoEHandle]:
    """Send each (token, k) to the rank owning expert ``topk_ids[t, k]`` (experts
    sharded contiguously: rank r owns [r * E/n, (r + 1) * E/n)), with the
    routing on the device. Returns the bound-sized expert-major rows (local
    expert 0's rows from every source first, then expert 1's, ...), the rows
    per local expert ([E/n] int64, on the device), and the handle for
    combine. ``topk_ids`` lie in [0, num_experts), or are -1 for a masked
    (dropped) pair: not sent, it adds 0 in combine (DeepEP's convention).
    They are not read on the host: an id outside [-1, num_experts) makes the
    kernels record an error naming it (raised by the next call or
    ``D.synchronize``) and send nothing, rather than index out of range."""
    n = comm.world_size
    if num_experts <= 0 or num_experts % n:
        raise InvalidArgument(f"num_experts={num_experts} must be a positive multiple of the world size {n}")
    ne = num_experts // n
    if tokens.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens.shape[0]:
        raise InvalidArgument(f"tokens must be [T, H] and topk_ids [T, K], got {tuple(tokens.shape)} and "
                              f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        # (its dtype is known on the host: no sync) 1.7 would be truncated to expert 1, as moe.dispatch refuses
        raise InvalidArgument(f"topk_ids must be an integer tensor (expert indices), not {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise InvalidArgument(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    D._handle(comm)  # where there is no device all-to-all, that (not the routing below) is the error
    with D.torch_on(tokens, stream):
        T, H = tokens.shape
        K = topk_ids.shape[1]
        al = _alloc_like(tokens, alloc)
        flat = topk_ids.reshape(-1).to(torch.int64)
        routed = (flat >= 0) & (flat < num_experts)
        # Pairs not sent sort last under the key E, past every expert's rows.
        key = torch.where(routed, flat, num_experts)
        order = torch.sort(key, stable=True).indices
        x = tokens.detach().index_select(0, order // K).contiguous()
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        splits = counts[:num_experts]
        # An id outside [-1, E) is a routing bug, not a mask: expert 0's count
        # carries a marker the send kernel refuses (a split past the input: nothing
        # is sent) and the host names as bad topk_ids (a2a_device.h kA2ABadIdsMarker).
        bad = (flat < -1).sum() + (flat >= num_experts).sum()
        splits[:1].copy_(torch.where(bad > 0, _C.A2A_BAD_IDS_MARKER + bad, splits[:1]))
        rows = n * D.capacity_rows(comm, H * tokens.element_size())
        oso = al((2, num_experts), torch.int64)
        # (torch.empty, not alloc: an allocator that hands out one buffer per shape would give every handle
        # the same word, and the check would never fire; inside torch.cuda.graph it comes from the graph's pool)
        h = DeviceMoEHandle(comm, T, K, ne, order, splits, oso, torch.empty(0), topk_weights, stream, al, ~routed,
                            torch.empty((1,), dtype=torch.int64, device=tokens.device))
        expert_tokens = _Dispatch.apply(tokens, h, x, rows)  # type: ignore[no-untyped-call]  # unannotated in torch
        h.tokens_per_expert = oso[0].reshape(ne, n).sum(dim=1)
        return expert_tokens, h.tokens_per_expert, h


@D.refusing
def combine(comm: Communicator, expert_outputs: torch.Tensor, handle: DeviceMoEHandle) -> torch.Tensor:
    """Every expert output back to its token's rank, reduced:
    ``y[t] = sum_k topk_weights[t, k] * output(t, k)``. ``expert_outputs``
    has dispatch's layout (its rows past what arrived are ignored)."""
    h = handle
    with D.torch_on(expert_outputs, h.stream):
        per_tk: torch.Tensor = _Combine.apply(expert_outputs, h)  # type: ignore[no-untyped-call]
        return weighted_sum(per_tk, h.topk_weights, h.dropped)
