#!/usr/bin/env python3
"""The default all-to-all-v sweep, recorded: runs `varcomm-bench alltoall` on 4
ranks with uniform and zipf routing (every method in one job) and writes
bench/results/alltoall-<date>.json and .md.

    python bench/alltoall.py [varcomm-bench alltoall options]    e.g. --quick, --nranks 2, -e 1M

Defaults added unless given: --nranks 4, --routing uniform,zipf, -b 8K -e 8M -f 16
(the sizes of the earlier recorded runs), -c, --save bench/results. The methods
(varcomm, two-phase, fallback, mpi4py, memcpy) and the timing rules are those of
`python -m varcomm.bench alltoall --help` (the logic lives in
python/varcomm/bench_alltoall.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))  # a source checkout runs without installing

from varcomm.bench import main  # noqa: E402


def _given(args: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in args for n in names)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not _given(args, "--nranks"):
        args += ["--nranks", "4"]
    if not _given(args, "--routing"):
        args += ["--routing", "uniform,zipf"]
    if not _given(args, "--quick") and not _given(args, "-b", "--minbytes", "-e", "--maxbytes", "-f", "--stepfactor"):
        args += ["-b", "8K", "-e", "8M", "-f", "16"]
    if not _given(args, "-c", "--check"):
        args += ["-c"]
    if not _given(args, "--save"):
        args += ["--save", str(ROOT / "bench" / "results")]
    sys.exit(main(["alltoall", *args]))
