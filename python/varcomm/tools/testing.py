"""Multi-rank pytest harness: ``@world(n)`` runs one test body on n ranks.

Usage::

    from varcomm.testing import world, rank

    @world(4, timeout=30, requires=("torch",))
    def test_allreduce(tmp_path):          # fixtures/params arrive as usual
        comm = varcomm.init()              # finds RANK/WORLD_SIZE/MASTER_* in env
        ...

How it runs, and why:

* Plain ``pytest``: the decorated test forks n rank processes straight from
  the pytest process. Forking (not spawning) is what keeps a suite of many
  multi-rank tests fast: torch is already imported, so a rank starts in
  milliseconds. Each rank gets a torchrun-compatible environment with a fresh
  MASTER_PORT per test, its stdout/stderr captured to a file, and reports
  success or its traceback back through a result file; it then leaves with
  ``os._exit`` so it never returns into pytest (or runs pytest's atexit code).
  Consequence: the pytest process itself must not initialise CUDA before GPU
  ``@world`` tests run (CUDA does not survive fork).
* Under a launcher (``varcomm-run -n N python -m pytest``, torchrun, mpirun):
  every rank already runs the whole session, so the test body runs in-process
  when the job has exactly n ranks, and is skipped otherwise.

A failing rank fails the test with its traceback and the tail of its output;
other ranks are stopped a few seconds later (they would otherwise hang on the
dead peer). A hung job is killed at the timeout, and each rank's faulthandler
dump (written shortly before) shows where it hung.
"""

from __future__ import annotations

import ctypes.util
import faulthandler
import functools
import importlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar, Union

from ..bootstrap import LOCAL_RANK_VARS, LOCAL_WORLD_SIZE_VARS, RANK_VARS, WORLD_SIZE_VARS, env_int, launched
from ..options import ToolOptions, env_name
from .run import _exit_status, _signal_group, free_port, rank_env

if TYPE_CHECKING:
    import pytest

_SEED_VAR = env_name(ToolOptions, "test_seed")

