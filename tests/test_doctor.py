"""varcomm-doctor: --help, what the report names, secrets kept out, --selftest per built transport."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import varcomm
from varcomm.tools.doctor import selftest_one

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
               MASTER_PORT="29555", VARCOMM_SLOTS="16", VARCOMM_JOB_KEY="sekrit-4f2a", SLURM_JOB_NAME="x",
               VARCOMM_JOB_KYE="sekrit-misspelt")  # a key all the same: its nearest name is a secret's
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
    # An option decided at init says by what (it printed "None").
    spin = next(ln for ln in out.splitlines() if ln.strip().startswith("spin_us "))
    assert "None" not in spin and "if this host's ranks have a core each" in spin, spin
    assert "sekrit-4f2a" not in out and "sekrit-misspelt" not in out, "a secret was printed"
    assert "VARCOMM_JOB_KEY=(set, not shown)" in out, out
    assert "VARCOMM_JOB_KYE=(set, not shown)  (not a varcomm variable: did you mean VARCOMM_JOB_KEY?)" in out, out
    assert "varcomm's torch adapter: in use" in out, out


def test_selftest_passes_for_each_built_transport():
    r = doctor("--selftest", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split("selftest (")[1].splitlines()
    built = varcomm.build_info()["transports"]
    for t in ("shm", "rdma", "fallback"):
        if t in built:
            line = next(ln for ln in lines if ln.strip().startswith(t))
            assert " pass " in line and " us for 8 KiB there and back" in line, line


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("VARCOMM_", "OMPI_", "PMI_", "SLURM_"))}


def test_invalid_variables_are_fail_lines_and_exit_1():
    env = clean_env()
    env.update(VARCOMM_TIMEOUT="abc", VARCOMM_TRANSPORT="bogus", VARCOMM_TEST_SEED="x", VARCOMM_SLOTS="16")
    r = doctor(env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    for expected in ("FAIL  VARCOMM_TIMEOUT='abc': use seconds (a number >= 0), or none/inf for no limit",
                     "FAIL  VARCOMM_TRANSPORT='bogus': use auto, shm, rdma or fallback",
                     "FAIL  VARCOMM_TEST_SEED='x': use an integer >= 0, or auto"):
        assert any(ln.startswith(expected) for ln in lines), (expected, r.stdout)
    # The valid variable still counts; the invalid ones show their defaults, saying why.
    slots = next(ln for ln in lines if ln.startswith("slots "))
    assert "16" in slots and "VARCOMM_SLOTS" in slots, slots
    timeout = next(ln for ln in lines if ln.startswith("timeout "))
    assert "600.0" in timeout and "VARCOMM_TIMEOUT is invalid" in timeout, timeout


def test_selftest_is_not_run_with_invalid_variables():
    env = clean_env()
    env["VARCOMM_BOUND"] = "lots"
    r = doctor("--selftest", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL  VARCOMM_BOUND='lots': use a size in bytes" in r.stdout, r.stdout
    assert "not run: VARCOMM_BOUND invalid" in r.stdout, r.stdout


def per_rank_env(tmp_path: Path, rank: int, **variables: str) -> dict[str, str]:
    """This environment, plus `variables` in the self-test's rank `rank` only
    (a sitecustomize sets them there: the doctor gives both ranks one environment)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == os.environ.get('TEST_RANK'):\n"
        "    for k, v in list(os.environ.items()):\n"
        "        if k.startswith('TEST_SET_'):\n"
        "            os.environ[k[len('TEST_SET_'):]] = v\n")
    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""), "TEST_RANK": str(rank)}
    env.update({f"TEST_SET_{k}": v for k, v in variables.items()})
    return env


def test_selftest_names_the_first_failed_ranks_own_error(tmp_path):
    # Rank 0 refuses to send; rank 1, left waiting in recv, would time out after
    # 30 s: that timeout was reported, after waiting for it.
    env = clean_env()
    env.update(per_rank_env(tmp_path, 0, VARCOMM_MAX_MESSAGE="16"))
    t0 = time.monotonic()
    r = doctor("--selftest", env=env, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.split("selftest (")[1].splitlines()
    built = varcomm.build_info()["transports"]
    checked = [t for t in ("shm", "rdma", "fallback") if t in built]
    for t in checked:
        line = next(ln for ln in lines if ln.strip().startswith(t))
        assert "FAIL  rank 0: MessageTooLarge: message of 8192 bytes is over this rank's max_message of 16 bytes" \
            in line, line
        assert "TimeoutError" not in line, line
    assert took < 30 * len(checked), f"{took:.0f} s: the doctor waited for the other rank's timeout"


def test_selftest_fails_fast_on_the_rank_that_failed(tmp_path, monkeypatch):
    # Rank 1 never reaches the rendezvous: rank 0 would wait its 30 s init timeout.
    for k, v in per_rank_env(tmp_path, 1, VARCOMM_SLOTS="0").items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    passed, line = selftest_one("shm")
    took = time.monotonic() - t0
    assert not passed
    assert line.startswith("FAIL  rank 1: InvalidArgument: VARCOMM_SLOTS='0': use an integer in [1, 1024]"), line
    assert took < 25, f"{took:.0f} s: the doctor waited for rank 0's init timeout (30 s)"


@pytest.mark.skipif("rdma" not in varcomm.build_info()["transports"], reason="built without rdma")
def test_rdma_settings_libfabric_cannot_give_are_fail_lines():
    """VARCOMM_FI_PROVIDER=verbs;ofi_rxm VARCOMM_FI_IFACE=eth9 on a host with
    neither: the doctor exited 0 with no FAIL line (its own --selftest failed,
    pointing back to it)."""
    env = clean_env()
    env.update(VARCOMM_FI_PROVIDER="no_such;ofi_rxm", VARCOMM_FI_IFACE="no_such_nic0")
    r = doctor(env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL  VARCOMM_FI_PROVIDER=no_such;ofi_rxm with VARCOMM_FI_IFACE=no_such_nic0: fi_getinfo" in r.stdout, \
        r.stdout
    env = clean_env()
    env["VARCOMM_FI_IFACE"] = "no_such_nic0"
    r = doctor(env=env)
    assert r.returncode == 1 and "FAIL  VARCOMM_FI_IFACE=no_such_nic0: none of the default providers" in r.stdout, \
        r.stdout
    # What the transport's own query takes passes (a review found plain-name checks failing `tcp`, which works).
    for good in ({"VARCOMM_FI_IFACE": "lo"}, {"VARCOMM_FI_PROVIDER": "tcp"}, {"VARCOMM_FI_IFACE": "127.0.0.1/32"}):
        r = doctor(env={**clean_env(), **good})
        assert "FAIL" not in r.stdout, (good, r.stdout)


def test_a_misspelt_variable_is_named_once_with_the_near_one():
    """It printed '(not a varcomm variable: misspelt?)' and also a raw
    UserWarning with file and line on stderr."""
    env = clean_env()
    env["VARCOMM_BOUNDS"] = "1K"
    r = doctor(env=env)
    assert "VARCOMM_BOUNDS=1K  (not a varcomm variable: did you mean VARCOMM_BOUND?)" in r.stdout, r.stdout
    assert "UserWarning" not in r.stderr, r.stderr
