"""Pipeline parallelism end to end: examples/pipeline_varlen.py (1F1B on packed
variable-length sequences through varcomm) against the same training in one
process; and torch.distributed.pipelining on the "varcomm" backend.

Tolerance: float32 with rtol 1e-5, atol 1e-6 on the losses, the last step's
parameter gradients and the trained parameters. The pipeline runs exactly the
single-process computation, split at stage boundaries, with gradients
accumulated over micro-batches in the same order, so in practice they agree
to the last bit; the tolerance only allows for kernel differences."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import varcomm.torch  # registers the backend
from varcomm.testing import world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pipeline_varlen as pv

RTOL, ATOL = 1e-5, 1e-6
CFG = pv.Config(vocab=48, hidden=64, heads=2, layers=4, max_len=32, max_seqs=3)
STEPS = 3


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _pipeline_matches_one_process(n_micro: int, backends: tuple[str, ...] = ("varcomm",)) -> None:
    chans, rank, n = pv.setup(backends, timeout=60)
    try:
        want = pv.train_reference(CFG, steps=STEPS, n_micro=n_micro, seed=3)
        for backend in backends:
            got = pv.train(chans[backend], rank, n, CFG, steps=STEPS, n_micro=n_micro, seed=3)
            if rank == n - 1:
                _close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), f"{backend}: losses")
            else:
                assert got["losses"] == []
            assert got["grads"], "this stage has no parameters"
            for name, g in got["grads"].items():
                _close(g, want["grads"][name], f"{backend}: gradient of {name} at step {STEPS - 1}")
            for name, p in got["params"].items():
                _close(p, want["params"][name], f"{backend}: {name} after {STEPS} steps")
        # every parameter of the model lives on exactly one stage
        counts = [None] * n
        dist.all_gather_object(counts, sorted(got["params"]))
        names = [x for c in counts for x in c]
        assert sorted(names) == sorted(want["params"]) and len(set(names)) == len(names)
    finally:
        pv.teardown(chans)


@world(2, timeout=90)
def test_pipeline_2_stages_matches_one_process():
    # also on varcomm's fallback transport, and the example's spelled-out Megatron channel
    _pipeline_matches_one_process(n_micro=4, backends=pv.BACKENDS)


@world(4, timeout=120)
def test_pipeline_4_stages_matches_one_process():
    _pipeline_matches_one_process(n_micro=3)  # fewer micro-batches than stages: a short 1F1B


def test_attention_mask_is_block_diagonal_causal():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    m = pv.attention_mask(cu).int().tolist()
    assert m == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [0, 0, 1, 0, 0],
                 [0, 0, 1, 1, 0],
                 [0, 0, 1, 1, 1]]
    batches = pv.make_batches(CFG, 0, 6, seed=1)
    assert len({int(b.cu_seqlens[-1]) for b in batches}) > 1, "micro-batches should vary in length"


@world(2, timeout=90)
def test_torch_pipelining_on_varcomm_backend():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("varcomm")
    try:
        rank = dist.get_rank()
        comm = varcomm.torch.comm_of()
        sent = []
        real_isend, real_batch = comm.isend, comm.batch_isend_irecv
        comm.isend = lambda *a, **k: sent.append(1) or real_isend(*a, **k)
        comm.batch_isend_irecv = lambda ops: sent.append(1) or real_batch(ops)  # the schedules' batches
        torch.manual_seed(0)
        full = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
        ref = copy.deepcopy(full)
        x, target = torch.randn(8, 16), torch.randn(8, 8)
        loss_fn = nn.MSELoss(reduction="sum")
        want = loss_fn(ref(x), target)
        want.backward()
        mod = full[:2] if rank == 0 else full[2:]  # shares the parameters (and names) of `full`
        for schedule in (ScheduleGPipe, Schedule1F1B):
            full.zero_grad(set_to_none=True)
            stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
            sched = schedule(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=target, losses=losses)
                torch.testing.assert_close(torch.stack(losses).sum(), want.detach(), rtol=1e-5, atol=1e-5)
            for name, p in mod.named_parameters():
                i, attr = name.split(".")
                rp = getattr(ref[int(i)], attr)
                torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, n=name, s=schedule.__name__: f"{s} {n}: {m}")
        assert sent, "the pipeline's activations and gradients did not go through varcomm"
    finally:
        dist.destroy_process_group()
