"""The main job: two ranks stream variable-size activations (a pipeline-parallel
micro-batch stream whose token count changes every step) through varcomm and
through the fallback (shape header + payload over torch.distributed gloo), and
print what each costs. Run: python -m varcomm.run -n 2 examples/demo.py"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

import varcomm

HIDDEN = 1024
STEPS = 200


def stream(comm: varcomm.Communicator, tokens: list[int], check: bool) -> float:
    """Rank 0 sends [T, HIDDEN] bf16 activations, rank 1 receives them with no
    size known in advance and sends back a 0-d ack; returns seconds per step."""
    # Activations are made before timing: the loop measures communication.
    acts = [torch.full((t, HIDDEN), float(step % 7), dtype=torch.bfloat16) if comm.rank == 0 else None
            for step, t in enumerate(tokens)]
    comm.barrier()
    t0 = time.perf_counter()
    for step, t in enumerate(tokens):
        if comm.rank == 0:
            comm.send(acts[step], dst=1)
            comm.recv(src=1)
        else:
            x = comm.recv(src=0)
            if check:
                assert x.shape == (t, HIDDEN) and x.dtype == torch.bfloat16
                assert bool((x == float(step % 7)).all())
            comm.send(torch.tensor(t), dst=0)
    return (time.perf_counter() - t0) / len(tokens)


def main() -> None:
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(1, 2048, STEPS)]  # 2 KiB .. 4 MiB per message
    mean_bytes = 2 * HIDDEN * float(np.mean(tokens))
    rows = []
    for transport in ("auto", "fallback"):
        with varcomm.init(transport=transport, bound=2 * HIDDEN * 2048, slots=4) as comm:
            stream(comm, tokens[:20], check=True)  # warm-up, verified
            dt = stream(comm, tokens, check=False)
            rows.append((f"varcomm {comm.transport_for(1 - comm.rank)}" if transport == "auto"
                         else "fallback: gloo, shape header + payload", dt))
    if os.environ.get("RANK", "0") == "0":
        base = rows[1][1]
        print(f"\nvariable-size stream: {STEPS} messages of [T, {HIDDEN}] bf16, T uniform in [1, 2048) "
              f"(mean {mean_bytes / 2**20:.2f} MiB), no shape messages on the varcomm path")
        print(f"{'path':<40} {'per step':>10} {'GB/s':>7} {'speed-up':>9}")
        for name, dt in rows:
            print(f"{name:<40} {dt * 1e6:>8.0f}us {mean_bytes / dt / 1e9:>7.2f} {base / dt:>8.1f}x")


if __name__ == "__main__":
    main()