__all__ = [
    "world",
    "run_world",
    "WorldFailure",
    "has",
    "skip_unless",
    "rank",
    "world_size",
    "seeded",
    "Requirement",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A named requirement, or a callable returning a skip reason (None when satisfied).
Requirement = Union[str, Callable[[], Union[str, None]]]

KNOWN_REQUIREMENTS = ("torch", "numpy", "mpi4py", "libfabric", "root", "gpu", "netns")
#: After the first rank fails, the others get this long (scaled) to finish before being killed.
FAIL_GRACE_S = 3.0
#: Lines of a failing rank's output quoted in the failure message.
TAIL_LINES = 40

class WorldFailure(AssertionError):
    """A multi-rank test failed; the message holds every failing rank's traceback and output tail."""


# ---------------------------------------------------------------------------
# small helpers usable inside rank bodies


def _pytest() -> Any:
    """pytest, imported only where the harness acts as pytest's (skips, marks)."""
    import pytest

    return pytest


def rank() -> int:
    """This process's rank (RANK, or another launcher's variable); 0 outside a world."""
    r = env_int(RANK_VARS)
    return 0 if r is None else r


def world_size() -> int:
    """Number of ranks in this job (WORLD_SIZE, or another launcher's variable); 1 outside a world."""
    n = env_int(WORLD_SIZE_VARS)
    return 1 if n is None else n


def seeded(seed: int | None = None) -> int:
    """Pick a seed for a randomized test and print it, so a failing run can be replayed.

    Uses ``seed``, else env VARCOMM_TEST_SEED, else a random one. ``@world``
    (and ``varcomm-run``) export one VARCOMM_TEST_SEED to all ranks, so every
    rank of a test gets the same seed.
    """
    if seed is None:
        env = ToolOptions.resolve().test_seed
        seed = env if env is not None else random.SystemRandom().randrange(2**32)
    print(f"varcomm test seed: {seed}", flush=True)
    return seed


def _timeout_scale() -> float:
    """Slow machines/CI can stretch every timeout with VARCOMM_TEST_TIMEOUT_SCALE."""
    return ToolOptions.resolve().test_timeout_scale


# ---------------------------------------------------------------------------
# requirements


def has(requirement: Requirement) -> tuple[bool, str]:
    """Whether ``requirement`` is met here, and if not, why (the skip reason)."""
    if callable(requirement):
        reason = requirement()
        return reason is None, reason or ""
    return _has_named(requirement)


@functools.cache
def _has_named(name: str) -> tuple[bool, str]:
    if name in ("torch", "numpy"):
        try:
            importlib.import_module(name)
            return True, ""
        except Exception as e:  # a broken install counts as missing
            return False, f"cannot import {name}: {e}"
    if name == "mpi4py":  # find_spec only: `from mpi4py import MPI` would initialise MPI
        found = importlib.util.find_spec("mpi4py") is not None
        return found, "" if found else "mpi4py is not installed"
    if name == "libfabric":
        if ctypes.util.find_library("fabric"):
            return True, ""
        if shutil.which("pkg-config"):
            r = subprocess.run(["pkg-config", "--exists", "libfabric"], capture_output=True)
            if r.returncode == 0:
                return True, ""
        return False, "libfabric not found (find_library('fabric'), pkg-config libfabric)"
    if name == "root":
        ok = os.geteuid() == 0
        return ok, "" if ok else "not running as root"
    if name == "netns":
        if os.geteuid() != 0:
            return False, "network namespaces need root"
        ok = shutil.which("ip") is not None
        return ok, "" if ok else "the `ip` command is missing"
    if name == "gpu":
        return _gpu_available()
    raise ValueError(f"unknown requirement {name!r}; known: {', '.join(KNOWN_REQUIREMENTS)}")


def _gpu_available() -> tuple[bool, str]:
    """Ask torch about CUDA in a throwaway forked child.

    torch.cuda.is_available() initialises the CUDA driver, after which forked
    ranks can no longer use CUDA; probing in a child keeps the pytest process clean.
    """
    ok, why = _has_named("torch")
    if not ok:
        return False, why
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 2
        try:
            import torch

            code = 0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    ok = os.waitstatus_to_exitcode(status) == 0
    return ok, "" if ok else "torch sees no CUDA device"


def _requirement_name(req: Requirement) -> str:
    return req if isinstance(req, str) else getattr(req, "__name__", repr(req))


def _skip_reason(requirements: Sequence[Requirement]) -> str | None:
    for req in requirements:
        ok, why = has(req)
        if not ok:
            return f"needs {_requirement_name(req)}: {why}"
    return None


def skip_unless(*requirements: Requirement) -> pytest.MarkDecorator:
    """A ``pytest.mark.skipif`` for ordinary (single-process) tests, e.g. ``@skip_unless("root")``."""
    reason = _skip_reason(requirements)
    mark: pytest.MarkDecorator = _pytest().mark.skipif(reason is not None, reason=reason or "")
    return mark


# ---------------------------------------------------------------------------
# running under an external launcher


def _export_launcher_env(size: int, r: int) -> None:
    """Fill in torchrun's variables from another launcher's so ``varcomm.init()`` finds them."""
    env = os.environ
    local_rank = env_int(LOCAL_RANK_VARS)
    local_size = env_int(LOCAL_WORLD_SIZE_VARS)
    env.setdefault("RANK", str(r))
    env.setdefault("WORLD_SIZE", str(size))
    env.setdefault("LOCAL_RANK", str(r if local_rank is None else local_rank))
    env.setdefault("LOCAL_WORLD_SIZE", str(size if local_size is None else local_size))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")  # torchrun's default; mpirun can't agree on a free one


def _run_in_process(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> Any:
    # A hung rank must not hang the whole launched job forever: dump stacks and exit.
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return fn(*args, **kwargs)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------------------
# the forking runner


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    r: int,
    n: int,
    port: int,
    seed: str,
    workdir: str,
    timeout: float,
) -> NoReturn:
    """Body of one forked rank. Never returns: always ends in ``os._exit``."""
    code = 1
    try:
        os.setsid()  # own process group: the parent can kill our subprocesses with us
        out = os.open(os.path.join(workdir, f"rank{r}.out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # pytest's capture replaced sys.stdout/err with objects writing to its own files.
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        faulthandler.enable(file=sys.stderr, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        faulthandler.dump_traceback_later(timeout - min(2.0, timeout / 2), file=sys.stderr)
        os.environ.update(rank_env(r, n, port, base={}))
        os.environ[_SEED_VAR] = seed
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(ToolOptions.resolve().test_threads)  # n ranks share few cores

        status, payload = "ok", ""
        try:
            fn(*args, **kwargs)
        except BaseException as e:
            pytest_mod = sys.modules.get("pytest")  # a skip can only come from a pytest already imported
            if pytest_mod is not None and isinstance(e, pytest_mod.skip.Exception):
                status, payload = "skip", str(getattr(e, "msg", e))
            elif isinstance(e, SystemExit) and e.code in (0, None):
                pass
            else:  # drop the _child frame: the user's frames are what matter
                tb = e.__traceback__.tb_next if e.__traceback__ else None
                status, payload = "error", "".join(traceback.format_exception(type(e), e, tb))
                print(payload, file=sys.stderr, end="")
        faulthandler.cancel_dump_traceback_later()
        tmp = os.path.join(workdir, f"rank{r}.result.tmp")
        with open(tmp, "w") as f:
            f.write(f"{status}\n{payload}")
        os.replace(tmp, os.path.join(workdir, f"rank{r}.result"))
        code = 1 if status == "error" else 0
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _trim_dumps(text: str) -> str:
    """Cut faulthandler dumps below the harness frame: the pytest frames forked ranks inherit are noise."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if skipping and line.startswith('  File "'):
            continue
        skipping = False
        out.append(line)
        if line.startswith('  File "') and line.endswith(" in _child") and "testing.py" in line:
            out[-1] = "  (harness and pytest frames omitted)"
            skipping = True
    return "\n".join(out)


def _tail(text: str, lines: int) -> str:
    parts = text.rstrip("\n").splitlines()
    cut = parts[-lines:]
    head = f"[... {len(parts) - len(cut)} earlier lines ...]\n" if len(parts) > len(cut) else ""
    return head + "\n".join(cut)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _problem(code: int, result: str | None, expected: int | None | str) -> tuple[str | None, str]:
    """(what went wrong or None, traceback) for a rank that ended with ``code``.

    ``expected`` is the expect_exit entry, or "success" when the rank must pass.
    """
    status, _, payload = (result or "").partition("\n")
    tb = payload if status == "error" else ""
    if expected is None:
        return None, ""
    if expected != "success":
        return (None, "") if code == expected else (f"expected {_how(expected)}, but it {_how(code)}", tb)  # type: ignore[arg-type]
    if status == "error":
        return "raised an exception", tb
    if code != 0:
        return _how(code), ""
    if result is None:
        return "exited with code 0 before the test function returned", ""
    return None, ""


def run_world(
    fn: Callable[..., Any],
    n: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float = 60.0,
    expect_exit: Mapping[int, int | None] | None = None,
    fail_grace: float = FAIL_GRACE_S,
) -> None:
    """Run ``fn(*args, **kwargs)`` on ``n`` forked ranks; raise WorldFailure unless all pass.

    ``expect_exit[r]``: None = rank r may end any way (and is killed once the
    others are done); an int = rank r must exit with that code (-S: killed by
    signal S). Timeouts are multiplied by VARCOMM_TEST_TIMEOUT_SCALE.
    """
    __tracebackhide__ = True
    scale = _timeout_scale()
    limit, grace = timeout * scale, fail_grace * scale
    expected: dict[int, int | None | str] = dict.fromkeys(range(n), "success")
    expected.update(expect_exit or {})
    port = free_port()
    given = ToolOptions.resolve().test_seed
    seed = str(given if given is not None else random.SystemRandom().randrange(2**32))
    workdir = tempfile.mkdtemp(prefix="varcomm-world-")
    pids: list[int] = []
    codes: dict[int, int] = {}
    problems: dict[int, tuple[str, str]] = {}
    killed: dict[int, str] = {}  # rank -> why the harness killed it
    first_failure: float | None = None

    def kill(ranks: Sequence[int], why: str, dump: bool) -> None:
        todo = [r for r in ranks if r not in codes and r not in killed]
        if dump and todo:  # ask for a stack dump first: it shows where the rank was stuck
            for r in todo:
                _signal_group(pids[r], signal.SIGUSR1)
            time.sleep(0.3)
        for r in todo:
            killed[r] = why
            _signal_group(pids[r], signal.SIGKILL)

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for r in range(n):
            # Python >= 3.12 warns when forking a threaded process; accepted trade-off for speed.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                _child(fn, tuple(args), dict(kwargs or {}), r, n, port, seed, workdir, limit)
            pids.append(pid)
        deadline = time.monotonic() + limit
        while len(codes) < n:
            for r, pid in enumerate(pids):
                code = _exit_status(pid) if r not in codes else None
                if code is not None:  # not reaped yet: see the finally block
                    codes[r] = code
                    if r in killed:
                        continue
                    what, tb = _problem(codes[r], _read(os.path.join(workdir, f"rank{r}.result")), expected[r])
                    if what is not None:
                        problems[r] = (what, tb)
                        first_failure = first_failure or time.monotonic()
            running = [r for r in range(n) if r not in codes]
            if not running:
                break
            now = time.monotonic()
            if now >= deadline:
                kill(running, f"timeout after {limit:g} s", dump=False)  # dumped at limit-2 already
            elif first_failure is not None and now - first_failure >= grace:
                kill(running, f"killed {grace:g} s after the first failure", dump=True)
            elif all(expected[r] is None for r in running):
                kill(running, "expected to die; killed once the others finished", dump=False)
            time.sleep(0.01)
    finally:
        # Ranks are reaped only now, so their process-group ids are still ours:
        # kill stray grandchildren (and, after an error in the loop, the ranks).
        for pid in pids:
            _signal_group(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)

    outputs = {r: _trim_dumps(_read(os.path.join(workdir, f"rank{r}.out")) or "") for r in range(n)}
    results = {r: _read(os.path.join(workdir, f"rank{r}.result")) for r in range(n)}
    shutil.rmtree(workdir, ignore_errors=True)
    for r in range(n):  # captured by pytest, shown with the failure
        if outputs[r]:
            print(f"----- rank {r} output -----\n{_tail(outputs[r], 1000)}")

    timed_out = sorted(r for r, why in killed.items() if why.startswith("timeout"))
    collateral = sorted(r for r, why in killed.items() if "after the first failure" in why)
    if problems or timed_out:
        raise WorldFailure(_failure_message(n, problems, timed_out, collateral, killed, outputs))
    skips = [(results[r] or "").partition("\n")[2] for r in range(n) if (results[r] or "").startswith("skip")]
    if skips:
        _pytest().skip(skips[0])


def _failure_message(
    n: int,
    problems: Mapping[int, tuple[str, str]],
    timed_out: Sequence[int],
    collateral: Sequence[int],
    killed: Mapping[int, str],
    outputs: Mapping[int, str],
) -> str:
    summary = [f"rank {r} {what}" for r, (what, _) in problems.items()]
    if timed_out:
        summary.append(f"{killed[timed_out[0]]}: ranks {','.join(map(str, timed_out))} still running (killed)")
    if collateral:
        summary.append(f"ranks {','.join(map(str, collateral))} {killed[collateral[0]]}")
    parts = [f"world({n}) failed: " + "; ".join(summary)]
    for r, (what, tb) in problems.items():
        parts.append(f"===== rank {r}: {what} =====")
        out = outputs[r]
        if tb:
            parts.append(tb.rstrip())
            out = out.replace(tb.rstrip("\n"), "[the traceback above]")
        parts.append(f"----- rank {r} output (last {TAIL_LINES} lines) -----\n{_tail(out, TAIL_LINES)}")
    for r in timed_out:  # the faulthandler dump at the end of the output shows where it hung
        parts.append(f"===== rank {r}: still running at the timeout =====")
        parts.append(f"----- rank {r} output (last {2 * TAIL_LINES} lines) -----\n{_tail(outputs[r], 2 * TAIL_LINES)}")
    for r in collateral:
        parts.append(f"----- rank {r} ({killed[r]}), output (last {TAIL_LINES // 2} lines) -----")
        parts.append(_tail(outputs[r], TAIL_LINES // 2))
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# the decorator


def world(
    n: int,
    *,
    timeout: float = 60.0,
    requires: Sequence[Requirement] = (),
    expect_exit: Mapping[int, int | None] | None = None,
) -> Callable[[F], F]:
    """Run the decorated test on ``n`` ranks (see the module doc).

    The test's fixtures and parameters are passed to every rank unchanged.
    ``requires`` names (see KNOWN_REQUIREMENTS) or callables returning a skip
    reason; unmet ones skip the test. ``expect_exit`` marks ranks that are
    meant to die (see run_world).
    """
    reqs: tuple[Requirement, ...] = (requires,) if isinstance(requires, str) else tuple(requires)
    for req in reqs:
        if isinstance(req, str) and req not in KNOWN_REQUIREMENTS:
            raise ValueError(f"unknown requirement {req!r}; known: {', '.join(KNOWN_REQUIREMENTS)}")

    def decorate(fn: F) -> F:
        @functools.wraps(fn)  # keeps the signature, so pytest still injects fixtures/params
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            reason = _skip_reason(reqs)
            if reason is not None:
                _pytest().skip(reason)
            job = launched()
            if job is None:
                run_world(fn, n, args, kwargs, timeout=timeout, expect_exit=expect_exit)
                return None
            size, r = job
            if size != n:
                _pytest().skip(f"needs {n} ranks; this launched job has {size}")
            if expect_exit:
                _pytest().skip("expect_exit needs the forking harness, not an external launcher")
            _export_launcher_env(size, r)
            return _run_in_process(fn, args, kwargs, timeout * _timeout_scale())

        wrapper.world_size = n  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
