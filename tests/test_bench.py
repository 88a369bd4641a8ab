"""Tests for varcomm-bench (the varcomm_bench package in bench/): every subcommand on
2 ranks with tiny sizes (in-process through the harness), -c catching injected
corruption, bad arguments as usage errors, and the real command line
(self-relaunch, JSON, plot) as a subprocess."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import varcomm
import varcomm_bench
from varcomm.testing import rank, world
from varcomm_bench import cli, report
from varcomm_bench.alltoall import splits_matrix
from varcomm_bench.core import BenchError, fmt_bytes, parse_bytes, sweep
from varcomm_bench.varlen import pool, read_sizes

# The subprocesses import this varcomm and this varcomm_bench.
PYTHONPATH = os.pathsep.join(str(Path(m.__file__).resolve().parents[1]) for m in (varcomm, varcomm_bench))
TINY = ["-r", "1", "-n", "2", "-w", "1", "-q", "--op-timeout", "30"]
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "VARCOMM_BENCH_CORRUPT", "VARCOMM_BENCH_CMD", "VARCOMM_BENCH_LAUNCHER", "VARCOMM_BENCH_NO_MPI")


def _cli(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m varcomm_bench ARGS` as a user starts it: outside any launcher."""
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in _JOB_VARS:
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "varcomm_bench", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


# ---- pure helpers -------------------------------------------------------------------

def test_sizes_and_units() -> None:
    assert parse_bytes("64K") == 65536 and parse_bytes("1MiB") == 1 << 20 and parse_bytes("8") == 8
    assert fmt_bytes(8 << 20) == "8M" and fmt_bytes(1536) == "1536"
    assert sweep(8, 1024, 4) == [8, 32, 128, 512]
    with pytest.raises(BenchError):
        sweep(8, 4, 2)


def test_varlen_distributions(tmp_path: Path) -> None:
    for dist in ("uniform", "lognormal"):
        p = pool(dist, 64 << 10, 512, 4)
        assert len(p) == 512 and all(s % 4 == 0 and s >= 4 for s in p)
        assert len(set(p)) > 100  # sizes really vary
        assert 0.7 < np.mean(p) / (64 << 10) < 1.3  # around the requested mean
    assert pool("lognormal", 4096, 16, 2) == pool("lognormal", 4096, 16, 2)  # seeded: same on every rank
    f = tmp_path / "sizes.txt"
    f.write_text("# comment\n1K\n\n100\n4096  # trailing\n")
    assert read_sizes(str(f)) == [1024, 100, 4096]
    assert pool(f"file:{f}", 0, 0, 4) == [1024, 100, 4096]
    with pytest.raises(ValueError, match="missing: no such file"):
        read_sizes(str(tmp_path / "missing"))


