"""all_to_all_v as a torch.autograd.Function: the gradient of the rows
received goes back to their senders by the reverse all_to_all_v (the rows each
rank received from d, sent back to d), as torch.distributed.nn's
all_to_all_single does. Like every collective, the backward must run on every
rank: x must require grad on all ranks or on none."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ..errors import MessageMismatch, TimeoutError
from . import alltoall

if TYPE_CHECKING:
    from ..comm import Communicator

_RULE = "; x required grad here, so every rank must run backward through this all_to_all_v, in the same order"


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
        try:
            with alltoall.labelled("all_to_all_v's backward", "gradient", backward=True):
                back, sent_back = alltoall.all_to_all_v(comm, grad.contiguous(), recv_splits, tag=tag,
                                                        timeout=timeout)
        except TimeoutError as e:
            late = TimeoutError(str(e) + _RULE)
            late.peer = e.peer
            raise late from None
        if sent_back != splits:
            s = next(i for i, (a, b) in enumerate(zip(sent_back, splits)) if a != b)
            err = MessageMismatch(
                f"all_to_all_v's backward on rank {comm.rank}: rank {s} sent back the gradient of {sent_back[s]} "
                f"rows where this rank sent it {splits[s]}: the ranks' backward passes are out of step")
            err.peer = s
            raise err
        return back, None, None, None, None, None


def all_to_all_v(comm: Communicator, x: torch.Tensor, splits: list[int], tag: int | None,
                 timeout: float | None) -> tuple[torch.Tensor, list[int]]:
    box: list[list[int]] = []
    got = _AllToAllV.apply(x, comm, splits, tag, timeout, box)  # type: ignore[no-untyped-call]  # unannotated in torch
    return cast(torch.Tensor, got), box[0]
