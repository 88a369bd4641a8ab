"""Tests for the multi-rank pytest harness (varcomm.tools.testing); no C extension needed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from varcomm.testing import WorldFailure, has, rank, run_world, seeded, skip_unless, world, world_size
from varcomm.tools import testing as vt

try:  # imported here, before forking, so ranks don't each pay for it
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

PYTHONPATH = str(Path(vt.__file__).resolve().parents[2])
LAUNCHER_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                 "VARCOMM_TEST_TIMEOUT_SCALE", "VARCOMM_TEST_SEED"]


@pytest.fixture
def clean_env() -> Iterator[None]:
    """No launcher/harness variables from the outside; restore os.environ afterwards."""
    saved = dict(os.environ)
    for key in LAUNCHER_KEYS:
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def children() -> list[str]:
    """Our child processes (including zombies), as 'pid state' strings."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(f"{entry.name} {fields[0]}")
    return found


# --- the decorator, as the suite uses it -------------------------------------------------


@world(3, timeout=30, requires=("torch",))
def test_world_ranks_share_a_store(tmp_path: Path) -> None:
    r, n, port = rank(), world_size(), int(os.environ["MASTER_PORT"])
    assert n == 3 and os.environ["LOCAL_RANK"] == str(r) and os.environ["MASTER_ADDR"] == "127.0.0.1"
    store = dist.TCPStore("127.0.0.1", port, n, r == 0, timeout=timedelta(seconds=20))
    store.set(f"rank{r}", str(os.getpid()))
    store.wait([f"rank{i}" for i in range(n)])
    assert len({store.get(f"rank{i}") for i in range(n)}) == n  # distinct processes
    (tmp_path / f"seen{r}").write_text(str(port))  # fixture value is shared by all ranks
    store.set(f"exit{r}", "1")
    if r == 0:  # the store's server lives in rank 0: leave last
        store.wait([f"exit{i}" for i in range(n)])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["seen0", "seen1", "seen2"]


@pytest.mark.parametrize("x", [1, 2])
@world(2, timeout=20)
def test_world_gets_params(x: int, tmp_path: Path) -> None:
    assert x in (1, 2) and tmp_path.is_dir()
    assert world_size() == 2


@world(3, timeout=20, expect_exit={2: None})
def test_world_expected_death() -> None:
    if rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)


REQUIRES_SAMPLE = """
    import os
    from pathlib import Path
    from varcomm.testing import world, rank

    MARK = Path(os.environ["REQ_MARK_DIR"])

    @world(2, timeout=20, requires=(lambda: "demonstrates a callable requirement",))
    def test_unmet_callable():
        (MARK / f"unmet{rank()}").write_text("ran")

    @world(2, timeout=20, requires=(lambda: None,))
    def test_met_callable():
        (MARK / f"met{rank()}").write_text("ran")

    @world(2, timeout=20, requires=("torch",))
    def test_met_named():
        (MARK / f"named{rank()}").write_text("ran")
"""


