"""varcomm-bench rss: does a rank's memory stay flat over a long mixed stream?

    python -m varcomm_bench.rss [-m 100000] [--bound 1M] [--slots 8] [--seed S]

relaunches itself on 2 ranks (varcomm-run) unless already launched. Rank 0
sends ``-m`` messages of mixed sizes (seeded lognormal, 8 B up to the bound,
numpy and torch, blocking and windowed ``isend``) to rank 1, which receives
them every way the API offers (new array, ``out=``, ``copy=False``, ``irecv``).
Both ranks print their resident set size (``/proc/self/statm``) every tenth of
the stream. A warm-up of bound-sized messages first touches every slot and
buffer the stream can use; after it RSS must stay flat: growth is a leak (a
request, a kept buffer, a Python reference per message).

What a rank maps: its own receive region, ``world x slots x (bound + 4 KiB
header)`` bytes rounded to pages, plus each same-host peer's region (the same
formula with the peer's bound and slots). Pages are touched only where a
message lands, so RSS grows with the largest messages actually sent, up to
``slots x bound`` per sender in the receiver's region and in the sender's
mapping of it (the same physical pages, counted once by the kernel's PSS,
twice in each process's RSS).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import cast

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def sizes(n: int, bound: int, seed: int) -> np.ndarray:
    """n message sizes in bytes, multiples of 4 (float32 elements), 4 .. bound."""
    rng = np.random.default_rng(seed)
    s = rng.lognormal(mean=np.log(4096), sigma=2.0, size=n)
    return np.clip((s // 4).astype(np.int64) * 4, 4, bound)


def stream(comm: object, n: int, bound: int, seed: int, marks: int = 10) -> list[tuple[int, int]]:
    """Run the stream on a 2-rank communicator; [(messages so far, RSS bytes)] at
    `marks` checkpoints (on both ranks), the first after the first 1/marks."""
    import torch

    import varcomm

    assert isinstance(comm, varcomm.Communicator) and comm.world_size == 2
    # Warm-up: bound-sized messages through every slot and every receive way,
    # so the pages any later message can touch are resident before we measure.
    warm = 4 * 3 * 8
    sz = np.concatenate([np.full(warm, bound // 4 * 4, dtype=np.int64), sizes(n, bound, seed)])
    n += warm
    every = max(n // marks, 1)
    out_np = np.empty(bound // 4, dtype=np.float32)
    out_t = torch.empty(bound // 4, dtype=torch.float32)
    src = np.arange(bound // 4, dtype=np.float32)
    src_t = torch.from_numpy(src)
    got: list[tuple[int, int]] = []
    i = 0
    while i < n:
        k = min(4, n - i)  # a window of up to 4 messages, one way per message
        if comm.rank == 0:
            works = []
            for j in range(i, i + k):
                e = int(sz[j]) // 4
                x = src[:e] if j % 2 else src_t[:e]
                if j % 3 == 0:
                    works.append(comm.isend(x, 1, tag=j % 5))
                else:
                    comm.send(x, 1, tag=j % 5)
            for w in works:
                w.wait()
        else:
            for j in range(i, i + k):
                e, how, tag = int(sz[j]) // 4, j % 4, j % 5
                if how == 0:
                    r = comm.recv(0, tag=tag)
                elif how == 1:
                    r = comm.recv(0, tag=tag, out=out_np if j % 2 else out_t)
                elif how == 2:
                    r = comm.recv(0, tag=tag, copy=False)
                else:
                    r = comm.irecv(0, tag=tag).wait()
                a = cast("np.ndarray | torch.Tensor", r)  # data, not a Status: no out= was too small
                if a.shape[0] != e or float(a[e - 1]) != float(e - 1):
                    raise AssertionError(f"message {j}: {tuple(a.shape)} / last {float(a[e - 1])}, want {e}")
                del a
                del r
        i += k
        if i - warm >= every * (len(got) + 1) or i == n:
            got.append((i - warm, rss_bytes()))
    comm.barrier()
    return got


def growth(points: list[tuple[int, int]]) -> int:
    """RSS growth after the first checkpoint, bytes."""
    return max(r for _, r in points[1:]) - points[0][1] if len(points) > 1 else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m varcomm_bench.rss", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--messages", type=int, default=100_000, help="messages to stream (default 100000)")
    p.add_argument("--bound", default="1M", help="the receive bound (default 1M)")
    p.add_argument("--slots", type=int, default=8, help="receive slots per sender (default 8)")
    p.add_argument("--seed", type=int, default=None, help="size seed (default: random, printed)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        from varcomm.tools.run import main as run

        args = list(argv or sys.argv[1:])
        if a.seed is None:  # one seed for both ranks: the receiver checks each size against the sender's
            args += ["--seed", str(int.from_bytes(os.urandom(4), "little"))]
        return run(["-n", "2", "--", sys.executable, "-m", "varcomm_bench.rss", *args])
    import varcomm
    from varcomm.options import parse_bytes

    bound = parse_bytes(a.bound)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    comm = varcomm.init(bound=bound, slots=a.slots)
    try:
        before = rss_bytes()
        pts = stream(comm, a.messages, bound, seed)
        sent = int(sizes(a.messages, bound, seed).sum())
        # One write per line: the ranks share the launcher's pipe (print's two writes interleaved).
        os.write(1, (f"rank {comm.rank}: seed {seed}, {a.messages} messages, {sent / 2**20:.0f} MiB, bound {bound}, "
                     f"slots {a.slots}; RSS at init {before / 2**20:.1f} MiB; "
                     + ", ".join(f"{m}: {r / 2**20:.1f}" for m, r in pts)
                     + f" MiB; growth after the first tenth {growth(pts) / 2**20:+.2f} MiB\n").encode())
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
