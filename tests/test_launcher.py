"""Tests for the ``varcomm-run`` launcher (varcomm.tools.run); no C extension needed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from varcomm.tools import run as vrun

PYTHONPATH = str(Path(vrun.__file__).resolve().parents[2])


def launch(*args: str, timeout: float = 30, extra_env: dict[str, str] | None = None,
           **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the launcher as a real process, the way users do."""
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", "varcomm.run", *args],
        env=env, capture_output=True, text=True, timeout=timeout, **kw,
    )


def script(tmp_path: Path, body: str, name: str = "prog.py") -> str:
    path = tmp_path / name
    path.write_text("import os, sys, time, signal\nrank = int(os.environ['RANK'])\n" + textwrap.dedent(body))
    return str(path)


def test_env_per_rank(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT", "VARCOMM_LAUNCHER", "VARCOMM_TEST_SEED"]
        import json
        json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1] + f"/env{rank}.json", "w"))
    """)
    res = launch("-n", "3", prog, str(tmp_path))
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["GROUP_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["VARCOMM_LAUNCHER"] == "1"
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert len({e["VARCOMM_TEST_SEED"] for e in envs}) == 1


def test_master_port_and_module(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text("import os\nprint('mod', os.environ['RANK'], os.environ['MASTER_PORT'])\n")
    res = launch("-n", "2", "--master-port", "23456", "--tag-output", "-m", "mymod", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] mod 0 23456", "[1] mod 1 23456"]


def test_tag_output_and_plain_executable() -> None:
    res = launch("-n", "2", "--tag-output", "sh", "-c", 'echo out $RANK; echo err $RANK >&2; printf partial')
    assert res.returncode == 0, res.stderr
    out, err = res.stdout.splitlines(), res.stderr.splitlines()
    assert "[0] out 0" in out and "[1] out 1" in out
    assert "[0] err 0" in err and "[1] err 1" in err
    assert "[1] partial" in out  # a last line without newline is still tagged
    assert all(line.startswith(("[0] ", "[1] ")) for line in out + err)


def test_tag_output_of_an_endless_line_comes_in_tagged_pieces(tmp_path: Path) -> None:
    """A rank writing 1 MiB without a newline (a progress bar redrawn with \\r,
    a dump): the launcher held it whole in memory and showed nothing until it
    ended. Now it is forwarded in pieces of vrun.PUMP_PIECE bytes, each tagged,
    and no byte is lost. Catches: one 1 MiB line."""
    prog = script(tmp_path, """
        sys.stdout.write("ab" * (512 * 1024))
        sys.stdout.flush()
    """)
    res = launch("-n", "1", "--tag-output", prog)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1024 * 1024 // vrun.PUMP_PIECE, len(lines)
    assert all(ln.startswith("[0] ") for ln in lines)
    assert "".join(ln[4:] for ln in lines) == "ab" * (512 * 1024)


def test_failing_rank_stops_others(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        if rank == 2:
            sys.exit(3)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    res = launch("-n", "3", prog)
    assert time.monotonic() - t0 < 20  # not the 60 s the others sleep (generous: slow CI)
    assert res.returncode == 3
    assert "rank 2 exited with code 3" in res.stderr
    assert "stopped ranks 0,1" in res.stderr


@pytest.mark.parametrize("how", ["exit", "raise", "catch"])
def test_the_rank_that_failed_first_is_named_not_the_peer_its_goodbye_ended(tmp_path: Path, how: str) -> None:
    """Rank 1 fails mid ping-pong; its exit-time goodbye makes rank 0 raise
    PeerFailure and exit, often before rank 1 has. The launcher still names
    rank 1 as the first failure, exits with its code, and says why rank 0
    ended, also where rank 0 catches the PeerFailure and exits with a code of
    its own ("catch"). Three jobs: the old launcher, which took the first exit
    it saw, got this wrong in about half of them.
    Catches: the report blaming the survivor, the job's code being the
    survivor's instead of the failing rank's."""
    prog = script(tmp_path, f"""
        import numpy as np, varcomm
        comm = varcomm.init(timeout=30)
        x = np.zeros(4, np.float32)
        try:
            for i in range(3000):
                if rank == 0:
                    comm.send(x, 1); comm.recv(1, out=x)
                else:
                    if i == 1000:
                        {"sys.exit(7)" if how == "exit" else "raise ValueError('boom')"}
                    comm.recv(0, out=x); comm.send(x, 0)
        except varcomm.PeerFailure:
            if {how == "catch"}:
                sys.exit(3)
            raise
    """)
    want, victim = (7 if how == "exit" else 1), (3 if how == "catch" else 1)
    for _ in range(3):
        res = launch("-n", "2", "--timeout", "60", prog, timeout=90)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("varcomm-run:")]
        assert res.returncode == want, res.stderr
        assert lines[0] == f"varcomm-run: rank 1 exited with code {want} (first failure)", res.stderr
        assert lines[1] == f"varcomm-run: rank 0 exited with code {victim} (after a peer's failure: PeerFailure)", \
            res.stderr


def test_a_rank_that_left_with_0_is_named_when_every_failure_was_a_peers(tmp_path: Path) -> None:
    """Rank 2 ends cleanly (code 0) while ranks 0 and 1 wait in an all-to-all
    for it: they fail with PeerFailure. The report names rank 2 as the one
    that left, and calls neither survivor the first failure.
    Catches (helper-66): rank 2 unnamed, a survivor reported as both
    "after a peer's failure" and "first failure"."""
    prog = script(tmp_path, """
        import numpy as np, varcomm
        comm = varcomm.init(timeout=30)
        if rank == 2:
            time.sleep(0.5)
            sys.exit(0)
        comm.all_to_all_v(np.ones((3, 2), np.float32), [1, 1, 1])
    """)
    for _ in range(3):  # (rank 2's own exit often comes after the failures it caused)
        res = launch("-n", "3", prog, timeout=60)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("varcomm-run:")]
        assert res.returncode == 1, res.stderr
        assert lines[0] == ("varcomm-run: rank 2 exited with code 0 before the others were done (their PeerFailure "
                            "names it)"), res.stderr
        assert sorted(lines[1:]) == [f"varcomm-run: rank {r} exited with code 1 (after a peer's failure: PeerFailure)"
                                     for r in (0, 1)], res.stderr


def test_a_ranks_children_do_not_inherit_its_failure_note(tmp_path: Path) -> None:
    """A process a rank starts after init (a data loader, a tool) is no rank:
    the launcher's note for the rank is not in its environment, so its
    PeerFailures cannot mark the rank as having met a peer's failure.
    Catches: the note's variable being inherited."""
    prog = script(tmp_path, """
        import subprocess, varcomm
        comm = varcomm.init(timeout=30)
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('VARCOMM_LAUNCHER_STATUS'))"],
                               capture_output=True, text=True, check=True)
        print(f"rank {rank} child sees {child.stdout.strip()}")
        comm.close()
    """)
    res = launch("-n", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr
    # (by count: without --tag-output the ranks' prints may share a line, as under mpirun)
    assert res.stdout.count("child sees None") == 2 and res.stdout.count("child sees") == 2, res.stdout


def test_signal_killed_rank(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    res = launch("-n", "2", prog)
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 1 killed by signal SIGKILL" in res.stderr


def test_sigterm_ignoring_rank_is_killed(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 0:
            time.sleep(0.3)
            sys.exit(5)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    res = launch("-n", "2", prog)
    assert vrun.KILL_GRACE_S - 0.5 < time.monotonic() - t0 < vrun.KILL_GRACE_S + 15
    assert res.returncode == 5 and "rank 0 exited with code 5" in res.stderr


def test_timeout(tmp_path: Path) -> None:
    prog = script(tmp_path, "time.sleep(60)\n")
    t0 = time.monotonic()
    res = launch("-n", "2", "--timeout", "1", prog)
    assert 0.9 < time.monotonic() - t0 < 20
    assert res.returncode == 124
    assert "timeout after 1 s: ranks 0,1 still running" in res.stderr


@pytest.mark.parametrize("bad", ["-1", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    """--timeout -1 stopped every rank at once ("timeout after -1 s", exit
    124) and --timeout 0 meant no timeout at all: both are usage errors now,
    before any rank starts."""
    prog = script(tmp_path, "print('ran')\n")
    res = launch("-n", "2", "--timeout", bad, prog)
    assert res.returncode == 2, res.stderr
    assert "--timeout must be a number of seconds > 0" in res.stderr and "ran" not in res.stdout


@pytest.mark.parametrize("bad", ["99999", "0", "-5"])
def test_a_master_port_that_is_no_port_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    """--master-port 99999 started the ranks: rank 0 died in torch's TCPStore with a
    raw TypeError, and rank 1 said another program owned the port. Now it is a
    usage error naming the range, before any rank starts."""
    prog = script(tmp_path, "print('ran')\n")
    res = launch("-n", "2", "--master-port", bad, prog)
    assert res.returncode == 2, res.stderr
    assert "--master-port must be a TCP port in 1..65535" in res.stderr and "ran" not in res.stdout


def test_a_rank_count_far_over_the_cores_needs_oversubscribe(tmp_path: Path) -> None:
    """-n 5000 (a typo) started 5000 processes on a 2-core machine. Now more than
    16 ranks per core (at least 64) is a usage error unless --oversubscribe."""
    prog = script(tmp_path, "print('ran')\n")
    res = launch("-n", "5000", prog)
    assert res.returncode == 2, res.stderr
    assert "pass --oversubscribe if you mean it" in res.stderr and "ran" not in res.stdout
    res = launch("-n", "3", "--oversubscribe", prog)  # the flag itself is accepted
    assert res.returncode == 0 and res.stdout.count("ran") == 3, res.stderr


def test_an_unknown_variable_is_one_plain_line_from_the_launcher(tmp_path: Path) -> None:
    """VARCOMM_BOUNDS (a typo) came out of the launcher as a raw `warnings` line
    naming run.py's source line, and then from every rank that resolved its
    options. Now it is one line in the launcher's words, for the job."""
    prog = script(tmp_path, "import varcomm\nvarcomm.Options.resolve()\nprint('ran')\n")
    res = launch("-n", "2", prog, extra_env={"VARCOMM_BOUNDS": "1K"})
    assert res.returncode == 0 and res.stdout.count("ran") == 2, res.stderr
    assert ("varcomm-run: warning: VARCOMM_BOUNDS is not a varcomm variable (did you mean VARCOMM_BOUND?)"
            in res.stderr), res.stderr
    assert res.stderr.count("VARCOMM_BOUNDS") == 1, res.stderr
    assert "run.py:" not in res.stderr and "UserWarning" not in res.stderr, res.stderr
    # one a rank sets itself the launcher never saw: that rank says it
    prog = script(tmp_path, "import varcomm\nif rank == 1: os.environ['VARCOMM_SLOT'] = '4'\n"
                            "varcomm.Options.resolve()\nprint('ran')\n", name="own.py")
    res = launch("-n", "2", prog, extra_env={"VARCOMM_BOUNDS": "1K"})
    assert res.returncode == 0 and res.stderr.count("VARCOMM_BOUNDS") == 1, res.stderr
    assert res.stderr.count("VARCOMM_SLOT is not a varcomm variable (did you mean VARCOMM_SLOTS?)") == 1, res.stderr


def test_grandchildren_are_killed(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        import subprocess
        p = subprocess.Popen(["sleep", "60"])
        open(sys.argv[1] + f"/pid{rank}", "w").write(str(p.pid))
        if rank == 0:
            time.sleep(0.3)
            sys.exit(1)
        time.sleep(60)
    """)
    res = launch("-n", "2", prog, str(tmp_path))
    assert res.returncode == 1
    for r in range(2):
        pid = int((tmp_path / f"pid{r}").read_text())
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"grandchild of rank {r} survived"


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie: orphans may stay unreaped in containers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_forwarded(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        open(sys.argv[1] + f"/ready{rank}", "w").close()
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    p = subprocess.Popen([sys.executable, "-m", "varcomm.run", "-n", "2", prog, str(tmp_path)],
                         env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=10)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 128 + signal.SIGTERM
    # The ranks' deaths by the forwarded signal are not reported as failures of their own.
    assert "interrupted by SIGTERM" in err and "stopped ranks 0,1 on signal" in err, err
    assert "killed by signal" not in err, err


def test_main_in_process_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert vrun.main(["-n", "2", "true"]) == 0
    assert vrun.main(["-n", "2", "false"]) == 1
    assert "exited with code 1" in capsys.readouterr().err  # either rank may be seen first
    with pytest.raises(SystemExit):
        vrun.main(["-n", "2"])  # no program
    assert vrun.main(["-n", "1", "/nonexistent/program"]) == 127


def test_split_argv() -> None:
    assert vrun._split_argv(["-n", "2", "--tag-output", "prog", "-n", "5"]) == (
        ["-n", "2", "--tag-output"], ["prog", "-n", "5"])
    assert vrun._split_argv(["-n", "2", "-m", "pytest", "-q"]) == (["-n", "2"], ["-m", "pytest", "-q"])
    assert vrun._split_argv(["-n", "2", "--", "-weird"]) == (["-n", "2"], ["-weird"])
    assert vrun._command(["x.py", "a"]) == [sys.executable, "x.py", "a"]
    # A bare python is the launcher's interpreter (PATH's first one, outside the venv, lacked torch).
    for py in ("python", "python3", "python3.11"):
        assert vrun._command([py, "x.py", "a"]) == [sys.executable, "x.py", "a"], py
    for other in (["/usr/bin/python3", "x.py"], ["pythonista"], ["python2"]):
        assert vrun._command(other) == other



def start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """A launcher running 2 ranks that write their pids and sleep; (launcher, rank pids) once both are up.
    The launcher's stderr goes to tmp_path/err: orphaned ranks would hold a pipe open."""
    prog = script(tmp_path, """
        open(sys.argv[1] + f"/pid{rank}.tmp", "w").write(str(os.getpid()))
        os.rename(sys.argv[1] + f"/pid{rank}.tmp", sys.argv[1] + f"/pid{rank}")
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "varcomm.run", "-n", "2", prog, str(tmp_path)],
                             env=env, stderr=err, text=True)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            p.wait()
            pytest.fail(f"ranks did not start: {(tmp_path / 'err').read_text()}")
        time.sleep(0.05)
    return p, [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after `seconds` (killed then, so a failing test leaves no orphans)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    # SIGKILL gives the launcher no chance to stop its ranks: only the kernel can.
    p, pids = start_sleepers(tmp_path)
    p.kill()
    p.wait()
    assert gone_within(pids, 5) == [], "ranks outlived their SIGKILLed launcher"


def test_sighup_stops_the_ranks(tmp_path: Path) -> None:
    # A closed terminal sends SIGHUP to the launcher alone (the ranks have their own sessions).
    p, pids = start_sleepers(tmp_path)
    try:
        p.send_signal(signal.SIGHUP)
        p.wait(timeout=15)
    finally:
        p.kill()
        p.wait()
        left = gone_within(pids, 5)
    err = (tmp_path / "err").read_text()
    assert p.returncode == 128 + signal.SIGHUP, (p.returncode, err)
    assert "interrupted by SIGHUP" in err, err
    assert left == [], "ranks outlived the launcher's SIGHUP"


@pytest.mark.parametrize("var,value", [("VARCOMM_TEST_SEED", "x"), ("VARCOMM_TIMEOUT", "soon")])
def test_an_invalid_varcomm_variable_is_a_usage_error_and_starts_no_rank(tmp_path: Path, var: str,
                                                                         value: str) -> None:
    """A bad VARCOMM_* value fails every rank alike (or, the seed, the
    launcher with a traceback): the launcher names it once, exit 2, and no
    rank runs."""
    prog = script(tmp_path, "open(sys.argv[1] + f'/ran{rank}', 'w').close()\n")
    res = launch("-n", "2", prog, str(tmp_path), extra_env={var: value})
    assert res.returncode == 2, res.stderr
    assert f"{var}={value!r}" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.glob("ran*"))
