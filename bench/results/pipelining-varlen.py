"""Step time of torch.distributed.pipelining on packed variable-length
microbatches, three ways in one run (the methods take turns, step by step):

  varcomm   VarcommPipelineStage on the "varcomm" backend: every microbatch at its own length T
  rebuild   torch's PipelineStage on gloo, stages and schedule rebuilt every step with that step's
            shapes, every microbatch padded to the step's longest (a step's microbatches must agree)
  pad       torch's PipelineStage on gloo, built once, every microbatch padded to the longest possible
            (max_seqs * max_len tokens)

Same model, same data (examples/pipeline_varlen.py's), same schedule class;
padding is a sequence of its own (cu_seqlens) with labels -100, so every
method trains the same loss. Used by bench/results/pipelining-varlen-2026-12-02.md:

    python -m varcomm.run -n 2 bench/results/pipelining-varlen.py --schedule 1F1B --steps 12
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import pipeline_varlen as pv
import pipelining_varlen as ppv

from varcomm.integrations import pipelining


def padded(mb: pv.MicroBatch, t_pad: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, cu_seqlens, labels) padded to t_pad tokens and k cu_seqlens entries: the padding is one
    more sequence (then empty ones), its labels -100."""
    t = mb.tokens.numel()
    cu = torch.cat([mb.cu_seqlens, torch.full((k - mb.cu_seqlens.numel(),), t_pad, dtype=torch.int32)])
    return F.pad(mb.tokens, (0, t_pad - t)), cu, F.pad(mb.labels, (0, t_pad - t), value=-100)


class GlooTrainer(ppv.PipelineTrainer):
    """torch's own PipelineStage on a gloo group, fed padded microbatches."""

    def __init__(self, schedule: str, cfg: pv.Config, rank: int, world: int, gloo: dist.ProcessGroup, rebuild: bool):
        super().__init__(schedule, cfg, rank, world)
        self.gloo, self.rebuild = gloo, rebuild
        self.indices = [s.stage_index for s in self.stages]
        self.stages = []
        self.k = cfg.max_seqs + 2
        self.t_pad = 0

    def schedule(self, n_micro: int) -> Any:
        if self.rebuild or n_micro not in self.schedules:
            # Static shapes, given: torch's shape inference would run the later stages on uninitialized
            # inputs (garbage cu_seqlens), which this model cannot take.
            self.stages = [PipelineStage(m, i, self.n_stages, torch.device("cpu"), group=self.gloo,
                                         input_args=self._example(i, True), output_args=self._example(i, False))
                           for m, i in zip(self.modules, self.indices)]
            self.schedules = {}
            return super().schedule(n_micro)
        return self.schedules[n_micro]

    def _example(self, stage: int, inputs: bool) -> tuple[torch.Tensor, ...]:
        t, cu = self.t_pad, torch.empty(self.k, dtype=torch.int32)
        act = torch.empty(t, self.cfg.hidden, requires_grad=True)  # requires_grad: its gradient travels
        if inputs:
            return (torch.empty(t, dtype=torch.long) if stage == 0 else act, cu)
        return (torch.empty(t, self.cfg.vocab, requires_grad=True),) if stage == self.n_stages - 1 else (act, cu)

    def step(self, step: int, n_micro: int) -> float | None:
        batches = pv.make_batches(self.cfg, step, n_micro, self.seed)
        t_pad = (max(mb.tokens.numel() for mb in batches) if self.rebuild
                 else self.cfg.max_seqs * self.cfg.max_len)
        self.t_pad = t_pad
        mbs = [padded(mb, t_pad, self.k) for mb in batches]
        self.loss.total = pv.n_tokens(batches)
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        pipelining.step(self.schedule(n_micro), [(x, cu) for x, cu, _ in mbs] if self.first else None,
                        [y for _, _, y in mbs] if self.last else None,
                        losses=losses if self.last else None, return_outputs=False)
        self.opt.step()
        return float(sum(float(x.detach()) for x in losses)) if self.last else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=list(ppv.SCHEDULES), default="1F1B")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--max-seqs", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("varcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    cfg = pv.Config(hidden=a.hidden, layers=a.layers, max_len=a.max_len, max_seqs=a.max_seqs)
    trainers: dict[str, ppv.PipelineTrainer] = {
        "varcomm": ppv.PipelineTrainer(a.schedule, cfg, rank, world),
        "rebuild": GlooTrainer(a.schedule, cfg, rank, world, gloo, rebuild=True),
        "pad": GlooTrainer(a.schedule, cfg, rank, world, gloo, rebuild=False),
    }
    times: dict[str, list[float]] = {k: [] for k in trainers}
    losses: dict[str, list[float]] = {k: [] for k in trainers}
    for step in range(a.steps):
        for name, t in trainers.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = t.step(step, a.micro_batches)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            if loss is not None:
                losses[name].append(loss)
    if trainers["varcomm"].last:
        lens = [mb.tokens.numel() for s in range(a.steps) for mb in pv.make_batches(cfg, s, a.micro_batches, 0)]
        print(f"{a.schedule}, {world} ranks, {a.micro_batches} microbatches per step, hidden {a.hidden}, "
              f"{a.layers} layers; T per microbatch {min(lens)}..{max(lens)} (mean {statistics.mean(lens):.0f}), "
              f"padded to the step's longest (rebuild) or {a.max_seqs * a.max_len} (pad); "
              f"step time over steps 1..{a.steps - 1} (step 0: warm-up)", flush=True)
        base = statistics.median(times["varcomm"][1:])
        for name, ts in times.items():
            med, mean = statistics.median(ts[1:]), statistics.mean(ts[1:])
            print(f"  {name:<8} median {med * 1e3:8.2f} ms  mean {mean * 1e3:8.2f} ms  "
                  f"median / varcomm {med / base:5.2f}x", flush=True)
        worst = max(abs(x - y) for k in ("rebuild", "pad") for x, y in zip(losses[k], losses["varcomm"]))
        print(f"  losses agree across methods to {worst:.1e} (step 0: {losses['varcomm'][0]:.6f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
