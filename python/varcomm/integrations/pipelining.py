"""torch.distributed.pipelining with variable shapes: a pipeline stage whose
activations and gradients may have any shape on every microbatch and step.

torch's ``PipelineStage`` infers the shapes between stages once (or takes them
from example tensors) and freezes its receive buffers to them; a microbatch of
another length then hangs, corrupts or fails. ``VarcommPipelineStage`` receives
every activation and gradient into a ``varcomm.torch.placeholder()``: the
varcomm backend fills it with the message, whose shape and dtype came with the
data. There is no shape inference, no shape message, no buffer to freeze and
nothing to rebuild when a length changes. Every schedule class of
``torch.distributed.pipelining`` runs it unchanged (GPipe, 1F1B,
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)::

    dist.init_process_group("varcomm")
    stage = VarcommPipelineStage(module, stage_index, num_stages, num_inputs=2)
    schedule = ScheduleInterleaved1F1B([stage, ...], n_microbatches=4, loss_fn=loss_fn)
    # microbatches of their own lengths, e.g. packed [T_i, H] rows with their cu_seqlens:
    pipelining.step(schedule, [(tokens_i, cu_seqlens_i) for i in ...], targets=[labels_i ...])  # first stage
    pipelining.step(schedule)                                       # middle stages
    pipelining.step(schedule, targets=[labels_i ...], losses=losses)  # last stage

``schedule.step(batch)`` still works (it cuts one batch into equal
microbatches); ``step(schedule, microbatches)`` runs microbatches of different
sizes. A schedule's microbatch count is fixed when it is made: for another
count, make another schedule over the same stages (cheap: no shapes to
exchange).

What travels: every tensor a stage's forward returns goes to the next stage
(``num_inputs`` says how many the next one takes: the count is the model's,
the shapes are the data's). Output k of C goes with tag ``7_000_000 + 1000 *
C + k``, and input k of ``num_inputs`` N is received with tag ``7_000_000 +
1000 * N + k``: where C and N differ, nothing pairs up rather than one
microbatch's second output becoming the next microbatch's input. Each stage
also tells the previous one its ``num_inputs`` once, when its first schedule
starts (one small message per pair of stages, ever; tag ``6_000_000 + stage
index``), so the previous stage refuses its first send at once with
ValueError naming both counts; its peer then fails when it stops (a closed
peer), else at the receive's timeout, naming the tags that did arrive. The
tags also carry the step's microbatch count (``+ 10_000_000 * (count mod
100000)``): stages whose schedules were made for other counts time out
naming the tags, where microbatches of two steps paired silently. Floating-point ones are the
differentiable ones: their gradients come back (zeros where autograd gave none); the others (token
ids, ``cu_seqlens``) go forward only. A complex output is refused with
``TypeError`` (torch.distributed sends complex tensors as their real view,
so the next stage would get a float ``[..., 2]`` tensor): send
``torch.view_as_real(t)`` and view it as complex again in the next stage. A tensor of any size travels (over
varcomm's receive bound, ``VARCOMM_BOUND``, by rendezvous in the core). The
stages run on CPU, in a group of the ``"varcomm"`` backend.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _normalize_model_output_as_tuple, _RecvInfo

from .torch_backend import VarcommProcessGroup, placeholder

__all__ = ["VarcommPipelineStage", "step"]


_ACT_TAG = 7_000_000  # (see the module's docstring: tags that say how many tensors the sender sent)
_STEP_TAG_UNIT = 10_000_000  # x the step's microbatch count (mod 100000), in the same tags (below 2**40)
_INPUTS_TAG = 6_000_000  # + the index of the stage that says how many inputs it takes


def _act_tag(count: int, k: int, stage: int, microbatches: int | None) -> int:
    """Output k of `count`, of a step of `microbatches` (None: no schedule yet): stages that disagree on
    either never pair (the step's count too: schedules made for other counts paired microbatches of two
    steps, silently)."""
    if count >= 1000:
        raise ValueError(f"stage {stage}: {count} tensors between two stages; at most 999 travel")
    return _ACT_TAG + 1000 * count + k + _STEP_TAG_UNIT * ((microbatches or 0) % 100_000)


def _has_grad(t: torch.Tensor) -> bool:
    """Whether a tensor between stages carries a gradient back (both sides decide it alike; complex
    outputs are refused: get_fwd_send_ops)."""
    return t.is_floating_point() or t.is_complex()


class VarcommPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose inputs and gradients take the shape of each message.

    ``num_inputs``: how many tensors this stage receives from the previous
    one (the previous stage's forward outputs); ignored on the first stage,
    whose inputs are the microbatch's. ``group``: the pipeline's group, on the
    varcomm backend (default: the default group)."""

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str = "cpu", *, num_inputs: int = 1, group: dist.ProcessGroup | None = None,
                 dw_builder: Callable[[], Callable[..., None]] | None = None):
        device = torch.device(device)
        if device.type != "cpu":
            raise ValueError(f"VarcommPipelineStage: stage on {device}: only CPU stages are supported so far")
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if not isinstance(pg, VarcommProcessGroup):
            raise ValueError(f"VarcommPipelineStage: group {pg!r} is not on the varcomm backend: start "
                             "torch.distributed with init_process_group('varcomm') (or pass a varcomm group)")
        if num_inputs < 1:
            raise ValueError(f"VarcommPipelineStage: num_inputs must be at least 1, not {num_inputs}")
        super().__init__(submodule, stage_index, num_stages, device, group=group, dw_builder=dw_builder)
        self.num_inputs = num_inputs
        # torch's per-chunk check compares shapes with frozen metadata: here shapes are the data's
        self._runtime_validate = False
        self._told_inputs = False  # this stage's num_inputs went to the previous one (once per stage)
        self._told_work: dist.Work | None = None  # that message (kept: its tensor lives until sent)
        self._next_inputs: tuple[dist.Work, torch.Tensor] | int | None = None  # the next stage's num_inputs

    # ---- set-up: no shapes to infer or exchange; num_inputs told once ---------------

    def _prepare_forward_infra(self, num_microbatches: int, args: Any, kwargs: dict[str, Any] | None = None,
                               has_backward: bool = False) -> None:
        n = len(args) if self.is_first and isinstance(args, tuple) else 1 if self.is_first else self.num_inputs
        # backward_one_chunk keeps this many input gradients
        self._stage_meta.inputs = (None,) * n  # type: ignore[assignment]  # counted, never shaped
        self.chunks = num_microbatches
        for i in range(num_microbatches):
            self.args_recv_info[i] = self._recv_infos(i)
        self.act_send_info = {}  # every output goes to the next stage: get_fwd_send_ops
        self._exchange_num_inputs()
        return None

    def _exchange_num_inputs(self) -> None:
        """Once per stage: tell the previous stage how many inputs this one takes, and post the
        receive of the next stage's (checked at the first send: get_fwd_send_ops). A stage on this
        same rank gets its inputs locally (set_local_fwd_input), so nothing goes there."""
        if self._told_inputs:
            return
        self._told_inputs = True
        me = dist.get_rank()
        if not self.is_first and self._peer(self.stage_index - 1) != me:
            self._told_work = dist.isend(torch.tensor([self.num_inputs], dtype=torch.int64),
                                         self._peer(self.stage_index - 1), self.group, _INPUTS_TAG + self.stage_index)
        if not self.is_last and self._peer(self.stage_index + 1) != me:
            buf = torch.zeros(1, dtype=torch.int64)
            work = dist.irecv(buf, self._peer(self.stage_index + 1), self.group, _INPUTS_TAG + self.stage_index + 1)
            if work is not None:  # None only off the group, and a stage is in its group
                self._next_inputs = (work, buf)

    def _check_next_takes(self, count: int, fwd_chunk_id: int) -> None:
        if isinstance(self._next_inputs, tuple):
            work, buf = self._next_inputs
            work.wait()
            self._next_inputs = int(buf[0])
        if isinstance(self._next_inputs, int) and self._next_inputs != count:
            n = self._next_inputs
            raise ValueError(f"{self.log_prefix} microbatch {fwd_chunk_id}: this stage's forward returns {count} "
                             f"tensor{'s' if count != 1 else ''}, and stage {self.stage_index + 1} takes {n} "
                             f"(its num_inputs): every output goes to the next stage, so make them agree "
                             f"(VarcommPipelineStage(..., num_inputs={count}) there, or return {n} tensors here)")

    def _prepare_backward_infra(self, num_microbatches: int, loss_fn: Any = None, target: Any = None,
                                received_grad_meta: Any = None, loss_kwargs: Any = None) -> None:
        self.chunks = num_microbatches
        return None

    def _recv_infos(self, mb: int) -> tuple[_RecvInfo, ...]:
        if self.is_first:
            return tuple(_RecvInfo(f"root_input_{k}", None, None, None, is_root_arg=True)
                         for k in range(len(self._stage_meta.inputs or ())))
        return tuple(_RecvInfo(f"recv_{k}_for_{self.stage_index}_mb{mb}", self.stage_index - 1, None, None)
                     for k in range(self.num_inputs))

    def _peer(self, stage: int) -> int:
        return self._resolve_peer_global_rank(stage)

    # ---- forward ---------------------------------------------------------------

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_first:
            return []
        infos = self._recv_infos(fwd_chunk_id)
        for info in infos:
            info.buffer = placeholder()
        self.args_recv_info[fwd_chunk_id] = infos
        peer = self._peer(self.stage_index - 1)
        return [dist.P2POp(dist.irecv, info.buffer, peer, self.group,
                           _act_tag(len(infos), k, self.stage_index, self.chunks))
                for k, info in enumerate(infos) if info.buffer is not None]

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        outputs = _normalize_model_output_as_tuple(prev_stage_outputs)
        self.args_recv_info[mb_index] = tuple(
            _RecvInfo(f"local_{k}_for_{self.stage_index}_mb{mb_index}", self.stage_index - 1,
                      _tensor(t, "output", self.stage_index - 1).detach(), None)
            for k, t in enumerate(outputs))

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> tuple[torch.Tensor, ...]:
        grad = self.has_backward and torch.is_grad_enabled()
        acts = []
        for info in self.args_recv_info[fwd_chunk_id]:
            t = info.buffer
            if t is None:
                raise RuntimeError(f"{self.log_prefix} microbatch {fwd_chunk_id}: forward before its inputs were "
                                   "received (the schedule ran F without RECV_F)")
            acts.append(t.requires_grad_(grad and _has_grad(t)))
        return tuple(acts)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_last:
            return []
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        self._check_next_takes(len(outputs), fwd_chunk_id)
        peer = self._peer(self.stage_index + 1)
        for t in outputs:
            if _tensor(t, "output", self.stage_index).is_complex():
                # torch.distributed sends a complex tensor as its real view (view_as_real): the next
                # stage's placeholder would get a float tensor of shape [..., 2], not this tensor
                raise TypeError(f"{self.log_prefix} microbatch {fwd_chunk_id}: an output of dtype {t.dtype} "
                                "cannot go to the next stage: torch.distributed sends complex tensors as their "
                                "real view, so it would arrive as a float tensor of shape [..., 2]; return "
                                "torch.view_as_real(t) and take torch.view_as_complex(x) in the next stage")
        return [dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group,
                           _act_tag(len(outputs), k, self.stage_index, self.chunks)) for k, t in enumerate(outputs)]

    # ---- backward --------------------------------------------------------------

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last:
            return []
        outputs, _ = self.fwd_cache[bwd_chunk_id]
        infos = tuple(_RecvInfo(f"recv_grad_{k}_for_{self.stage_index}_mb{bwd_chunk_id}", self.stage_index + 1,
                                placeholder() if _has_grad(t) else None, None) for k, t in enumerate(outputs))
        self.grad_recv_info[bwd_chunk_id] = infos
        peer = self._peer(self.stage_index + 1)
        return [dist.P2POp(dist.irecv, info.buffer, peer, self.group) for info in infos if info.buffer is not None]

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        outputs, _ = self.fwd_cache[mb_index]
        self.grad_recv_info[mb_index] = tuple(
            _RecvInfo(f"local_grad_{k}_for_{self.stage_index}_mb{mb_index}", self.stage_index + 1,
                      torch.zeros_like(out) if g is None and _has_grad(out) else g, None)
            for k, (out, g) in enumerate(zip(outputs, next_stage_bwd_outputs)))

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> tuple[torch.Tensor | None, ...]:
        return tuple(info.buffer for info in self.grad_recv_info.pop(bwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_first:
            return []
        self._check_chunk_id(bwd_chunk_id)
        grads = self.bwd_cache.pop(bwd_chunk_id)
        inputs = [info.buffer for info in self.args_recv_info[bwd_chunk_id]]
        self.args_recv_info[bwd_chunk_id] = ()  # the received activations are no longer needed here
        peer = self._peer(self.stage_index - 1)
        ops = []
        for x, g in zip(inputs, grads):
            if x is not None and _has_grad(x):  # the previous stage waits for exactly these
                g = torch.zeros_like(x) if g is None else g.contiguous()
                ops.append(dist.P2POp(dist.isend, g, peer, self.group))
        return ops


def _tensor(t: Any, what: str, stage: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"stage {stage}: an {what} sent between stages must be a tensor, not {type(t).__name__}")
    return t


def step(schedule: Any, microbatches: Sequence[Any] | None = None, targets: Sequence[Any] | None = None, *,
         kwargs: Sequence[dict[str, Any]] | None = None, losses: list[Any] | None = None,
         return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None) -> Any:
    """``schedule.step()`` on microbatches given one by one, each of its own size.

    ``microbatches`` (ranks holding the first stage): one entry per
    microbatch, a tensor or a tuple of the first stage's positional inputs.
    ``targets`` (ranks holding the last stage): the loss function's target
    for each. ``kwargs``: keyword inputs for each microbatch. Returns what
    ``schedule.step`` returns: the last stage's outputs, concatenated along
    dim 0, on the rank holding it (else None); where the microbatches' outputs
    differ in more than their leading size (``[B, T, H]`` with T per
    microbatch), which no concatenation joins, a list of them, one per
    microbatch (``return_outputs=False``: none kept)."""
    n = schedule._n_microbatches
    for name, given in (("microbatches", microbatches), ("targets", targets), ("kwargs", kwargs)):
        if given is not None and len(given) != n:
            raise ValueError(f"step: {len(given)} {name} for a schedule of {n} microbatches; make a schedule for "
                             f"{len(given)} over the same stages (schedules are cheap to make, stages stay)")
    if schedule._has_backward and not torch.is_grad_enabled():
        raise RuntimeError("step() runs a backward: call it with gradients enabled (not under torch.no_grad())")
    stages = list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]
    for s in stages:
        s.has_backward = schedule._has_backward
        s.clear_runtime_states()
        s.chunks = n  # another schedule over these stages may have run another count
    arg_mbs = None if microbatches is None else [mb if isinstance(mb, tuple) else (mb,) for mb in microbatches]
    schedule._step_microbatches(arg_mbs, None if kwargs is None else list(kwargs),
                                None if targets is None else list(targets), losses, return_outputs,
                                loss_kwargs=loss_kwargs)
    for s in stages:
        if s.is_last and return_outputs:
            # (torch.cat raised, after the whole step had run; a merge spec of the schedule's own decides itself)
            if getattr(schedule, "_output_merge_spec", None) is None and not _joinable(s.output_chunks):
                return list(s.output_chunks)
            return schedule._merge_outputs(s.output_chunks)
    return None


def _joinable(chunks: Sequence[Any]) -> bool:
    """Whether the microbatches' outputs concatenate along dim 0: the same
    structure, and tensors alike but for their leading size."""
    from torch.utils._pytree import tree_flatten

    flat = [tree_flatten(c) for c in chunks]
    if any(spec != flat[0][1] for _, spec in flat):
        return False
    for leaves in zip(*(f[0] for f in flat)):
        if all(isinstance(t, torch.Tensor) for t in leaves):
            if any(t.dim() == 0 or t.shape[1:] != leaves[0].shape[1:] for t in leaves):  # (dtypes: cat promotes)
                return False
    return True
