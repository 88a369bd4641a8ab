"""all_to_all_v as a torch.autograd.Function: the gradient of the rows
received goes back to their senders by the reverse all_to_all_v (the rows each
rank received from d, sent back to d), as torch.distributed.nn's
all_to_all_single does. Like every collective, the backward must run on every
rank: x must require grad on all ranks or on none.

`exchange` is the all_to_all_v of every autograd layer here (this one and
moe's): named in the caller's terms, a backward's timeout stating the
every-rank rule, and the rows sent back checked against the step undone.

The device-split form (alltoall_device.all_to_all_vdev, _2d) is one more
Function: its gradient goes back by the combine (all_to_all_vdev_2d_offset)
over the forward's out_splits_offsets, every count staying on the device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ..errors import MessageMismatch, TimeoutError
from . import alltoall

if TYPE_CHECKING:
    from ..comm import Communicator

_RULE = "; x required grad here, so every rank must run backward through this all_to_all_v, in the same order"
_BACKWARD = ("all_to_all_v's backward", "gradient", True)


def exchange(comm: Communicator, x: torch.Tensor, splits: list[int], label: tuple[str, str, bool], *,
             expect: list[int] | None = None, rule: str = "", why: str = "", tag: int | None = None,
             timeout: float | None = None,
             agree: tuple[int, int, str, str] = (0, 0, "", "")) -> tuple[torch.Tensor, list[int]]:
    """all_to_all_v of x, named `label` (alltoall.labelled: operation, input,
    backward), carrying `agree` (alltoall.agreeing). A timeout gets `rule`
    appended; rows back from a rank that differ from `expect` (what this rank
    sent it, or received from it, in the step undone) are MessageMismatch
    naming it, then `why`."""
    try:
        with alltoall.labelled(*label), alltoall.agreeing(*agree):
            got, rows = alltoall.all_to_all_v(comm, x, splits, tag=tag, timeout=timeout)
    except TimeoutError as e:
        if not rule:
            raise
        late = TimeoutError(str(e) + rule)
        late.peer = e.peer
        raise late from None
    if expect is not None and rows != expect:
        s = next(i for i, (a, b) in enumerate(zip(rows, expect)) if a != b)
        err = MessageMismatch(f"{label[0]} on rank {comm.rank}: rank {s} sent back {rows[s]} rows where "
                              f"{expect[s]} belong: {why}")
        err.peer = s
        raise err
    return cast(torch.Tensor, got), rows


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, splits: list[int], tag: int | None,
                timeout: float | None, box: list[list[int]]) -> torch.Tensor:
        got, recv_splits = alltoall.all_to_all_v(comm, x.detach(), splits, tag=tag, timeout=timeout)
        box.append(recv_splits)
        ctx.args = (comm, list(splits), recv_splits, tag, timeout)
        return cast(torch.Tensor, got)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        comm, splits, recv_splits, tag, timeout = ctx.args
        back, _ = exchange(comm, grad.contiguous(), recv_splits, _BACKWARD, expect=splits, rule=_RULE,
                           why="the ranks' backward passes are out of step", tag=tag, timeout=timeout)
        return back, None, None, None, None, None


def all_to_all_v(comm: Communicator, x: torch.Tensor, splits: list[int], tag: int | None,
                 timeout: float | None) -> tuple[torch.Tensor, list[int]]:
    box: list[list[int]] = []
    got = _AllToAllV.apply(x, comm, splits, tag, timeout, box)  # type: ignore[no-untyped-call]  # unannotated in torch
    return cast(torch.Tensor, got), box[0]


class _VDev2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, splits: Any, ne: int, stream: int | None,
                timeout: float | None) -> Any:
        from . import alltoall_device as D

        n = comm.world_size
        xd = x.detach()
        out = torch.empty((n * D.capacity_rows(comm, _row_bytes(xd)),) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        oso = torch.empty((2, n * ne), dtype=torch.int64, device=x.device)
        D.all_to_all_vdev_2d(comm, xd, splits, ne, out=out, out_splits_offsets=oso, stream=stream, timeout=timeout)
        D.torch_after(comm, x, stream, timeout)
        ctx.mark_non_differentiable(oso)
        # A copy of its own (ordered on the stream like the rest): the caller may reuse the returned one, and a
        # saved output modified in place would make torch raise on this rank only, leaving the peers' backward
        # waiting for its timeout. (Saved, not kept on ctx: a second backward without retain_graph is torch's
        # error on the rank that tries it, not an extra call its peers never make.)
        ctx.save_for_backward(oso.clone())
        ctx.args = (comm, ne, stream, timeout, int(x.shape[0]))
        return out, oso

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Any:
        from . import alltoall_device as D

        comm, ne, stream, timeout, rows = ctx.args
        # On a GPU, autograd runs this on the forward's current stream, where torch made grad and
        # consumes the result; the device protocol orders calls across streams.
        s = None if grad.is_cuda else stream
        (oso,) = ctx.saved_tensors
        before = D.launched(comm)
        try:
            gx = torch.zeros((rows,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)  # not sent: 0
            bso = torch.empty_like(oso)
            # The combine sends each source's rows back in the order they were sent: x's own.
            D.all_to_all_vdev_2d_offset(comm, grad.contiguous(), oso, ne, out=gx, out_splits_offsets=bso,
                                        stream=s, timeout=timeout, _backward=True)
        except Exception as e:  # (before the launch: refused, so the peers' backward does not wait for it)
            D.refuse_unlaunched(comm, e, before, grad, s, timeout)
            raise
        D.torch_after(comm, grad, s, timeout)
        return gx, None, None, None, None, None


def _row_bytes(x: torch.Tensor) -> int:
    return torch.Size(x.shape[1:]).numel() * x.element_size()


def all_to_all_vdev_2d(comm: Communicator, x: torch.Tensor, splits: Any, experts_per_rank: int, stream: int | None,
                       timeout: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """alltoall_device.all_to_all_vdev_2d (experts_per_rank=1: all_to_all_vdev) carrying x's graph."""
    from . import alltoall_device as D

    with D.torch_on(x, stream):  # (its out and the saved copy of out_splits_offsets are made on the kernels' stream)
        out, oso = _VDev2d.apply(x, comm, splits, experts_per_rank, stream, timeout)  # type: ignore[no-untyped-call]
    return cast(torch.Tensor, out), cast(torch.Tensor, oso)
