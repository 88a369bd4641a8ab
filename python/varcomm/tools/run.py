"""``varcomm-run``: a small MPI-style launcher for N local ranks.

Usage::

    python -m varcomm.run -n N [--timeout S] [--tag-output] [--master-port P] [--oversubscribe] PROGRAM [ARGS...]
    python -m varcomm.run -n N [options] -m MODULE [ARGS...]

Each rank is a child process with a torchrun-compatible environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT)
plus ``VARCOMM_LAUNCHER=1``, so ``varcomm.init()`` (and torch.distributed's
``env://``) work unchanged under this launcher, torchrun or mpirun.

The job is all-or-nothing, like mpirun: as soon as one rank fails (non-zero
exit or signal) or ``--timeout`` passes, the remaining ranks are stopped
(SIGTERM to their process groups, SIGKILL ~3 s later) so a failure never turns
into a hang waiting on a dead peer. A failing rank's goodbye often ends its
peers first (PeerFailure), so the others get a moment (SETTLE_S) to end on
their own, and a rank that met a peer's failure before it failed says so
(``mark_peer_failures``): the report names the rank that failed first, and
the job exits with its code. SIGINT, SIGTERM and SIGHUP (a closed
terminal) sent to the launcher are forwarded to the ranks (SIGKILL ~3 s later),
and the launcher exits with 128 + the signal. On Linux the ranks also die if the
launcher itself is killed (SIGKILL, OOM killer): each rank asks the kernel for
SIGKILL when its parent dies (``PR_SET_PDEATHSIG``).

This module only uses the standard library: it must be importable without the
varcomm C extension.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from ..bootstrap import AGENT_STORE_VAR
from ..options import Options, ToolOptions, env_name, env_value, resolve_valid, unknown_variables

__all__ = ["main", "launch", "rank_env", "free_port"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks.
KILL_GRACE_S = 3.0
#: Exit code used when ``--timeout`` expires (same as coreutils ``timeout``).
TIMEOUT_EXIT = 124
#: Seconds the other ranks get to end on their own after the first failure
#: (the rank that failed first is often still exiting: its goodbye ended a peer).
SETTLE_S = 1.0

_PREFIX = "varcomm-run: "
#: Signals to the launcher that stop the job (forwarded to the ranks).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Launcher options that take a separate value; needed to find where PROGRAM starts.
_VALUE_OPTS = frozenset({"-n", "-np", "--np", "--nproc", "--timeout", "--master-port"})


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free right now (the OS picks it, so parallel jobs rarely collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(
    rank: int,
    world_size: int,
    master_port: int,
    master_addr: str = "127.0.0.1",
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of one local rank, torchrun-compatible (single node: local rank == rank)."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    # Inherited from a torchrun that started us: it says torchrun's agent hosts
    # the store, and none does for our ranks.
    env.pop(AGENT_STORE_VAR, None)
    if world_size > 1:
        # As torchrun does: N ranks each running a full OpenMP pool would
        # oversubscribe the cores and starve the peer a rank waits for.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} killed by signal {_signal_name(-code)}"
    return f"rank {rank} exited with code {code}"


_marking = False


def mark_peer_failures() -> None:
    """In a rank of varcomm-run (varcomm.init calls it, first thing): the
    first PeerFailure this process makes before it begins to exit (its
    program may catch it and exit as it likes) is noted in the launcher's
    file for this rank, so that the launcher does not take this rank for the
    one that failed first. Once per process."""
    global _marking
    from .. import errors

    path = env_value(ToolOptions, "launcher_status")  # this rank's note: <the launcher's folder>/<rank>
    if _marking or not path:
        return
    _marking = True
    # The rank's own note: a process it starts (a data loader, a tool) is no
    # rank, and its PeerFailures must not speak for this one.
    os.environ.pop(env_name(ToolOptions, "launcher_status"), None)
    exiting: list[bool] = []

    def met() -> None:
        # A failing rank's own exit (its close() after its error) may meet the
        # peers it ended: only what comes before its exit counts.
        if exiting:
            return
        errors._on_peer_failure = None  # the first one says it: the file's being there
        try:
            open(path, "w").close()
        except OSError:
            pass  # the launcher then goes by time

    errors._on_peer_failure = met
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        exiting.append(True)
        previous(kind, exc, tb)

    sys.excepthook = hook
    atexit.register(exiting.append, True)


def _peer_marks(folder: str) -> set[int]:
    """The ranks that noted a peer's failure (mark_peer_failures)."""
    try:
        return {int(name) for name in os.listdir(folder) if name.isdigit()}
    except OSError:
        return set()


def _exit_code(code: int) -> int:
    """Shell convention: a child killed by signal S makes us exit with 128+S."""
    return 128 - code if code < 0 else code


