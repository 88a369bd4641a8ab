"""The MPI baseline for bench/alltoall.py: per iteration, comm.Alltoall of the
row counts, allocate the output, then comm.Alltoallv of [T, 1024] bf16 rows
(as bytes). Same routing plans, iteration counts and timing rules as the
varcomm job.

    mpirun -n 4 --oversubscribe --allow-run-as-root python bench/mpi_alltoallv.py --out r.json

(bench/alltoall.py runs this itself.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

_spec = importlib.util.spec_from_file_location("_bench_alltoall", Path(__file__).resolve().parent / "alltoall.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)  # type: ignore[union-attr]


def make_op(comm: "MPI.Comm", x: np.ndarray, counts: np.ndarray, row_bytes: int):
    """One conventional all-to-all-v: Alltoall of the row counts, allocate the
    output, Alltoallv of the rows (as bytes). Returns a callable -> output."""
    n = comm.size
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    sdispl = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) * row_bytes
    scounts = counts * row_bytes
    xb = x.reshape(-1).view(np.uint8)

    def once() -> np.ndarray:
        rc = np.empty(n, dtype=np.int64)
        comm.Alltoall(counts, rc)  # the count exchange
        out = np.empty((int(rc.sum()), row_bytes), dtype=np.uint8)
        rdispl = np.concatenate([[0], np.cumsum(rc)[:-1]]) * row_bytes
        comm.Alltoallv([xb, (scounts, sdispl), MPI.BYTE], [out, (rc * row_bytes, rdispl), MPI.BYTE])
        return out

    return once


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default=B.DEFAULT_SIZES)
    p.add_argument("--sample-s", type=float, default=0.2)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    rb = B.ROW_BYTES
    results: dict[str, dict[str, list[float]]] = {}
    for pattern, size, m in B.points([B.parse_bytes(s) for s in args.sizes.split(",")], n):
        counts = np.ascontiguousarray(m[r])
        x = np.full((int(counts.sum()), rb), r, dtype=np.uint8)
        once = make_op(comm, x, counts, rb)
        got = once()
        want = np.repeat(np.arange(n, dtype=np.uint8), m[:, r])
        assert (got[:, 0] == want).all() and (got[:, -1] == want).all(), f"mpi {pattern} {size}: wrong result"
        iters = B.iterations("mpi4py", float(m.sum()) * rb / n, args.sample_s)
        for _ in range(min(iters, 5)):
            once()
        samples = []
        for _ in range(B.SAMPLES):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            dt = (time.perf_counter() - t0) / iters
            samples.append(comm.allreduce(dt, op=MPI.MAX))
        results[f"{pattern}/{size}"] = {"mpi4py": [statistics.median(samples)]}
    if r == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
