"""torch.distributed.pipelining with variable shapes: VarcommPipelineStage under
every schedule class of torch, on packed microbatches whose length T changes
from microbatch to microbatch, and whose count changes from step to step,
against the same training in one process (examples/pipelining_varlen.py's
trainer and reference); and varcomm.torch.placeholder(), the any-shape receive
it stands on.

Tolerance: float32, rtol 1e-6, atol 1e-7 on the losses, the last step's
gradients and the trained parameters. The pipeline computes exactly the
one-process sums, split at stage boundaries; only the order in which a
schedule accumulates microbatch gradients may differ (LoopedBFS), which moves
the last bits."""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import varcomm.torch
from varcomm.integrations.pipelining import VarcommPipelineStage
from varcomm.testing import world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pipeline_varlen as pv
import pipelining_varlen as ppv

RTOL, ATOL = 1e-6, 1e-7
STEPS = 3
CFG = pv.Config(vocab=48, hidden=32, heads=2, layers=4, max_len=24, max_seqs=3)
CFG8 = pv.Config(vocab=48, hidden=32, heads=2, layers=8, max_len=24, max_seqs=3)  # 8 stages on 4 ranks


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _spy_sends(comm) -> list[tuple[torch.Tensor, int]]:
    """Record every tensor sent through a Communicator, alone or in a batch, with its tag."""
    sent: list[tuple[torch.Tensor, int]] = []
    real, real_batch = comm.isend, comm.batch_isend_irecv

    def isend(t, dst, tag=0, *a, **k):
        sent.append((t, tag))
        return real(t, dst, tag, *a, **k)

    def batch_isend_irecv(ops):
        ops = list(ops)
        sent.extend((op.tensor, op.tag) for op in ops if op.op.__name__ == "isend")
        return real_batch(ops)

    comm.isend, comm.batch_isend_irecv = isend, batch_isend_irecv
    return sent


def _expected_row_counts(name: str, cfg: pv.Config, rank: int, world_size: int, counts: list[int]) -> Counter:
    """How often each activation/gradient length T leaves this rank: once per microbatch for
    each stage boundary this rank sends across, forward (activations) and backward (gradients)."""
    indices = ppv.stage_indices(name, rank, world_size)
    n = world_size * len(indices)
    home = {s: r for r in range(world_size) for s in ppv.stage_indices(name, r, world_size)}
    crossings = sum((s < n - 1 and home[s + 1] != rank) + (s > 0 and home[s - 1] != rank) for s in indices)
    rows: Counter = Counter()
    for step, m in enumerate(counts):
        for mb in pv.make_batches(cfg, step, m, 0):
            rows[int(mb.cu_seqlens[-1])] += crossings
    return rows


def _expected_num_inputs_told(name: str, rank: int, world_size: int) -> list[tuple[int, list[int]]]:
    """(stage, [its num_inputs]) for this rank's stages whose previous stage is on another rank: each of
    the example's stages takes 2 (hidden rows and cu_seqlens)."""
    indices = ppv.stage_indices(name, rank, world_size)
    home = {s: r for r in range(world_size) for s in ppv.stage_indices(name, r, world_size)}
    return sorted((s, [2]) for s in indices if s > 0 and home[s - 1] != rank)