def test_world_skipped_by_requirement(tmp_path: Path) -> None:
    """An unmet requirement skips (with its reason, no rank forked, the body never
    runs); met ones, callable or named, run the body on every rank."""
    (tmp_path / "test_req.py").write_text(textwrap.dedent(REQUIRES_SAMPLE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env.update(PYTHONPATH=PYTHONPATH, REQ_MARK_DIR=str(marks))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_req.py"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "2 passed, 1 skipped" in out, out
    assert re.search(r"SKIPPED \[1\] .*needs <lambda>: demonstrates a callable requirement", out), out
    assert sorted(p.name for p in marks.iterdir()) == ["met0", "met1", "named0", "named1"]


# --- the runner, driven directly so failures can be asserted on --------------------------


def test_env_args_and_seed(tmp_path: Path, clean_env: None) -> None:
    def body(d: str, *, tag: str) -> None:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        info: dict[str, object] = {k: os.environ[k] for k in keys}
        info.update(tag=tag, seed=seeded(), pid=os.getpid(), rank=rank())
        Path(d, f"r{rank()}.json").write_text(json.dumps(info))

    run_world(body, 3, (str(tmp_path),), {"tag": "hi"}, timeout=20)
    infos = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert [i["RANK"] for i in infos] == [i["LOCAL_RANK"] for i in infos] == ["0", "1", "2"]
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert {i["WORLD_SIZE"] for i in infos} == {i["LOCAL_WORLD_SIZE"] for i in infos} == {"3"}
    assert len({i["MASTER_PORT"] for i in infos}) == 1 and len({i["pid"] for i in infos}) == 3
    assert len({i["seed"] for i in infos}) == 1 and {i["tag"] for i in infos} == {"hi"}
    assert "RANK" not in os.environ  # the parent's env is untouched
    assert children() == []


def test_failing_rank_is_reported(clean_env: None) -> None:
    def body() -> None:
        print(f"hello from rank {rank()}", flush=True)
        if rank() == 1:
            raise ValueError("boom on rank 1")
        time.sleep(30)  # peers would hang on the dead rank; the harness stops them

    t0 = time.monotonic()
    with pytest.raises(WorldFailure) as err:
        run_world(body, 3, timeout=20, fail_grace=1.0)
    assert time.monotonic() - t0 < 15  # not the 30 s the others sleep
    msg = str(err.value)
    assert "rank 1 raised an exception" in msg
    assert "ValueError: boom on rank 1" in msg and "in body" in msg  # traceback
    assert "hello from rank 1" in msg  # output tail
    assert "ranks 0,2 killed 1 s after the first failure" in msg
    for r in (0, 2):  # where the stopped ranks were (faulthandler dump), without pytest's frames
        section = msg.split(f"----- rank {r} (killed")[1].split("-----", 2)[1]
        assert re.search(r'File ".*test_harness.py", line \d+ in body', section), section
        assert "_pytest" not in section
    assert children() == []


def test_hanging_rank_times_out(clean_env: None) -> None:
    def hang_here() -> None:
        time.sleep(60)

    def body() -> None:
        if rank() == 1:
            hang_here()

    os.environ["VARCOMM_TEST_TIMEOUT_SCALE"] = "0.5"
    t0 = time.monotonic()
    with pytest.raises(WorldFailure) as err:
        run_world(body, 2, timeout=4)  # scaled to 2 s
    assert 1.9 < time.monotonic() - t0 < 15
    msg = str(err.value)
    assert "timeout after 2 s: ranks 1 still running" in msg
    assert "hang_here" in msg  # faulthandler's dump shows where it hung
    assert children() == []


@pytest.mark.parametrize(
    "how, expect, problem",
    [
        ("exit7", {2: 7}, None),
        ("kill", {2: None}, None),
        ("hang", {2: None}, None),  # killed once the others are done
        ("kill", {2: -signal.SIGKILL}, None),
        ("return", {2: 7}, "rank 2 expected exited with code 7, but it exited with code 0"),
        ("exit7", None, "rank 2 exited with code 7"),
        ("exit0", None, "rank 2 exited with code 0 before the test function returned"),
        ("kill", None, "rank 2 killed by signal SIGKILL"),
    ],
)
def test_expect_exit(how: str, expect: dict[int, int | None] | None, problem: str | None, clean_env: None) -> None:
    def body() -> None:
        if rank() != 2:
            return
        if how == "exit7":
            os._exit(7)
        if how == "exit0":
            os._exit(0)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(60)

    t0 = time.monotonic()
    if problem is None:
        run_world(body, 3, timeout=20, expect_exit=expect)
    else:
        with pytest.raises(WorldFailure, match=problem):
            run_world(body, 3, timeout=20, expect_exit=expect)
    assert time.monotonic() - t0 < 15  # "hang" must not wait for its 60 s
    assert children() == []


def test_skip_inside_rank(clean_env: None) -> None:
    def body() -> None:
        if rank() == 0:
            pytest.skip("rank 0 says skip")

    with pytest.raises(pytest.skip.Exception, match="rank 0 says skip"):
        run_world(body, 2, timeout=20)


# --- requirements and launcher mode -------------------------------------------------------


def test_requirements() -> None:
    calls: list[int] = []

    @world(2, requires=(lambda: "not today",))
    def never() -> None:
        calls.append(1)

    with pytest.raises(pytest.skip.Exception, match="needs <lambda>: not today"):
        never()
    assert calls == []
    with pytest.raises(ValueError, match="unknown requirement"):
        world(2, requires=("nonsense",))
    assert has("root") == (os.geteuid() == 0, "" if os.geteuid() == 0 else "not running as root")
    for name in vt.KNOWN_REQUIREMENTS:
        ok, why = has(name)
        assert isinstance(ok, bool) and (ok or why)
    assert has("torch") == (True, "")
    mark = skip_unless("torch", lambda: "nope")
    assert mark.mark.args == (True,) and mark.mark.kwargs["reason"] == "needs <lambda>: nope"
    assert skip_unless("torch").mark.args == (False,)


def test_seeded(clean_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert seeded(5) == 5
    os.environ["VARCOMM_TEST_SEED"] = "123"
    assert seeded() == 123
    assert "varcomm test seed: 5\nvarcomm test seed: 123\n" in capsys.readouterr().out


def test_under_an_external_launcher(clean_env: None) -> None:
    """Under mpirun/varcomm-run the body runs in-process, with torchrun-style env filled in."""
    os.environ.update(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1")
    seen: list[tuple[object, ...]] = []

    @world(2)
    def body(x: int) -> None:
        seen.append((x, os.getpid(), rank(), world_size(), os.environ["RANK"], os.environ["WORLD_SIZE"]))

    body(x=5)
    assert seen == [(5, os.getpid(), 1, 2, "1", "2")]
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["LOCAL_RANK"] == "1"

    @world(3)
    def wrong_size() -> None:
        raise AssertionError("must not run")

    with pytest.raises(pytest.skip.Exception, match="needs 3 ranks"):
        wrong_size()


# --- end to end: a real pytest session, plain and under varcomm-run ---------------------

SAMPLE = """
    import os
    from varcomm.testing import world, rank

    @world(2, timeout=20)
    def test_ok(tmp_path):
        print("ok from", rank())

    @world(3, timeout=20)
    def test_three():
        assert os.environ["WORLD_SIZE"] == "3"

    @world(2, timeout=20)
    def test_fails():
        print("about to fail on", rank())
        assert rank() != 1, "rank one is unhappy"
"""


def run_pytest(tmp_path: Path, *launcher: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["PYTHONPATH"] = PYTHONPATH
    cmd = [*launcher, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_pytest_session_end_to_end(tmp_path: Path) -> None:
    res = run_pytest(tmp_path)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "1 failed, 2 passed" in out
    assert "rank 1 raised an exception" in out and "rank one is unhappy" in out
    assert "about to fail on 1" in out  # rank output shown with the failure


def test_pytest_session_under_launcher(tmp_path: Path) -> None:
    launcher = (sys.executable, "-m", "varcomm.run", "-n", "2", "--tag-output", "--timeout", "50")
    res = run_pytest(tmp_path, *launcher, args=("-k", "not fails"))
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(2):  # each rank ran test_ok in-process and skipped the 3-rank test
        assert f"[{r}] 1 passed, 1 skipped, 1 deselected" in res.stdout
