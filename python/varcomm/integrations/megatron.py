"""Megatron-Core's pipeline communication without the shape contract.

megatron-core's ``P2PCommunicator`` with ``variable_seq_lengths=True`` sends
every tensor's shape as a message of its own, waits for it, calls
``torch.cuda.synchronize()`` and ``.tolist()`` (a host sync), allocates, and
only then receives the data. ``VarcommP2PCommunicator`` is a drop-in subclass
whose every method (``send_forward``, ``recv_forward``, ``send_backward``,
``recv_backward``, ``send_forward_recv_backward``,
``send_backward_recv_forward``, ``send_forward_recv_forward``,
``send_backward_recv_backward``,
``send_forward_backward_recv_forward_backward``) sends the tensor alone and
receives into a ``varcomm.torch.placeholder()``: the shape (and dtype) comes
with the data, so no shape message, no synchronize, no ``tensor_shape``
needed (it is accepted and ignored)::

    dist.init_process_group("varcomm")     # the pipeline group must be on varcomm
    p2p = VarcommP2PCommunicator(pp_group, config)
    forward_backward_pipelining_without_interleaving(..., p2p_communicator=p2p, pg_collection=pgs)

Tensors go through the pipeline group's varcomm Communicator directly (not
through torch.distributed), so GPU tensors take varcomm's device paths rather
than the NCCL backend under the varcomm group. A receive with
``overlap_p2p_comm`` returns its tensor at once, as Megatron's does; it holds
the message once its handle's ``wait()`` returned.

Verified on CPU with megatron-core 0.16.1 (tests/test_megatron.py); on GPUs
it is unverified.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from .torch_backend import VarcommProcessGroup, placeholder, recv_into_placeholder

__all__ = ["VarcommP2PCommunicator"]


class VarcommP2PCommunicator(P2PCommunicator):
    """megatron.core's P2PCommunicator, on varcomm: variable shapes with no shape messages and no host sync.

    ``pp_group``: the pipeline group, on the varcomm backend; ``config``: the
    model's ModelParallelConfig (its ``variable_seq_lengths`` is not needed:
    every shape is variable here)."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any):
        if not isinstance(pp_group, VarcommProcessGroup):
            raise ValueError(f"VarcommP2PCommunicator: the pipeline group {pp_group!r} is not on the varcomm "
                             "backend: start torch.distributed with init_process_group('varcomm') (its new_group()s "
                             "are varcomm groups)")
        super().__init__(pp_group, config)
        self.comm = pp_group.comm
        me, n = self.comm.rank, self.comm.world_size
        self._next, self._prev = (me + 1) % n, (me - 1) % n  # group ranks, as Megatron's ring

    def _communicate(self, *, tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                     recv_prev: bool, recv_next: bool, tensor_shape: Any = None,
                     wait_on_reqs: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        comm = self.comm
        reqs: dict[str, Any] = {}
        if tensor_send_next is not None:
            reqs["send_next"] = comm.isend(tensor_send_next.detach().contiguous(), self._next)
        if tensor_send_prev is not None:
            reqs["send_prev"] = comm.isend(tensor_send_prev.detach().contiguous(), self._prev)
        recv_prev_t = recv_next_t = None
        if recv_prev:  # Megatron makes its receive buffers leaves that require grad: so does this
            recv_prev_t = placeholder(requires_grad=True)
            reqs["recv_prev"] = recv_into_placeholder(comm, recv_prev_t, self._prev)
        if recv_next:
            recv_next_t = placeholder(requires_grad=True)
            reqs["recv_next"] = recv_into_placeholder(comm, recv_next_t, self._next)
        if wait_on_reqs:
            for r in reqs.values():
                r.wait()
            return recv_prev_t, recv_next_t, None
        return recv_prev_t, recv_next_t, reqs