def _schedules_match_one_process(names: tuple[str, ...], cfg: pv.Config) -> None:
    dist.init_process_group("varcomm")
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        sent = _spy_sends(varcomm.torch.comm_of())
        references: dict[tuple[int, ...], dict] = {}
        for name in names:
            counts = ppv.micro_counts(name, n, STEPS, 2 * n)
            assert len(set(counts)) > 1, "the microbatch count should change from step to step"
            key = tuple(counts)
            if key not in references:
                references[key] = ppv.train_reference(cfg, counts)
            want = references[key]
            sent.clear()
            t = ppv.PipelineTrainer(name, cfg, rank, n)
            losses = [t.step(step, m) for step, m in enumerate(counts)]
            if t.last:
                _close(torch.tensor(losses), torch.tensor(want["losses"]), f"{name}: losses")
            else:
                assert losses == [None] * STEPS
            assert t.grads, f"{name}: this rank's stages have no parameters"
            for pname, g in t.grads.items():
                _close(g, want["grads"][pname], f"{name}: gradient of {pname} at step {STEPS - 1}")
            for pname in t.names:
                _close(dict(t.model.named_parameters())[pname].detach(), want["params"][pname],
                       f"{name}: {pname} after {STEPS} steps")
            # Every activation and gradient went through varcomm with its own length, and
            # nothing else of that kind: no shape messages, no padding.
            rows = Counter(x.shape[0] for x, _ in sent if x.dim() == 2)
            assert rows == _expected_row_counts(name, cfg, rank, n, counts), f"{name}: sent {rows}"
            # Besides them, only each stage's num_inputs, once, to a previous stage on another rank
            told = sorted((tag - 6_000_000, x.tolist()) for x, tag in sent if 6_000_000 <= tag < 7_000_000)
            assert told == _expected_num_inputs_told(name, rank, n), f"{name}: num_inputs sent {told}"
            assert not [x for x, tag in sent if x.dtype == torch.int64 and not 6_000_000 <= tag < 7_000_000], \
                f"{name}: a shape message was sent"
            # every activation's tag says its step's microbatch count (7_000_000 + ... + 10_000_000 * count)
            acts = [tag for _, tag in sent if tag >= 7_000_000]
            assert all(tag >= 10_000_000 for tag in acts), f"{name}: activation tags without the count {acts}"
            if acts:
                assert {tag // 10_000_000 for tag in acts} == set(counts), f"{name}: tags {sorted(set(acts))}"
            assert all(x.shape[-1] == cfg.hidden for x, _ in sent if x.dim() == 2)
    finally:
        dist.destroy_process_group()


@world(2, timeout=240)
def test_every_schedule_on_2_ranks_matches_one_process():
    _schedules_match_one_process(tuple(ppv.SCHEDULES), CFG)


@world(4, timeout=240)
def test_every_schedule_on_4_ranks_matches_one_process():
    _schedules_match_one_process(tuple(ppv.SCHEDULES), CFG8)


def test_schedule_lists_cover_torch():
    """Every schedule class the issue names is exercised, each with its own stage layout."""
    assert set(ppv.SCHEDULES) == {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                  "ZBVZeroBubble", "DualPipeV"}
    assert ppv.stage_indices("DualPipeV", 1, 4) == [1, 6] and ppv.stage_indices("LoopedBFS", 1, 4) == [1, 5]
    for step in range(STEPS):
        sizes = {int(mb.cu_seqlens[-1]) for mb in pv.make_batches(CFG, step, 4, 0)}
        assert len(sizes) > 1, "microbatches should differ in length"


@world(2, timeout=60)
def test_placeholder_receives_any_shape():
    os.environ["VARCOMM_BOUND"] = str(64 * 1024)  # small slots: a message over the bound (rendezvous) is cheap
    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        big = torch.arange(40_000, dtype=torch.float64).reshape(100, 400)  # 320 KB: over the bound
        msgs = [torch.arange(6.0).reshape(2, 3), torch.ones(7, 3), torch.tensor([1, 2, 3], dtype=torch.int32),
                torch.empty(0, 3), big, torch.full((4,), 2.5)]
        if r == 0:
            for m in msgs:
                dist.send(m, dst=1)
            dist.send(torch.ones(3), dst=1)  # an exact-size recv is unchanged
            dist.send(torch.ones(5), dst=1)
        else:
            ps = [varcomm.torch.placeholder(requires_grad=k == 0) for k in range(len(msgs) - 1)]
            works = [dist.irecv(p, src=0) for p in ps[:2]]  # posted together, matched in posting order
            for w in works:
                w.wait()
            for p in ps[2:]:
                dist.recv(p, src=0)
            for p, m in zip(ps, msgs):
                assert p.shape == m.shape and p.dtype == m.dtype and torch.equal(p.detach(), m), (p, m)
            assert ps[0].requires_grad and ps[0].is_leaf and not ps[1].requires_grad
            p = varcomm.torch.placeholder()
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, p, 0)])[0].wait()
            assert p.tolist() == [2.5] * 4
            x = torch.zeros(3)
            dist.recv(x, src=0)
            assert x.tolist() == [1.0] * 3
            with pytest.raises(RuntimeError, match="larger"):
                dist.recv(torch.zeros(3), src=0)  # a plain tensor still takes exactly its size
            dist.recv(varcomm.torch.placeholder(), src=0)  # the refused message was kept
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_stage_refuses_what_it_cannot_run():
    dist.init_process_group("varcomm")
    try:
        gloo = dist.new_group(backend="gloo")
        mod = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="not on the varcomm backend"):
            VarcommPipelineStage(mod, dist.get_rank(), 2, group=gloo)
        with pytest.raises(ValueError, match="only CPU"):
            VarcommPipelineStage(mod, dist.get_rank(), 2, device="meta")
        with pytest.raises(ValueError, match="num_inputs"):
            VarcommPipelineStage(mod, dist.get_rank(), 2, num_inputs=0)
        stage = VarcommPipelineStage(mod, 0, 2)
        bound = varcomm.torch.comm_of().bound
        stage.fwd_cache[0] = ((torch.zeros(bound // 4 + 1),), [])
        assert len(stage.get_fwd_send_ops(0)) == 1  # over the bound travels too (the op is not run)
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_step_returns_outputs_that_differ_beyond_dim_0_as_a_list():
    """Microbatches [2, T, 4] with T = 3 and 5: the last stage's step()
    crashed in torch.cat after the whole step had run (RuntimeError: sizes of
    tensors must match), and its peers then failed. Now its outputs come back
    as a list, one per microbatch; outputs alike but for dim 0 still as one."""
    from torch.distributed.pipelining import Schedule1F1B

    from varcomm.integrations.pipelining import step

    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        torch.manual_seed(0)
        mod = torch.nn.Linear(4, 4)
        stage = VarcommPipelineStage(mod if r == 0 else torch.nn.Identity(), r, 2)
        for lengths, joined in (((3, 5), False), ((3, 3), True)):
            mbs = [torch.randn(2, t, 4, generator=torch.Generator().manual_seed(t)) for t in lengths]
            schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
            got = step(schedule, mbs if r == 0 else None, targets=mbs if r == 1 else None)
            if r == 0:
                assert got is None
                continue
            want = [mod(x).detach() for x in mbs]
            if joined:
                assert isinstance(got, torch.Tensor) and torch.allclose(got, torch.cat(want))
            else:
                assert isinstance(got, list) and [tuple(g.shape) for g in got] == [(2, 3, 4), (2, 5, 4)], got
                assert all(torch.allclose(g, w) for g, w in zip(got, want))
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_complex_output_is_refused_not_sent_as_its_real_view():
    """A complex activation between stages: torch.distributed (and the varcomm
    backend's batch_isend_irecv) send complex tensors as their real view, so
    the next stage's placeholder would take a float tensor of shape [..., 2]
    and its forward compute on the wrong dtype. The sending stage refuses it,
    naming the dtype and the workaround, before anything is posted.
    Catches: a complex output sent as is (the next stage gets float32 [T, H, 2])."""
    dist.init_process_group("varcomm")
    try:
        stage = VarcommPipelineStage(torch.nn.Linear(2, 2), 0, 2)
        z = torch.randn(3, 4, dtype=torch.complex64)
        stage.fwd_cache[0] = ((torch.ones(3, 4), z), [])
        with pytest.raises(TypeError, match="complex64.*view_as_real"):
            stage.get_fwd_send_ops(0)
        stage.fwd_cache[1] = ((torch.ones(3, 4), torch.view_as_real(z)), [])
        assert len(stage.get_fwd_send_ops(1)) == 2  # the real view travels, as the error says
    finally:
        dist.destroy_process_group()


@world(2, timeout=90)
def test_a_stage_taking_fewer_inputs_than_the_last_one_sends_is_told_not_fed_the_next_microbatch():
    """Stage 0 returns two tensors, stage 1 keeps the default num_inputs=1:
    every activation went with tag 0, so stage 1 took microbatch 0's second
    output as microbatch 1's input (rows of 100s where 2s belong), with no
    error. Then the tags said how many tensors were sent, and nothing paired
    up, but stage 1 learnt it only at its receive's timeout (the group's:
    torch's default is 30 minutes). Now stage 1 tells stage 0 its num_inputs
    when the schedule starts: stage 0 refuses its first send at once, naming
    both counts, and stage 1 fails as soon as stage 0 stops, long before the
    timeout."""
    from datetime import timedelta

    from torch.distributed.pipelining import ScheduleGPipe

    class Two(torch.nn.Module):
        def forward(self, x):
            return x, x * 100

    class One(torch.nn.Module):
        def forward(self, x):
            return x + 0

    dist.init_process_group("varcomm", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    stage = VarcommPipelineStage(Two() if rank == 0 else One(), rank, 2)
    schedule = ScheduleGPipe(stage, n_microbatches=2)
    mbs = [torch.full((3, 2), float(i + 1)) for i in range(2)]
    from varcomm.integrations import pipelining

    t0 = time.monotonic()
    if rank == 0:
        with pytest.raises(ValueError, match=r"returns 2 tensors, and stage 1 takes 1 \(its num_inputs\)"):
            pipelining.step(schedule, mbs)
        assert time.monotonic() - t0 < 10, "stage 0 learnt it from a timeout"
        dist.destroy_process_group()  # what a rank that raised does on its way out
    else:
        with pytest.raises(Exception, match="rank 0"):
            pipelining.step(schedule)
        assert time.monotonic() - t0 < 20, "stage 1 waited for its timeout"
        dist.destroy_process_group()


@world(2, timeout=90)
def test_stages_whose_steps_run_other_microbatch_counts_are_told_not_paired_across_steps():
    """Stage 0 runs steps of 4 microbatches, stage 1 steps of 5 (each rank made
    its schedule with another count): both exited 0, and stage 1's step 0 took
    stage 0's step 0 microbatches 0-3 and step 1's microbatch 0, silently.
    Now the activations' tags carry the step's count: nothing pairs, and stage
    1's receive times out naming the tags that wait unreceived."""
    from datetime import timedelta

    from torch.distributed.pipelining import ScheduleGPipe

    from varcomm.integrations import pipelining

    class Id(torch.nn.Module):
        def forward(self, x):
            return x + 0

    dist.init_process_group("varcomm", timeout=timedelta(seconds=4))
    rank = dist.get_rank()
    n = 4 if rank == 0 else 5
    schedule = ScheduleGPipe(VarcommPipelineStage(Id(), rank, 2), n_microbatches=n)
    if rank == 1:
        with pytest.raises(Exception, match=r"timed out.*tag 4\d{7}"):
            pipelining.step(schedule)
    else:
        with pytest.raises(Exception, match="rank 1|timed out"):  # its ring fills (8 slots), or rank 1 left
            for step in range(5):
                pipelining.step(schedule, [torch.full((2, 3), 10.0 * step + i) for i in range(n)])
    dist.destroy_process_group()
