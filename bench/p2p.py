#!/usr/bin/env python3
"""The default point-to-point sweep, recorded: runs `varcomm-bench p2p` (all
methods in one run) and writes bench/results/p2p-<date>.json and .md.

    python bench/p2p.py [varcomm-bench p2p options]      relaunches itself on 2 ranks
    varcomm-run -n 2 bench/p2p.py [options]              or torchrun --nproc-per-node 2 ...

Options are those of `python -m varcomm.bench p2p --help`; --save DIR overrides
where the results go.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))  # a source checkout runs without installing

from varcomm.bench import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a == "--save" or a.startswith("--save=") for a in args):
        args += ["--save", str(ROOT / "bench" / "results")]
    sys.exit(main(["p2p", *args]))