def test_routings() -> None:
    n, rb = 4, 2048
    u = splits_matrix("uniform", 1 << 20, n, rb)
    assert (u == (1 << 20) // rb // n).all()
    z = splits_matrix("zipf", 1 << 20, n, rb)
    assert (z.sum(axis=1) == (1 << 20) // rb).all() and z[:, 0].sum() > z[:, -1].sum()
    o = splits_matrix("all-to-one", 1 << 20, n, rb)
    assert (o[:, 1:] == 0).all() and (o[:, 0] == (1 << 20) // rb).all()


def test_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad value is argparse's usage error (exit status 2, before any rank
    starts) naming the option and the value; the same command with good values runs."""
    empty = tmp_path / "empty.txt"
    empty.write_text("# no sizes\n")
    cases = [(["p2p", "--baselines", "nope"], "--baselines", "nope"),
             (["p2p", "--tests", "latency,nope"], "--tests", "nope"),
             (["alltoall", "--routing", "uniform,ring"], "--routing", "ring"),
             (["varlen", "--dist", "pareto"], "--dist", "pareto"),
             (["varlen", "--dist", f"file:{tmp_path / 'missing'}"], "--dist", "no such file"),
             (["varlen", "--dist", f"file:{empty}"], "--dist", "no sizes"),
             (["p2p", "--dtype", "complex64"], "--dtype", "complex64"),
             (["p2p", "--window", "0"], "--window", "must be >= 1"),
             (["p2p", "-f", "1"], "-f/--stepfactor", "must be >= 2"),
             (["p2p", "-b", "lots"], "-b/--minbytes", "lots"),
             (["p2p", "-b", "64K", "-e", "8"], "-e/--maxbytes", "below -b/--minbytes"),
             (["all", "--nranks", "1"], "--nranks", "must be >= 2"),
             (["p2p", "--nranks", "3"], "--nranks", "ping-pong between 2 ranks"),  # (ran and said '3 ranks')
             (["p2p", "--op-timeout", "-1"], "--op-timeout", "must be a number > 0"),  # (each rank died)
             (["varlen", "--sigma", "-1"], "--sigma", "must be a number >= 0"),
             (["p2p", "--json", f"{empty}/x.json"], "--json", "cannot write there"),  # (said after the run)
             # helper-67: a folder (said after the run), more memory than the machine's (tracebacks,
             # or the OOM killer), a size that is no number (a traceback)
             (["p2p", "--json", str(tmp_path)], "--json", "is a folder; name a file in it"),
             (["p2p", "-b", "64G", "-e", "64G"], "-e/--maxbytes 64G", "GiB available; pass a smaller -e"),
             (["p2p", "-b", "inf"], "-b/--minbytes", "'inf' is not a size"),
             (["p2p", "--launcher", "mpirun", "--mpirun", "/bin/nonexist"], "--launcher mpirun", "not found"),
             (["p2p", "--nope"], "unrecognized arguments", "--nope")]
    if cli._memory_available() >= 4 * 2 * 64 << 30:  # (a machine with 512 GiB free would run the 64G case)
        cases = [c for c in cases if "64G" not in c[0]]
    for args, option, detail in cases:
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2, (args, e.value.code, err)
        assert "usage: varcomm-bench" in err, (args, err)
        assert f"error: argument {option}: " in err or f"error: {option}: " in err, (args, err)
        assert detail in err.split("error:", 1)[1], (args, err)
    r = _cli(["p2p", "--tests", "latency", "-b", "8", "-e", "8", *TINY, "--baselines", "none",
              "--launcher", "varcomm", "--timeout", "100"], timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "p2p latency" in r.stdout


def test_moe_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """varcomm-bench moe's own options: --nranks 0 was a ZeroDivisionError, bad
    counts reached the ranks, and a machine without a GPU started them all to
    have each say so (helper-67). Now usage errors before any rank starts."""
    import torch

    cases = [(["--nranks", "0"], "argument --nranks: 0: must be >= 2"),
             (["--tokens", "-5"], "argument --tokens: -5: must be >= 1"),
             (["--iters", "0"], "argument --iters: 0: must be >= 1"),
             (["--topk", "9", "--experts", "8"], "--topk 9 is more than --experts 8")]
    if not torch.cuda.is_available():
        cases.append(([], "torch sees no CUDA GPU here"))
    for args, said in cases:
        with pytest.raises(SystemExit) as e:
            cli.main(["moe", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "usage: varcomm-bench moe" in err and said in err, (args, err)


def test_a_size_that_is_not_whole_elements_is_said_before_the_run(capsys) -> None:
    """-b 1 ran as 4 B (one float32) without a word: the table's sizes differed from the command's."""
    for args, said in ((["p2p", "-b", "1", "-e", "64"], "-b/--minbytes 1: messages are whole float32 elements "
                        "(4 B each), so this size runs as 4 B"),
                       (["p2p", "--dtype", "bfloat16", "-b", "8", "-e", "1001"], "-e/--maxbytes 1001: messages are "
                        "whole bfloat16 elements (2 B each), so this size runs as 1000 B")):
        parser = cli._parser()
        cli._check_before_launch(parser, cli._finish_args(parser.parse_args(args)))
        assert said in capsys.readouterr().err, args
    parser = cli._parser()
    cli._check_before_launch(parser, cli._finish_args(parser.parse_args(["p2p", "-b", "8", "-e", "64"])))
    assert "whole" not in capsys.readouterr().err
    # an all-to-all baseline given to p2p was dropped without a word (helper-67)
    cli._check_before_launch(parser, cli._finish_args(parser.parse_args(["p2p", "--baselines", "two-phase,nccl"])))
    err = capsys.readouterr().err
    assert all(f"note: --baselines {b}: only the alltoall benchmark has it; p2p skips it" in err
               for b in ("two-phase", "nccl")), err


def test_a_bad_varcomm_variable_is_one_usage_error(capsys, monkeypatch) -> None:
    """VARCOMM_BOUND=12 under the bench: every rank failed with its own
    traceback (56-65 lines); varcomm-run says it once, as a usage error."""
    monkeypatch.setenv("VARCOMM_BOUND", "12")
    with pytest.raises(SystemExit) as e:
        cli.main(["p2p", "--tests", "latency", "-b", "8", "-e", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "VARCOMM_BOUND" in err and "Traceback" not in err, err


def test_compare_warns_when_the_runs_measured_different_things(tmp_path: Path, capsys) -> None:
    """An shm run against an rdma run was compared without a word ('9 below
    0.9 slower'); an unknown --methods was ignored; a missing file was a
    traceback."""
    from varcomm_bench import compare

    def run(name: str, transport: str, env: dict[str, str], t: float, sizes: tuple[int, ...] = (8,),
            check: bool = False) -> str:
        doc = {"subcommand": "p2p", "options": {"transport": transport, "check": check}, "environment": env,
               "results": [{"bench": "p2p", "test": "latency", "title": "p2p latency",
                            "points": [{"size": z, "methods": {"varcomm": {"time_us": {"median": t}}}}
                                       for z in sizes]}]}
        (tmp_path / name).write_text(json.dumps(doc))
        return str(tmp_path / name)

    a, b = run("a.json", "shm", {}, 2.0), run("b.json", "rdma", {"VARCOMM_SHM_STORES": "ordinary"}, 4.0)
    assert compare.main(["--before", a, "--after", b]) == 0
    out = capsys.readouterr()
    assert "| 0.50 **slower** |" in out.out, out.out
    assert "differ in transport: 'shm' in" in out.err and "differ in VARCOMM_SHM_STORES" in out.err, out.err
    assert compare.main(["--before", a, "--after", run("c.json", "shm", {}, 2.0)]) == 0
    assert "warning" not in capsys.readouterr().err
    # other sizes, or -c on one side only (its checks cost time): said too (helper-67)
    assert compare.main(["--before", a, "--after", run("d.json", "shm", {}, 2.0, (8, 64), True)]) == 0
    err = capsys.readouterr().err
    assert "runs measured different sizes; only the sizes in both" in err and "differ in check: False in" in err, err
    with pytest.raises(SystemExit):
        compare.main(["--before", a, "--after", b, "--methods", "bogus"])
    assert "bogus not in these runs" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        compare.main(["--before", a, "--after", str(tmp_path / "missing.json")])


def test_cuda_without_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: is_available() would initialise CUDA in the pytest process")
    with pytest.raises(SystemExit, match="--device cuda: torch.cuda.is_available"):
        cli.main(["p2p", "--device", "cuda"])


# ---- every subcommand on 2 ranks, in-process ----------------------------------------

@world(2, timeout=90, requires=("torch",))
def test_all_subcommands_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "all.json"
    rc = cli.main(["all", "-b", "64", "-e", "4K", "-f", "64", *TINY, "-c", "--routing", "uniform,zipf,all-to-one",
                     "--baselines", "two-phase,fallback,memcpy,mpi4py", "--dist", "uniform", "--json", str(out)])
    if rank() != 0:
        return
    assert rc == 0
    doc = json.loads(out.read_text())
    got = [(r["bench"], r["test"]) for r in doc["results"]]
    assert got == [("p2p", "latency"), ("p2p", "unibw"), ("p2p", "bibw"), ("varlen", "uniform"),
                   ("alltoall", "uniform"), ("alltoall", "zipf"), ("alltoall", "all-to-one")]
    assert doc["wrong_total"] == 0 and doc["machine"]["cores"] and doc["machine"]["torch"]
    for r in doc["results"]:
        assert r["points"], r["test"]
        for p in r["points"]:
            v = p["methods"]["varcomm"]
            assert v["wrong"] == 0 and v["time_us"]["median"] > 0 and v["repeats"] == 1
            assert v["time_us"]["min"] <= v["time_us"]["median"] <= v["time_us"]["max"]
            assert p["methods"]["fallback"]["wrong"] == 0 and p["ratios"]["fallback"] > 0
            assert p["methods"]["memcpy"]["wrong"] is None  # nothing to check in a local copy
        # skipped baselines say why
        assert r["methods"]["mpi4py"]["status"] == "skipped" and "mpirun" in r["methods"]["mpi4py"]["reason"]
        assert r["methods"]["d2d"]["status"] == "skipped"
        if r["bench"] == "alltoall":
            assert "two-phase" in r["points"][0]["methods"]
    text = (tmp_path / "table.txt")
    text.write_text(report.text(doc))
    assert "algbw(GB/s)" in text.read_text() and "#wrong" in text.read_text()
    # --osu: the same medians as OSU columns (MB/s = bytes/us; bibw counts both directions)
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in report.osu(doc).split("\n\n")[1:] if b.strip()}
    lat = next(v for k, v in blocks.items() if "(like osu_latency): varcomm (torch" in k)
    bibw = next(v for k, v in blocks.items() if "(like osu_bibw): varcomm (torch" in k)
    a2a = next(v for k, v in blocks.items() if "alltoall zipf (like osu_alltoallv): varcomm (torch" in k)
    assert lat[0].split() == ["#", "Size", "Latency", "(us)"] and bibw[0].split()[-1] == "(MB/s)"
    r0, r2 = doc["results"][0], doc["results"][2]
    want = [[str(int(p["size"])), f"{p['methods']['varcomm']['time_us']['median']:.2f}"] for p in r0["points"]]
    assert [ln.split() for ln in lat[1:]] == want
    assert [float(ln.split()[1]) for ln in bibw[1:]] == \
        [round(p["methods"]["varcomm"]["busbw_gbps"]["median"] * 1000, 2) for p in r2["points"]]
    # osu_alltoallv's Size is per peer; the time is the slowest rank's (helper-67)
    r5 = doc["results"][5]
    assert len(a2a) == 1 + len(r5["points"]) and "Max Latency(us)" in a2a[0]
    assert [int(ln.split()[0]) for ln in a2a[1:]] == [int(p["size"]) // r5["ranks"] for p in r5["points"]]


@world(2, timeout=60, requires=("torch",))
def test_check_catches_corruption(tmp_path: Path) -> None:
    os.environ["VARCOMM_BENCH_CORRUPT"] = "1"  # flip a byte of every received message before the check
    out = tmp_path / "bad.json"
    rc = cli.main(["all", "-b", "1K", "-e", "1K", *TINY, "-c", "--tests", "latency,bibw",
                     "--baselines", "fallback", "--json", str(out)])
    if rank() != 0:
        return
    assert rc == 1  # non-zero exit
    doc = json.loads(out.read_text())
    assert doc["wrong_total"] > 0
    per = report.wrong_by_method(doc["results"])  # what the FAILED line lists, hidden variants too
    assert sum(per.values()) == doc["wrong_total"] and per["varcomm"] > 0 and per["fallback"] > 0, per
    for r in doc["results"]:
        for p in r["points"]:
            assert p["methods"]["varcomm"]["wrong"] > 0, (r["test"], p["size"])
            assert p["methods"]["fallback"]["wrong"] > 0, (r["test"], p["size"])


@world(2, timeout=60, requires=("torch",))
def test_check_counts_every_repeat(tmp_path: Path) -> None:
    """-r 3 counts three times the wrong messages of -r 1 (same iterations):
    the methods timed by every rank together kept only the last repeat's
    count, so bad data in an earlier repeat went unreported (helper-67).
    Catches: the count overwritten per repeat."""
    os.environ["VARCOMM_BENCH_CORRUPT"] = "1"
    wrong = {}
    for r in ("1", "3"):
        out = tmp_path / f"r{r}.json"
        cli.main(["p2p", "-b", "1K", "-e", "1K", *TINY, "-r", r, "-c", "--tests", "latency,bibw",
                  "--baselines", "fallback", "--json", str(out)])
        if rank() == 0:
            doc = json.loads(out.read_text())
            wrong[r] = {(res["test"], m): res["points"][0]["methods"][m]["wrong"] for res in doc["results"]
                        for m in ("varcomm", "fallback")}
    if rank() == 0:
        assert all(wrong["1"][k] > 0 and wrong["3"][k] == 3 * wrong["1"][k] for k in wrong["1"]), wrong


@world(2, timeout=60, requires=("torch",))
def test_without_check_nothing_is_verified(tmp_path: Path) -> None:
    os.environ["VARCOMM_BENCH_CORRUPT"] = "1"
    out = tmp_path / "nc.json"
    rc = cli.main(["p2p", "--tests", "latency", "-b", "8", "-e", "8", *TINY, "--baselines", "none",
                     "--json", str(out)])
    if rank() == 0:
        assert rc == 0
        p = json.loads(out.read_text())["results"][0]["points"][0]
        assert p["methods"]["varcomm"]["wrong"] is None  # shown as N/A, like nccl-tests without -c


# ---- the real command line --------------------------------------------------------------

def test_cli_relaunches_itself_and_plots(tmp_path: Path) -> None:
    """No launcher: varcomm-bench starts its own 2 ranks (mpirun when mpi4py is there, so the
    MPI baseline runs in the same job), prints the table, writes the JSON and the plot."""
    j, png = tmp_path / "r.json", tmp_path / "r.png"
    r = _cli(["p2p", "--tests", "latency,unibw", "-b", "8", "-e", "512", "-f", "8", "-r", "2", "-n", "3", "-c",
              "--baselines", "mpi4py,memcpy", "--json", str(j), "--plot", str(png), "--timeout", "150"], timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "time(us)" in r.stdout and "p2p latency" in r.stdout
    assert "p2p latency" in r.stderr and "(1/3," in r.stderr  # progress, one line per size
    doc = json.loads(j.read_text())
    assert [p["size"] for p in doc["results"][0]["points"]] == [8, 64, 512]
    mpi_ok = importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None
    lat = doc["results"][0]
    if mpi_ok:
        assert doc["launcher"].startswith("mpirun")
        assert all(p["methods"]["mpi4py"]["wrong"] == 0 for p in lat["points"])
        assert all(p["ratios"]["mpi4py"] > 0 for p in lat["points"])
        assert doc["machine"]["mpi"]
    else:
        assert lat["methods"]["mpi4py"]["status"] == "skipped"
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def _mpi_relaunch_or_skip() -> None:
    if importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None:
        pytest.skip("needs mpi4py and mpirun (varcomm-bench's mpirun relaunch)")


def _procs_of(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -ww" not in line]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_relaunching_cli_stops_mpirun_and_its_ranks(tmp_path: Path, sig: str) -> None:
    """varcomm-bench under its own mpirun (a session of its own): SIGTERM or SIGHUP
    (timeout(1), a batch system, a closed terminal) ended varcomm-bench alone, and
    mpirun and both ranks ran on, re-parented to init. Now the job stops with it."""
    import signal
    import time

    _mpi_relaunch_or_skip()
    marker = f"--json {tmp_path}/sig.json"  # names this job's processes
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in _JOB_VARS:
        env.pop(k, None)
    p = subprocess.Popen([sys.executable, "-m", "varcomm_bench", "p2p", "--tests", "latency", "-b", "8", "-e", "1M",
                          "-r", "50", "--baselines", "mpi4py", "-q", *marker.split()], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, restore_signals=True)
    try:
        deadline = time.monotonic() + 60
        while len(_procs_of(marker)) < 4:  # varcomm-bench, mpirun, 2 ranks
            assert p.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(getattr(signal, sig))
        assert p.wait(timeout=30) == 128 + getattr(signal, sig)
        deadline = time.monotonic() + 15
        while _procs_of(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _procs_of(marker), f"left running after {sig}: {_procs_of(marker)}"
    finally:
        for line in _procs_of(marker):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("failing", ["0", "1"])  # rank 0 hosts the store: its close() waited for the others
def test_a_rank_that_fails_under_mpirun_stops_the_job_at_once(failing: str) -> None:
    """One rank raises under varcomm-bench's mpirun: it waited in MPI_Finalize while
    the others spun in their next MPI call, until --timeout, whose message hid the
    error. Now the failing rank aborts the job: it ends at once, with the traceback."""
    import time

    _mpi_relaunch_or_skip()
    env_fail = "VARCOMM_BENCH_TEST_RAISE_ON_RANK"
    os.environ[env_fail] = failing
    try:
        t0 = time.monotonic()
        r = _cli(["p2p", "--tests", "latency", "-b", "8", "-e", "64", "-r", "2", "--baselines", "mpi4py", "-q",
                  "--timeout", "120"], timeout=150)
    finally:
        del os.environ[env_fail]
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert f"raised on rank {failing} for the test" in r.stderr, r.stderr[-3000:]
    assert "did not finish" not in r.stderr
    assert took < 20, f"took {took:.0f} s: the job waited for its peers or its timeout"


@world(2, timeout=60, requires=("libfabric",))
def test_raw_libfabric_provider() -> None:
    """--fi-provider, else the provider varcomm's rdma route chose (the core's
    route_info), else libfabric's shm when no peer is on rdma."""
    from types import SimpleNamespace

    from varcomm_bench.core import fi_provider

    ctx = SimpleNamespace(a=SimpleNamespace(fi_provider=None))
    with varcomm.init(transport="rdma", rdma_provider="tcp;ofi_rxm", timeout=30) as comm:
        info = comm.route_info(1 - comm.rank)
        assert info["route"] == "rdma" and info["provider"] == "tcp;ofi_rxm", info
        assert fi_provider(ctx, comm) == "tcp;ofi_rxm"
        ctx.a.fi_provider = "sockets"
        assert fi_provider(ctx, comm) == "sockets"
    ctx.a.fi_provider = None
    with varcomm.init(transport="shm", timeout=30) as comm:
        assert comm.route_info(1 - comm.rank)["route"] == "shm"
        assert fi_provider(ctx, comm) == "shm"


@pytest.mark.skipif(shutil.which("pkg-config") is None, reason="no pkg-config to build fi_pingpong")
def test_fi_pingpong_leaves_nothing_in_dev_shm() -> None:
    """libfabric's shm provider backs an endpoint with /dev/shm/<pid>:0:0,
    which only fi_close removes, and fi_pingpong never closed its endpoints:
    every run of the libfabric baseline (make demo, varcomm-bench all) left
    two 16 MiB files; a user trial found 1177 of them, 4.5 GB of tmpfs."""
    from types import SimpleNamespace

    from varcomm_bench.core import fi_binary

    exe, why = fi_binary(SimpleNamespace(a=SimpleNamespace(fi_pingpong=None)))
    if exe is None:
        pytest.skip(why)
    before = set(os.listdir("/dev/shm"))
    r = subprocess.run([exe, "-p", "shm", "-n", "20", "-s", "8"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"libfabric's shm provider does not run here: {r.stderr[-300:]}")
    left = [f for f in set(os.listdir("/dev/shm")) - before
            if re.fullmatch(r"\d+:\d+:\d+", f) and not _alive(int(f.split(":")[0]))]
    assert not left, f"fi_pingpong left {left} in /dev/shm"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def test_the_machine_line_says_when_fi_pingpong_never_ran() -> None:
    """The machine line said "libfabric 1.17.0 (verbs)" where fi_pingpong, asked
    for verbs, failed at every size: it named a provider nothing ran on."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(fi_provider_used="verbs", fi_seen_provider=None)
    assert cli.provider_used(ctx) == "verbs asked for; fi_pingpong did not run"
    ctx.fi_seen_provider = "tcp;ofi_rxm"
    assert cli.provider_used(ctx) == "tcp;ofi_rxm"


@pytest.mark.skipif("rdma-gpu" not in varcomm.build_info()["transports"],
                    reason="needs the rdma-gpu transport (libfabric and CUDA support at build time)")
@pytest.mark.parametrize("hmem", ["0", "1"])
def test_rdma_device_benchmark_runs_on_the_stand_in(hmem: str) -> None:
    """varcomm_bench.rdma_device (issue #13's CPU-stand-in benchmark), staged and
    by GPUDirect: it builds the fake driver, runs both of its tests on 2 ranks,
    and prints a row per delay and per chunk size with positive numbers."""
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, VARCOMM_RDMA_HMEM=hmem)
    for k in _JOB_VARS:
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "varcomm_bench.rdma_device", "--delays", "1000", "--chunks", "64K",
                        "--size", "256K", "--iters", "4"], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith(("| 1000 ", "| 64K "))]
    assert len(rows) == 2, r.stdout
    assert float(rows[0][2].split()[0]) > 0 and float(rows[1][4]) > 0, r.stdout


def test_help_names_every_subcommand() -> None:
    """`varcomm-bench --help` lists moe too (it has its own parser, and was missing there)."""
    text = cli._parser().format_help()
    for name in ("p2p", "varlen", "alltoall", "all", "moe"):
        assert f"\n    {name} " in text or f"\n  {name} " in text, (name, text)


def test_rss_without_a_seed_runs_as_the_readme_shows() -> None:
    """`python -m varcomm_bench.rss` without --seed: each rank drew its own
    seed, so the receiver checked the sender's sizes against other ones and
    failed ('message 96: (2616,) / last 454.0, want 455'); the two ranks'
    lines also ran together on the launcher's pipe."""
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    for k in _JOB_VARS:
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "varcomm_bench.rss", "-m", "400"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("rank ")]
    assert len(lines) == 2 and len({x.split(",")[0].split("seed ")[1] for x in lines}) == 1, r.stdout


def test_a_run_on_a_busy_machine_says_its_times_are_noisy() -> None:
    from varcomm_bench import report

    doc = {"date": "d", "launcher": "l", "elapsed_s": 1.0,
           "machine": {"cpu": "c", "cores": 2, "loadavg_start": [0.5], "loadavg_end": [8.6]}}
    assert "WARNING: load 8.6 on 2 cores during the run" in report.describe(doc)
    doc["machine"]["loadavg_end"] = [1.2]
    assert "WARNING" not in report.describe(doc)
