"""An expert-parallel MoE layer over varcomm: experts sharded over ranks,
tokens dispatched and combined with variable-size all-to-all (no count
exchange), forward and backward, checked against the same layer run in one
process.

Run: python -m varcomm.run -n 2 examples/moe.py    (any n dividing NUM_EXPERTS)

Every rank builds the same model (same seed) but only uses its own experts.
Each rank gets a batch of a different size. The single-process reference
runs the whole layer on every rank's batch. Checked, for three SGD steps:
outputs, the loss, input gradients, the local experts' weight gradients and
the router's gradient (summed over ranks with an all-to-all-v all-gather),
all within fp32 tolerance ATOL=1e-5, RTOL=1e-5 (summation order differs:
the reference adds experts' contributions in another order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import varcomm
from varcomm.collectives import alltoall
from varcomm.collectives.moe import combine, dispatch

HIDDEN, FFN, NUM_EXPERTS, TOPK = 32, 48, 8, 2
ATOL = RTOL = 1e-5


class MoE(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate = torch.nn.Parameter(torch.randn(HIDDEN, NUM_EXPERTS, generator=g) / HIDDEN ** 0.5)
        self.w1 = torch.nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=g) / FFN ** 0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(x @ self.gate, dim=-1)
        w, ids = probs.topk(TOPK, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w1[e]) @ self.w2[e]

    def forward_ep(self, comm: varcomm.Communicator, x: torch.Tensor) -> torch.Tensor:
        """Expert-parallel: this rank runs only experts [rank * E/n, (rank + 1) * E/n)."""
        w, ids = self.route(x)
        expert_tokens, per_expert, handle = dispatch(comm, x, ids, w, NUM_EXPERTS)
        first = comm.rank * (NUM_EXPERTS // comm.world_size)
        chunks = expert_tokens.split(per_expert.tolist())
        out = torch.cat([self.expert(first + i, c) for i, c in enumerate(chunks)])
        return combine(comm, out, handle)

    def forward_reference(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One process, every expert: y[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])."""
        y = torch.zeros_like(x)
        for e in range(NUM_EXPERTS):
            t, k = (ids == e).nonzero(as_tuple=True)
            y = y.index_add(0, t, w[t, k, None] * self.expert(e, x[t]))
        return y


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific, size-varying batch and target."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = 24 + 13 * rank + 7 * step
    return torch.randn(t, HIDDEN, generator=g), torch.randn(t, HIDDEN, generator=g)


def all_gather_sum(comm: varcomm.Communicator, t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks, through all_to_all_v (each rank sends its copy to all)."""
    n = comm.world_size
    rows = t.reshape(1, -1).expand(n, -1).contiguous()
    got, _ = alltoall.all_to_all_v(comm, rows, [1] * n)
    return got.sum(0).reshape(t.shape)


def close(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| <= ATOL + RTOL * |b| elementwise (torch.testing.assert_close's rule); the largest |a - b|."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    diff = (a - b).abs()
    bad = diff > ATOL + RTOL * b.abs()
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} of {a.numel()} elements differ; largest |diff| "
                                 f"{float(diff.max()):.3g} (atol {ATOL}, rtol {RTOL})")
    return float(diff.max()) if a.numel() else 0.0


def run(comm: varcomm.Communicator, steps: int = 3, lr: float = 0.1) -> float:
    """Train both versions side by side; raise on any disagreement; return the largest difference seen."""
    r, n = comm.rank, comm.world_size
    assert NUM_EXPERTS % n == 0, f"{NUM_EXPERTS} experts do not shard over {n} ranks"
    mine = slice(r * NUM_EXPERTS // n, (r + 1) * NUM_EXPERTS // n)
    ep, ref = MoE(seed=0), MoE(seed=0)
    worst = 0.0
    for step in range(steps):
        # expert parallel, this rank's batch
        x, target = batch(r, step)
        x.requires_grad_(True)
        y = ep.forward_ep(comm, x)
        loss = F.mse_loss(y, target, reduction="mean")
        ep.zero_grad()
        loss.backward()
        gate_grad = all_gather_sum(comm, ep.gate.grad)

        # reference: one process, every rank's batch; routing per rank batch as above
        ref.zero_grad()
        xs, ys, total = [], [], 0.0
        for s in range(n):
            xs_s, t_s = batch(s, step)
            xs_s.requires_grad_(True)
            w, ids = ref.route(xs_s)
            y_s = ref.forward_reference(xs_s, w, ids)
            total = total + F.mse_loss(y_s, t_s, reduction="mean")
            xs.append(xs_s)
            ys.append(y_s)
        total.backward()

        worst = max(worst, close(f"step {step} output", y.detach(), ys[r].detach()))
        worst = max(worst, close(f"step {step} input grad", x.grad, xs[r].grad))
        worst = max(worst, close(f"step {step} w1 grad", ep.w1.grad[mine], ref.w1.grad[mine]))
        worst = max(worst, close(f"step {step} w2 grad", ep.w2.grad[mine], ref.w2.grad[mine]))
        worst = max(worst, close(f"step {step} router grad", gate_grad, ref.gate.grad))
        total_loss, want = float(all_gather_sum(comm, loss.detach().reshape(1))), total.item()
        assert abs(total_loss - want) <= ATOL + RTOL * abs(want), f"step {step} loss {total_loss} != {want}"

        with torch.no_grad():  # SGD: local experts from local grads, router from the summed grad
            ep.w1[mine] -= lr * ep.w1.grad[mine]
            ep.w2[mine] -= lr * ep.w2.grad[mine]
            ep.gate -= lr * gate_grad
            for p in ref.parameters():
                p -= lr * p.grad
    return worst


def main() -> None:
    with varcomm.init() as comm:
        worst = run(comm)
        print(f"rank {comm.rank}/{comm.world_size}: MoE ({NUM_EXPERTS} experts, top-{TOPK}) over "
              f"{comm.describe_transport((comm.rank + 1) % comm.world_size)}: outputs and gradients match the "
              f"single-process layer (max |diff| {worst:.2e}, atol {ATOL}, rtol {RTOL}) PASS", flush=True)


if __name__ == "__main__":
    main()