def _signal_group(pid: int, signum: int) -> None:
    """Signal a rank's whole process group (it is the group leader), so grandchildren die too."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _exit_status(pid: int) -> int | None:
    """Exit code of child ``pid`` (-S if killed by signal S), or None while it runs; does not reap it.

    Leaving the child unreaped (a zombie) keeps its pid, and so its
    process-group id, reserved: we can still kill leftover grandchildren in
    that group later without risking hitting an unrelated, reused pid.
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -signal.SIGKILL  # already reaped by someone else: unknown, treat as killed
    if info is None or info.si_pid != pid:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the rank get SIGKILL when the launcher dies, or
    None where the kernel has no such request (not Linux).

    A SIGKILLed launcher cannot stop its ranks, and a closed terminal's SIGHUP
    does not reach them (they run in their own sessions): without this they
    run on as orphans, typically hanging on a peer that is gone. prctl is
    looked up here, in the parent: the child between fork and exec must not
    load libraries (another thread may hold the loader's lock at fork time)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The launcher may have died between fork and prctl: the request then
        # never fires (the child already has a new parent), so check by hand.
        if os.getppid() != launcher:
            os._exit(128 + signal.SIGKILL)

    return preexec


#: A line longer than this is forwarded in pieces of it, each prefixed (a
#: rank's unbounded line, or a progress bar redrawn with \r, stays bounded).
PUMP_PIECE = 64 * 1024


def _pump(src: IO[bytes], dst: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Forward ``src`` to ``dst`` line by line with ``prefix`` (one thread per
    child pipe): what a read returns, its whole lines in one write, so lines
    of ranks never mix and a flood of output costs one flush per read."""
    binary = getattr(dst, "buffer", None)
    tag = prefix.encode()
    fd = src.fileno()
    partial = b""
    try:
        while True:
            data = os.read(fd, PUMP_PIECE)
            if not data:
                break
            partial += data
            lines, sep, partial = partial.rpartition(b"\n")
            out = [tag + ln + b"\n" for ln in lines.split(b"\n")] if sep else []
            while len(partial) >= PUMP_PIECE:
                out.append(tag + partial[:PUMP_PIECE] + b"\n")
                partial = partial[PUMP_PIECE:]
            if out:
                _write(dst, binary, b"".join(out), lock)
        if partial:
            _write(dst, binary, tag + partial + b"\n", lock)
    except (OSError, ValueError):
        pass
    finally:
        src.close()


def _write(dst: IO[str], binary: IO[bytes] | None, data: bytes, lock: threading.Lock) -> None:
    with lock:
        if binary is not None:
            dst.flush()
            binary.write(data)
            binary.flush()
        else:
            dst.write(data.decode(errors="replace"))
            dst.flush()


def _command(program: Sequence[str]) -> list[str]:
    if program[0] == "-m":
        if len(program) < 2:
            raise SystemExit(f"{_PREFIX}-m needs a module name")
        return [sys.executable, *program]
    if program[0].endswith(".py"):
        return [sys.executable, *program]
    if re.fullmatch(r"python(3(\.\d+)?)?", program[0]):
        # A bare `python` is the launcher's own interpreter (whose environment
        # has varcomm), not whichever one PATH finds first: outside an activated
        # venv that one lacked torch and every rank failed to import it.
        return [sys.executable, *program[1:]]
    return list(program)


def launch(
    command: Sequence[str],
    nprocs: int,
    *,
    timeout: float | None = None,
    tag_output: bool = False,
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
) -> int:
    """Run ``command`` as ``nprocs`` ranks; return the job's exit code (see module doc)."""
    port = master_port or free_port(master_addr)
    # One seed for the whole job, so varcomm.testing.seeded() agrees across ranks.
    given = ToolOptions.resolve().test_seed
    seed = str(given if given is not None else random.SystemRandom().randrange(2**32))
    # One secret per job, in the ranks' environment only (/proc/<pid>/environ
    # is readable by its owner alone): a process outside the job cannot plant
    # set-up records or forge messages. A key the user set is kept.
    key_var = env_name(Options, "job_key")
    job_key = env_value(Options, "job_key") or secrets.token_hex(16)
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    codes: dict[int, int] = {}
    own_failures: list[int] = []  # ranks that failed on their own, in order seen
    left: list[int] = []  # ranks that ended with 0 before the launcher stopped any, in order seen
    stop_at: float | None = None  # when we began stopping ranks
    failed_at: float | None = None  # the first failure: the others may still end on their own until SETTLE_S after
    status = tempfile.mkdtemp(prefix="varcomm-run-")  # mark_peer_failures' notes
    killed = False
    timed_out: list[int] = []
    interrupted: list[int] = []

    # PR_SET_PDEATHSIG fires when the *thread* that started the rank ends, not
    # the process: fine here, as this thread waits for every rank below.
    preexec = _die_with_parent()

    def stop_all(signum: int) -> None:
        for r, p in enumerate(procs):
            if r not in codes:
                _signal_group(p.pid, signum)

    def on_signal(signum: int, _frame: object) -> None:
        # Ranks run in their own sessions, so a terminal's Ctrl-C doesn't reach them: forward it.
        # A second signal means "really stop now".
        stop_all(signal.SIGKILL if interrupted else signum)
        interrupted.append(signum)

    old_handlers: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            old_handlers[sig] = signal.signal(sig, on_signal)
    try:
        for r in range(nprocs):
            if interrupted:  # (a stop signal during start-up: start no more)
                break
            env = rank_env(r, nprocs, port, master_addr)
            env[env_name(ToolOptions, "launcher")] = "1"
            env[env_name(ToolOptions, "launcher_warned")] = ",".join(unknown_variables(env))  # (said once, here)
            env[env_name(ToolOptions, "test_seed")] = seed
            env[env_name(ToolOptions, "launcher_status")] = os.path.join(status, str(r))
            env[key_var] = job_key
            if tag_output:
                env.setdefault("PYTHONUNBUFFERED", "1")  # pipes are block-buffered otherwise
            pipe = subprocess.PIPE if tag_output else None
            try:
                p = subprocess.Popen(
                    list(command),
                    env=env,
                    stdin=None if r == 0 else subprocess.DEVNULL,  # like mpirun: stdin goes to rank 0
                    stdout=pipe,
                    stderr=pipe,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            except OSError as e:
                print(f"{_PREFIX}cannot start {command[0]!r}: {e}", file=sys.stderr)
                return 127  # the finally block kills and reaps the ranks already started
            procs.append(p)
            if tag_output:
                assert p.stdout is not None and p.stderr is not None
                for src, dst in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                    t = threading.Thread(target=_pump, args=(src, dst, f"[{r}] ", lock), daemon=True)
                    t.start()
                    pumps.append(t)

        deadline = time.monotonic() + timeout if timeout else None
        while len(codes) < len(procs):
            for r, p in enumerate(procs):
                code = _exit_status(p.pid) if r not in codes else None
                if code is not None:
                    codes[r] = code
                    # A rank that ends after the launcher got a stop signal was
                    # most likely ended by it: the job's status is the signal's.
                    if code != 0 and stop_at is None and not interrupted:
                        own_failures.append(r)
                    elif code == 0 and stop_at is None:  # (its exit may come after the failures it caused)
                        left.append(r)
            if len(codes) == len(procs):
                break
            now = time.monotonic()
            if own_failures and failed_at is None:
                failed_at = now
            if stop_at is None and interrupted:
                stop_at = now  # the signal was already forwarded; SIGKILL follows after the grace period
            elif stop_at is None and failed_at is not None and now - failed_at >= SETTLE_S:
                stop_at = now
                stop_all(signal.SIGTERM)
            elif stop_at is None and deadline is not None and now >= deadline:
                timed_out = [r for r in range(len(procs)) if r not in codes]
                stop_at = now
                stop_all(signal.SIGTERM)
            elif stop_at is not None and not killed and now - stop_at >= KILL_GRACE_S:
                killed = True
                stop_all(signal.SIGKILL)
            time.sleep(0.02)
    finally:
        # Ranks are still unreaped here. On failure, kill whatever is left in their
        # process groups (stray grandchildren) while the group ids are still ours.
        if own_failures or stop_at is not None or len(codes) < len(procs):
            for p in procs:
                _signal_group(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        join_until = time.monotonic() + 2.0  # a surviving grandchild may hold a pipe open
        for t in pumps:
            t.join(timeout=max(0.0, join_until - time.monotonic()))
        marks = _peer_marks(status)
        shutil.rmtree(status, ignore_errors=True)

    # The rank that failed first: not one that says a peer's failure ended it.
    own_failures = [r for r in own_failures if r not in marks] + [r for r in own_failures if r in marks]
    left = [r for r in left if r not in marks]  # (one that caught a peer's failure and ended with 0 is no cause)
    return _report(codes, own_failures, timed_out, interrupted, timeout, marks, left)


def _report(
    codes: Mapping[int, int],
    own_failures: Sequence[int],
    timed_out: Sequence[int],
    interrupted: Sequence[int],
    timeout: float | None,
    marks: set[int] | None = None,
    left: Sequence[int] = (),
) -> int:
    """Print one line per failure to stderr and return the job's exit code
    (marks: the ranks that met a peer's failure before they failed; left:
    the ranks that ended with 0 before the launcher stopped any)."""
    marks = marks or set()
    lines: list[str] = []
    result = 0
    if timed_out and not own_failures:
        ranks = ",".join(map(str, timed_out))
        lines.append(f"timeout after {timeout:g} s: rank{'s' if len(timed_out) > 1 else ''} {ranks} still running")
        result = TIMEOUT_EXIT
    if own_failures and own_failures[0] in marks and left:
        # Every failure was a peer's: the likely cause is a rank that ended
        # (with 0) while the others still needed it.
        lines.append(f"rank{'s' if len(left) > 1 else ''} {','.join(map(str, left))} exited with code 0 before "
                     f"the others were done (their PeerFailure names {'them' if len(left) > 1 else 'it'})")
    for i, r in enumerate(own_failures):
        after = " (after a peer's failure: PeerFailure)" if r in marks else ""
        lines.append(_describe(r, codes[r]) + after
                     + (" (first failure)" if i == 0 and len(own_failures) > 1 and r not in marks else ""))
    if own_failures:
        result = _exit_code(codes[own_failures[0]])
    stopped = [r for r, c in sorted(codes.items()) if c != 0 and r not in own_failures]
    if stopped and (own_failures or interrupted):
        why = "after the failure" if own_failures else "on signal"
        lines.append(f"stopped rank{'s' if len(stopped) > 1 else ''} {','.join(map(str, stopped))} {why}")
    if interrupted and result == 0:
        result = 128 + interrupted[0]
        lines.insert(0, f"interrupted by {_signal_name(interrupted[0])}")
    try:
        for line in lines:
            print(_PREFIX + line, file=sys.stderr)
        sys.stderr.flush()
    except OSError:
        pass  # after SIGHUP the terminal may be gone (EIO): the exit code still tells
    return result


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split launcher options from PROGRAM [ARGS]: the program starts at the first
    non-option, ``-m`` or after ``--``."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if a == "-m" or not a.startswith("-") or a == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if a in _VALUE_OPTS else 1
    return list(argv), []


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="varcomm-run",
        allow_abbrev=False,  # (_split_argv knows the full names only: `--time 5` took 5 for the program)
        usage="varcomm-run -n N [--timeout S] [--tag-output] [--master-port P] [--oversubscribe] "
              "(PROGRAM | -m MODULE) [ARGS...]",
        description="Start N local ranks of PROGRAM with torchrun-compatible environment variables. "
                    "A PROGRAM ending in .py, -m MODULE and a bare python/python3 run on this launcher's "
                    "interpreter (" + sys.executable + "); give a path to run another.",
    )
    p.add_argument("-n", "-np", "--np", "--nproc", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after S seconds (exit 124)")
    p.add_argument("--tag-output", action="store_true", help="prefix every output line with [rank]")
    p.add_argument("--master-port", type=int, default=None, help="MASTER_PORT (default: a free port)")
    p.add_argument("--oversubscribe", action="store_true",
                   help=f"allow more than {_MAX_PER_CORE} ranks per core (at least {_MAX_FLOOR} ranks always)")
    return p


# More ranks than this per core is refused without --oversubscribe (mpirun refuses
# any oversubscription by default): a typo of -n 5000 started 5000 processes.
_MAX_PER_CORE, _MAX_FLOOR = 16, 64


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``varcomm-run``); returns the exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    opts, program = _split_argv(args_in)
    parser = _parser()
    args = parser.parse_args(opts)
    if not program:
        parser.error("missing PROGRAM")
    if args.n < 1:
        parser.error("-n must be at least 1")
    cap = max(_MAX_FLOOR, _MAX_PER_CORE * (os.cpu_count() or 1))
    if args.n > cap and not args.oversubscribe:
        parser.error(f"-n {args.n} is more than {cap} ranks on {os.cpu_count()} cores; pass --oversubscribe if you "
                     "mean it")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        # 99999 reached torch's TCPStore, which failed rank 0 with a TypeError and told rank 1 another program owned it
        parser.error(f"--master-port must be a TCP port in 1..65535, not {args.master_port}")
    if args.timeout is not None and not args.timeout > 0:  # NaN too
        # -1 stopped the job at once ("timeout after -1 s"), 0 meant no timeout at all
        parser.error(f"--timeout must be a number of seconds > 0, not {args.timeout:g}")
    try:  # a bad VARCOMM_* value would fail every rank the same way: say so once, start none
        with warnings.catch_warnings(record=True) as seen:  # (an unknown name: the ranks warn too)
            warnings.simplefilter("always")
            resolve_valid()
    except ValueError as e:
        parser.error(str(e))
    for w in seen:
        print(f"varcomm-run: warning: {w.message}", file=sys.stderr)
    return launch(
        _command(program),
        args.n,
        timeout=args.timeout,
        tag_output=args.tag_output,
        master_port=args.master_port,
    )


if __name__ == "__main__":
    sys.exit(main())
