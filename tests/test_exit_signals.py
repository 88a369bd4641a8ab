"""No varcomm process carries a foreign library's signal handlers (issue 14,
"crash at exit"): libfabric links libpsm_infinipath/libinfinipath, whose
load-time constructors install SIGTERM/SIGSEGV/SIGBUS/SIGILL/SIGABRT handlers
that call exit() from the handler. A SIGTERM (torchrun, SLURM, timeout,
varcomm-run stopping survivors) must kill a rank with -15, also while it waits
in init for a peer that never comes and after rdma was used."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import varcomm
from varcomm.tools.run import free_port

PYTHONPATH = str(Path(varcomm.__file__).resolve().parents[1])
#: Signals whose handlers a foreign library installed (Python itself catches only SIGINT).
FOREIGN = (signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT)
#: SIGTERMs per scenario: 10 ranks waiting in init, 10 after init (20 in all; each rank imports torch).
TRIES = 10

RANK = textwrap.dedent("""
    import os, sys, time
    import varcomm
    import varcomm._C  # loaded before init's rendezvous (as varcomm.torch and build_info() do)

    def caught():
        line = next(l for l in open("/proc/self/status") if l.startswith("SigCgt:"))
        return int(line.split()[1], 16)

    print("imported", caught(), flush=True)
    comm = varcomm.init(init_timeout=120, transport=os.environ.get("T", "auto"))
    comm.barrier()
    print("ready", caught(), flush=True)
    time.sleep(120)
""")


def foreign_bits(mask: int) -> list[str]:
    return [s.name for s in FOREIGN if mask >> (s - 1) & 1]


def spawn(rank: int, world: int, port: int, transport: str = "auto") -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), T=transport)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_line(p: subprocess.Popen[str], word: str, timeout: float = 120) -> int:
    """The SigCgt mask the rank printed with `word`."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(word):
            return int(line.split()[1])
    p.kill()
    raise AssertionError(f"rank never printed {word!r}: rc {p.wait()}, stderr {p.communicate()[1][-2000:]}")


def terminate_all(procs: list[subprocess.Popen[str]]) -> list[int | None]:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    rcs: list[int | None] = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=20))
        except subprocess.TimeoutExpired:  # hung in a foreign handler
            p.kill()
            p.wait()
            rcs.append(None)
    return rcs


def test_import_loads_no_libfabric_and_no_handlers() -> None:
    code = ("import varcomm._C\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(int(next(l for l in open('/proc/self/status') if l.startswith('SigCgt:')).split()[1], 16))\n"
            "print('libfabric' in maps, 'infinipath' in maps)\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=PYTHONPATH),
                         capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    assert foreign_bits(int(out[0])) == [], out
    assert out[1] == "False False", "importing varcomm._C loaded libfabric / libinfinipath"


def listening(port: int) -> bool:
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def test_sigterm_while_waiting_in_init_for_a_peer_that_never_comes() -> None:
    # rank 0 of 2, alone: once its store listens, it waits in init's rendezvous for rank 1
    ports = [free_port() for _ in range(TRIES)]
    procs = [spawn(0, 2, port) for port in ports]
    for p in procs:
        assert foreign_bits(wait_line(p, "imported")) == []
    deadline = time.monotonic() + 120
    while not all(listening(port) for port in ports) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(listening(port) for port in ports), "ranks never reached init's rendezvous"
    time.sleep(0.5)
    assert all(p.poll() is None for p in procs)
    rcs = terminate_all(procs)
    assert rcs == [-signal.SIGTERM] * TRIES, f"exit codes after SIGTERM: {rcs}"


def test_sigterm_after_init() -> None:
    # TRIES ranks in jobs of 2, most of them on rdma (libfabric and its providers loaded by then)
    transports = ["rdma", "auto", "rdma"] if varcomm.build_info()["rdma"] else ["auto"]
    procs, names = [], []
    for j in range(TRIES // 2):
        port, t = free_port(), transports[j % len(transports)]
        procs += [spawn(0, 2, port, t), spawn(1, 2, port, t)]
        names += [t, t]
    for p, t in zip(procs, names):
        mask = wait_line(p, "ready")
        assert foreign_bits(mask) == [], f"after init ({t}) SigCgt={mask:#x}: foreign handlers installed"
    rcs = terminate_all(procs)
    assert rcs == [-signal.SIGTERM] * TRIES, f"exit codes after SIGTERM: {list(zip(names, rcs))}"


def test_ctrl_c_during_a_receive_is_a_keyboard_interrupt_even_when_the_peer_left_first(tmp_path: Path) -> None:
    """Ctrl-C reaches both ranks of a job (varcomm-run forwards SIGINT): rank 0
    sleeps and exits at once, saying goodbye; rank 1, blocked in recv, saw
    the goodbye and the signal in the same wait slice. The PeerFailure was
    raised over the pending KeyboardInterrupt, and the interpreter printed an
    object dump ("lost sys.stderr") instead of a traceback, exiting 1. Now
    the KeyboardInterrupt wins, as in any blocking Python call: a traceback
    that ends in KeyboardInterrupt, and the launcher's 130."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import time, varcomm
        comm = varcomm.init(timeout=None)  # (the receive waits in slices of 100 ms, without end)
        comm.barrier()
        print("ready", comm.rank, flush=True)
        if comm.rank == 0:
            time.sleep(60)
        else:
            comm.recv(0)
    """))
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-m", "varcomm.run", "-n", "2", str(prog)],
                             env=dict(os.environ, PYTHONPATH=PYTHONPATH), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        assert p.stdout is not None
        seen = ""
        deadline = time.monotonic() + 60
        while seen.count("ready") < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            seen += line
        time.sleep(3.0)  # rank 1 is in its recv, past its spinning (asleep in its wait slices)
        p.send_signal(signal.SIGINT)
        out = seen + p.stdout.read()
        p.wait(timeout=30)
        assert "object address" not in out and "lost sys.stderr" not in out and "PeerFailure" not in out, out
        assert out.count("KeyboardInterrupt") == 2, out  # (rank 0's and rank 1's)
        assert p.returncode == 130, out
