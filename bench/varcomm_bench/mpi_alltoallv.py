"""The MPI all-to-all-v baseline alone (needs numpy and mpi4py; `varcomm-bench
alltoall` runs the same op in-process when it runs under mpirun): per iteration,
comm.Alltoall of the row counts, allocate the output, then comm.Alltoallv of
[T, hidden] rows as bytes, routed as in varcomm-bench.

    mpirun -n 4 --oversubscribe --allow-run-as-root python -m varcomm_bench.mpi_alltoallv \
        [--sizes 8K,128K,1M,8M] [--routing uniform,zipf] [--iters 50] [--repeats 5] [--out r.json]

Prints one JSON line per point (rank 0): time per op (the slowest rank, median
of --repeats samples, min and max), S and busbw as varcomm-bench counts them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .alltoall import make_mpi_op, splits_matrix
from .core import parse_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8K,128K,1M,8M", help="bytes a rank sends, comma list")
    p.add_argument("--routing", default="uniform,zipf")
    p.add_argument("--row-bytes", type=int, default=4096, help="bytes per token row (default 1024 x float32)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the points here (JSON)")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    rb = a.row_bytes
    points = []
    for rt in a.routing.split(","):
        for s in (parse_bytes(x) for x in a.sizes.split(",")):
            m = splits_matrix(rt, s, n, rb)
            x = np.full((int(m[r].sum()), rb), r, dtype=np.uint8)
            once = make_mpi_op(comm, x, m[r], rb)
            got = once()
            want = np.repeat(np.arange(n, dtype=np.uint8), m[:, r])
            assert (got == want[:, None]).all(), f"mpi {rt} {s}: wrong result"
            for _ in range(a.warmup):
                once()
            samples = []
            for _ in range(a.repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    once()
                samples.append(comm.allreduce((time.perf_counter() - t0) / a.iters, op=MPI.MAX))
            S = float(m.sum()) * rb / n
            med = statistics.median(samples)
            pt = {"routing": rt, "size": S, "time_us": {"median": med * 1e6, "min": min(samples) * 1e6,
                                                        "max": max(samples) * 1e6},
                  "busbw_gbps": S / med / 1e9 * (n - 1) / n}
            points.append(pt)
            if r == 0:
                print(json.dumps(pt), flush=True)
    if r == 0 and a.out:
        Path(a.out).write_text(json.dumps(points, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
