"""torch.distributed.pipelining's own schedules on packed variable-length
sequences: no padding, no shape inference, no rebuild.

The model, data and loss are examples/pipeline_varlen.py's (a small
transformer on packed rows with ``cu_seqlens``); here torch's schedule classes
run it, with varcomm's ``VarcommPipelineStage``: each microbatch has its own
length T, each step its own number of microbatches, and every activation
[T, hidden] and gradient takes its shape from the message. ``cu_seqlens``
travels along as the stages' second tensor (forward only: it has no gradient).

    python -m varcomm.run -n 2 examples/pipelining_varlen.py --schedule 1F1B
    python -m varcomm.run -n 2 examples/pipelining_varlen.py --schedule DualPipeV --check
    python -m varcomm.run -n 4 examples/pipelining_varlen.py --schedule Interleaved1F1B --layers 8

``--check`` also trains the whole model in one process on the same data and
prints the largest difference of the losses and gradients.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import pipelining as tpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_varlen as pv  # the model and the data

import varcomm.torch  # noqa: F401 - registers the "varcomm" backend
from varcomm.integrations import pipelining

SCHEDULES: dict[str, Any] = {
    "GPipe": tpp.ScheduleGPipe, "1F1B": tpp.Schedule1F1B, "Interleaved1F1B": tpp.ScheduleInterleaved1F1B,
    "LoopedBFS": tpp.ScheduleLoopedBFS, "InterleavedZeroBubble": tpp.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": tpp.ScheduleZBVZeroBubble, "DualPipeV": tpp.ScheduleDualPipeV,
}
SINGLE = ("GPipe", "1F1B")  # one stage per rank; the others hold two
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2R-1-r (looped: r and r+R)


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


class PipeStage(nn.Module):
    """A stage of examples/pipeline_varlen.py's model for torch's schedules: it
    takes (x, cu_seqlens) and hands cu_seqlens on with its activations."""

    def __init__(self, model: pv.TinyLM, index: int, n: int):
        super().__init__()
        self.inner = pv.Stage(model, index, n)
        self.max_len = model.pos.num_embeddings

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> Any:
        s = self.inner
        if s.first:  # positions past max_len only occur in padding (the padded baselines of the benchmark)
            x = s.embed(x) + s.pos(pv.seq_layout(cu_seqlens)[1].clamp(max=self.max_len - 1))
        mask = pv.attention_mask(cu_seqlens)
        for b in s.blocks:
            x = b(x, mask)
        if s.last:
            return s.head(s.ln_f(x))
        return x, cu_seqlens


class TokenLoss:
    """The step's mean token loss, a microbatch's share at a time (reduction sum / the step's token count)."""

    def __init__(self) -> None:
        self.total = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / self.total


def micro_counts(schedule: str, world: int, steps: int, n_micro: int) -> list[int]:
    """Microbatches per step: n_micro, n_micro + 1, n_micro + 2, again; in steps of the rank count
    for the interleaved schedules, which need a multiple of it."""
    k = world if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") else 1
    base = -(-n_micro // k) * k
    return [base + k * (s % 3) for s in range(steps)]


class PipelineTrainer:
    """This rank's stages of one model, trained by one of torch's schedule classes through varcomm.

    One schedule per microbatch count (made on first use); the stages are made once."""

    def __init__(self, schedule: str, cfg: pv.Config, rank: int, world: int, *, seed: int = 0, lr: float = 0.5,
                 group: dist.ProcessGroup | None = None):
        self.name, self.cfg, self.rank, self.world = schedule, cfg, rank, world
        self.seed = seed
        indices = stage_indices(schedule, rank, world)
        self.n_stages = world * len(indices)
        if cfg.layers < self.n_stages:
            raise ValueError(f"{cfg.layers} layers cannot make {self.n_stages} stages")
        self.model = pv.build_model(cfg, seed, torch.float32)
        self.modules = [PipeStage(self.model, i, self.n_stages) for i in indices]
        self.stages = [pipelining.VarcommPipelineStage(m, i, self.n_stages, num_inputs=2, group=group)
                       for m, i in zip(self.modules, indices)]
        params = [p for m in self.modules for p in m.parameters()]
        mine = {id(p) for p in params}
        self.names = [n for n, p in self.model.named_parameters() if id(p) in mine]
        self.opt = torch.optim.SGD(params, lr=lr)
        self.loss = TokenLoss()
        self.schedules: dict[int, Any] = {}
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)

    def schedule(self, n_micro: int) -> Any:
        if n_micro not in self.schedules:
            cls = SCHEDULES[self.name]
            stages = self.stages[0] if self.name in SINGLE else self.stages
            self.schedules[n_micro] = cls(stages, n_microbatches=n_micro, loss_fn=self.loss, scale_grads=False)
        return self.schedules[n_micro]

    def step(self, step: int, n_micro: int) -> float | None:
        """One optimizer step on step `step`'s data (`n_micro` microbatches). Returns the loss on the last stage."""
        batches = pv.make_batches(self.cfg, step, n_micro, self.seed)
        self.loss.total = pv.n_tokens(batches)
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        pipelining.step(self.schedule(n_micro),
                        [(mb.tokens, mb.cu_seqlens) for mb in batches] if self.first else None,
                        [mb.labels for mb in batches] if self.last else None,
                        losses=losses if self.last else None, return_outputs=False)
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                      if n in self.names and p.grad is not None}
        self.opt.step()
        return float(sum(float(x.detach()) for x in losses)) if self.last else None


def train_reference(cfg: pv.Config, counts: list[int], *, seed: int = 0, lr: float = 0.5) -> dict[str, Any]:
    """The same training in one process: the whole model, microbatch by microbatch."""
    model = pv.build_model(cfg, seed, torch.float32)
    whole = pv.Stage(model, 0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step, m in enumerate(counts):
        batches = pv.make_batches(cfg, step, m, seed)
        total = pv.n_tokens(batches)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in batches:
            y = pv.loss_of(whole(mb.tokens, mb.cu_seqlens), mb, total)
            y.backward()
            loss += float(y.detach())
        losses.append(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1F1B")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4,
                   help="per step: this many, then +1, +2, again (interleaved: +R, +2R)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("varcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = pv.Config(hidden=a.hidden, layers=a.layers, max_len=a.max_len)
    t = PipelineTrainer(a.schedule, cfg, rank, world)
    counts = micro_counts(a.schedule, world, a.steps, a.micro_batches)
    for step, m in enumerate(counts):
        t0 = time.perf_counter()
        loss = t.step(step, m)
        if loss is not None:
            sizes = [int(mb.cu_seqlens[-1]) for mb in pv.make_batches(cfg, step, m, 0)]
            print(f"{a.schedule} step {step}: {m} microbatches of T = {sizes}, loss {loss:.6f}, "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    if a.check:
        want = train_reference(cfg, counts)
        diff = max((float((t.grads[n] - want["grads"][n]).abs().max()) for n in t.grads), default=0.0)
        diffs: list[float] = [0.0] * world
        dist.all_gather_object(diffs, diff)
        if t.last:
            print(f"largest gradient difference from one process: {max(diffs):.2e}", flush=True)
    dist.destroy_process_group()
    if os.environ.get("RANK") == "0":
        print("done", flush=True)


if __name__ == "__main__":
    main()
