#!/usr/bin/env python3
"""mpi4py ping-pong baseline for `varcomm-bench p2p` (needs only numpy and mpi4py).

    mpirun -n 2 --allow-run-as-root --oversubscribe python -m varcomm_bench.mpi_pingpong \
        --sizes 8,1024,16777216 --iters 2000,1000,3 --warmup 200,100,2 [--repeats 1] [--check]

Rank 0 sends `size` bytes with Comm.Send from a preallocated numpy buffer; rank
1 receives into a preallocated buffer at least as large (Comm.Recv; as in
varcomm, the receive buffer may be larger than the message) and sends the same
bytes back. Rank 0 times `iters` round trips after `warmup` untimed ones.

Output (rank 0, stdout), one JSON object per line:
    {"kind": "info", "library": "...", "mpi4py": "...", "vendor": [...]}
    {"kind": "sample", "size": 8, "iters": 2000, "warmup": 200, "repeat": 0,
     "seconds": 0.0071, "half_rtt_us": 1.78}
half_rtt_us = seconds / iters / 2 * 1e6; bandwidth is size / half_rtt.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def pattern(size: int) -> np.ndarray:
    """The payload of a `size`-byte message when checking (differs per size)."""
    return ((np.arange(size, dtype=np.int64) + size * 13) % 251).astype(np.uint8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=_ints, required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--iters", type=_ints, required=True, help="timed round trips, one per size (or one for all)")
    p.add_argument("--warmup", type=_ints, required=True, help="untimed round trips, one per size (or one for all)")
    p.add_argument("--repeats", type=int, default=1, help="timed samples per size")
    p.add_argument("--check", action="store_true", help="verify every received payload")
    a = p.parse_args(argv)
    sizes = a.sizes
    iters = a.iters * len(sizes) if len(a.iters) == 1 else a.iters
    warm = a.warmup * len(sizes) if len(a.warmup) == 1 else a.warmup
    if len(iters) != len(sizes) or len(warm) != len(sizes):
        p.error("--iters/--warmup need one value or one per size")

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if world != 2:
        if rank == 0:
            print(json.dumps({"kind": "error", "error": f"needs exactly 2 ranks, got {world}"}), flush=True)
        return 2
    peer = 1 - rank
    cap = max(sizes)
    # Preallocated and touched on both sides, like the varcomm runs.
    sbuf = np.full(cap, 1, dtype=np.uint8)
    rbuf = np.zeros(cap, dtype=np.uint8)
    if rank == 0:
        print(json.dumps({"kind": "info", "library": MPI.Get_library_version().strip().splitlines()[0],
                          "mpi4py": __import__("mpi4py").__version__, "vendor": list(MPI.get_vendor()[0:1]) +
                          [".".join(map(str, MPI.get_vendor()[1]))]}), flush=True)
    Send, Recv = comm.Send, comm.Recv
    BYTE = MPI.BYTE
    status = MPI.Status()
    gc.disable()
    for rep in range(a.repeats):
        for size, n, w in zip(sizes, iters, warm):
            src = sbuf[:size]
            if a.check:
                src[:] = pattern(size)
                expect = pattern(size)
            msg = [src, size, BYTE]
            comm.Barrier()
            if rank == 0:
                for _ in range(w):
                    Send(msg, peer)
                    Recv(rbuf, peer)
                t0 = time.perf_counter()
                if a.check:
                    for _ in range(n):
                        Send(msg, peer)
                        rbuf[:size] = 0
                        Recv(rbuf, peer, status=status)
                        if status.Get_count(BYTE) != size or not np.array_equal(rbuf[:size], expect):
                            raise SystemExit(f"mpi_pingpong: rank 0 got a wrong echo of {size} bytes")
                else:
                    for _ in range(n):
                        Send(msg, peer)
                        Recv(rbuf, peer)
                dt = time.perf_counter() - t0
                print(json.dumps({"kind": "sample", "size": size, "iters": n, "warmup": w, "repeat": rep,
                                  "seconds": dt, "half_rtt_us": dt / n / 2 * 1e6}), flush=True)
            else:
                echo = [rbuf, size, BYTE]
                for i in range(w + n):
                    if a.check and i >= w:
                        rbuf[:size] = 0
                        Recv(rbuf, peer, status=status)
                        if status.Get_count(BYTE) != size or not np.array_equal(rbuf[:size], expect):
                            raise SystemExit(f"mpi_pingpong: rank 1 got a wrong payload of {size} bytes")
                    else:
                        Recv(rbuf, peer)
                    Send(echo, peer)
    gc.enable()
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
