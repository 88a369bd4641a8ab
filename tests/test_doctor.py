"""varcomm-doctor: --help, what the report names, secrets kept out, --selftest per built transport."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import varcomm

ROOT = Path(__file__).resolve().parents[1]


def doctor(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "varcomm.tools.doctor", *args], env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_help():
    r = doctor("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: varcomm-doctor") and "--selftest" in r.stdout, r.stdout
    assert "--selftest-child" not in r.stdout  # internal
    bad = doctor("--no-such-flag")
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr


def test_report_names_versions_launcher_and_options_but_no_secret():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VARCOMM_", "OMPI_", "PMI_", "SLURM_"))}
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="10.1.2.3",
               MASTER_PORT="29555", VARCOMM_SLOTS="16", VARCOMM_JOB_KEY="sekrit-4f2a", SLURM_JOB_NAME="x")
    r = doctor(env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"varcomm {varcomm.__version__}" in out, out
    assert f"torch {torch.__version__}" in out and f"numpy {np.__version__}" in out, out
    assert "libfabric" in out and "git: " in out, out
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert head and head in out, (head, out)
    for line in ("RANK=3", "WORLD_SIZE=4", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=29555",
                 "=> rank 3 of 4, local rank 1 of 2", "(and 1 other SLURM_* variables)"):
        assert line in out, (line, out)
    slots = next(ln for ln in out.splitlines() if ln.strip().startswith("slots "))
    assert "16" in slots and "VARCOMM_SLOTS" in slots, slots
    assert "sekrit-4f2a" not in out, "a secret was printed"
    assert "VARCOMM_JOB_KEY=(set, not shown)" in out, out


def test_selftest_passes_for_each_built_transport():
    r = doctor("--selftest", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split("selftest (")[1].splitlines()
    built = varcomm.build_info()["transports"]
    for t in ("shm", "rdma", "fallback"):
        if t in built:
            line = next(ln for ln in lines if ln.strip().startswith(t))
            assert " pass " in line and " us for 8 KiB there and back" in line, line
