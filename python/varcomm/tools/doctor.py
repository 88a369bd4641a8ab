"""`varcomm-doctor`: what this machine offers varcomm, as plain text to paste into a bug report.

Works without the C extension (reports why it is missing) and without torch;
every probe degrades to "not found" rather than failing. Secrets (a variable
or option whose name says key, secret, token, password) are never printed,
only whether they are set. `--selftest` runs two processes per built
transport and times one message each way; a rank that fails is reported with
its own exception, as soon as it fails. A VARCOMM_* variable with a value its
option does not accept is a FAIL line, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import bootstrap
from .. import options as _options

_SECRET = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def _run(argv: list[str], timeout: float = 30) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _build() -> tuple[dict[str, Any] | None, ModuleType | None, str]:
    try:
        from .. import _C
    except Exception as e:  # any import failure is worth reporting
        return None, None, f"C extension not importable ({type(e).__name__}: {e})"
    info = dict(getattr(_C, "build_info", {}) or {})
    return info, _C, ""


def _libfabric(C: ModuleType | None, build: dict[str, Any] | None,
               opts: _options.Options) -> tuple[list[str], list[str]]:
    """(report lines, provider names found)."""
    lines: list[str] = []
    if C is not None and build and "rdma" in build.get("transports", ()) and hasattr(C, "rdma_info"):
        try:
            text = C.rdma_info(opts.placed(1).core(-1))
            lines += text.rstrip().splitlines()
        except Exception as e:
            lines.append(f"rdma_info() failed: {e}")
    else:
        name = ctypes.util.find_library("fabric") or "libfabric.so.1"
        try:
            lib = ctypes.CDLL(name)
            lib.fi_version.restype = ctypes.c_uint32
            v = lib.fi_version()
            lines.append(f"libfabric {v >> 16}.{v & 0xFFFF} ({name})")
        except OSError:
            lines.append("libfabric: not found (Debian: apt-get install libfabric-dev libfabric-bin)")
    listing = _run(["fi_info", "-l"])
    provs = [ln.strip().rstrip(":") for ln in (listing or "").splitlines() if ln.strip().endswith(":")]
    if listing is None:
        lines.append("fi_info -l: " + ("failed or timed out" if shutil.which("fi_info")
                                       else "fi_info not found (libfabric-bin)"))
    else:
        lines.append("fi_info -l: " + (", ".join(provs) or "no providers"))
    return lines, provs


def _rdma_provider_choice(fab: list[str], want: str, C: ModuleType | None) -> str:
    if want:
        return f"{want} (VARCOMM_FI_PROVIDER)"
    for ln in fab:  # the extension's own answer, when it has rdma
        if ln.strip().startswith("default provider:"):
            return ln.split(":", 1)[1].strip()
    if _run(["fi_info", "-l"]) is None:
        return "unknown (no fi_info to ask)"
    for p in getattr(C, "rdma_providers", ()):  # the rdma transport's own order
        # fi_info -p takes the layered name; -c FI_RMA keeps only domains that can do RMA writes.
        out = _run(["fi_info", "-p", p, "-t", "FI_EP_RDM", "-c", "FI_RMA"])
        if out and "provider:" in out:
            why = "no verbs/efa/cxi provider found" if p == "tcp;ofi_rxm" else "first RDMA provider found"
            return f"{p} ({why})"
    return "none usable (no RDM provider with FI_RMA)"


def _rdma_misfits(fab: list[str]) -> list[str]:
    """What the extension's own query (the one init makes) says of VARCOMM_FI_PROVIDER /
    VARCOMM_FI_IFACE: the self-test, and every rank's init, would fail on it."""
    return [ln.split("configured: unusable: ", 1)[1] + "; fix or unset it"
            for ln in fab if ln.strip().startswith("configured: unusable: ")]


def _rdma_devices() -> list[str]:
    lines: list[str] = []
    try:
        import pyverbs.device as d  # type: ignore[import-not-found]

        for dev in d.get_device_list():
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            lines.append(f"{name} (pyverbs)")
        if lines:
            return lines
    except Exception:  # pyverbs is optional
        pass
    for dev in sorted(glob.glob("/sys/class/infiniband/*")):
        ports = []
        for port in sorted(glob.glob(f"{dev}/ports/*")):
            state = _read(f"{port}/state").split(":")[-1].strip()
            layer = _read(f"{port}/link_layer")
            rate = _read(f"{port}/rate")
            ports.append(f"port {Path(port).name}: {state} {layer} {rate}".strip())
        lines.append(f"{Path(dev).name}: " + ("; ".join(ports) or "no ports"))
    return lines


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _cma() -> str:
    """What this host allows for shm's single-copy reads (process_vm_readv between
    same-user sibling ranks). Each pair probes it for itself at init; the
    --selftest route line says what it found."""
    scope = _read("/proc/sys/kernel/yama/ptrace_scope").strip()
    if scope in ("", "0"):
        return ("CMA allowed" + (" (no Yama ptrace_scope here)" if not scope else " (Yama ptrace_scope 0)") +
                ": messages over eager_max copied once with it where that beats two memcpys (option cma=auto "
                "measures it at init; route_info(peer)['cma_probe'] says what it found), and a collective's chunks "
                "from 128 KiB wherever it is allowed (or written by their sender into an output in the landing "
                "area)")
    return (f"Yama ptrace_scope {scope}: CMA between sibling ranks is refused, so messages over the bound stream "
            "through the slots (two copies); set /proc/sys/kernel/yama/ptrace_scope to 0 for single-copy reads")


def _cuda_devices() -> tuple[list[str], int]:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            lines = []
            for i in range(n):
                p = torch.cuda.get_device_properties(i)
                lines.append(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB "
                             f"(torch {torch.__version__})")
            return lines, n
    except Exception:  # torch is optional
        pass
    out = _run(["nvidia-smi", "-L"])
    if out:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        return [ln + " (nvidia-smi)" for ln in lines], len(lines)
    return [], 0


def shown(name: str, value: object) -> str:
    """value as the report shows it: a secret only says whether it is set. A
    misspelt variable whose nearest name is a secret's is one too
    (VARCOMM_JOB_KYE holds a key)."""
    near = _options.nearest_variable(name) if name.startswith("VARCOMM_") else None
    if _SECRET.search(name) or (near and _SECRET.search(near)):
        return "(set, not shown)" if value not in (None, "") else "(not set)"
    return str(value)


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed as a distribution
        return None


def _git(root: Path) -> str:
    """The checkout's commit when varcomm runs from one, else why not."""
    if not (root / ".git").exists():
        return "not a git checkout (installed package)"
    head = _run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], timeout=10)
    if head is None:
        return f"{root} is a checkout, but git could not read it"
    branch = (_run(["git", "-C", str(root), "rev-parse", "--abbrev-ref", "HEAD"], timeout=10) or "?").strip()
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], timeout=10)
    return f"{head.strip()} ({branch}{', uncommitted changes' if dirty else ''}) in {root}"


def _versions(fab: list[str]) -> list[str]:
    import varcomm

    pkg = Path(varcomm.__file__).resolve().parent
    dist = _dist_version("varcomm")
    lines = [f"varcomm {varcomm.__version__}" + (f" (distribution {dist})" if dist and dist != varcomm.__version__
                                                   else "") + f" at {pkg}",
             f"git: {_git(pkg.parents[1])}"]
    try:
        import torch

        cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU only"
        from varcomm import arrays

        lines.append(f"torch {torch.__version__}{cuda}; varcomm's torch adapter: {arrays.torch_hooks()}")
    except Exception as e:  # torch is optional
        lines.append(f"torch: not importable ({type(e).__name__})")
    try:
        import numpy

        lines.append(f"numpy {numpy.__version__}")
    except Exception as e:
        lines.append(f"numpy: not importable ({type(e).__name__})")
    # Not imported: cupy's import is slow and may touch the GPU.
    cupy = next((v for v in map(_dist_version, ("cupy-cuda12x", "cupy-cuda11x", "cupy")) if v), None)
    if cupy or importlib.util.find_spec("cupy") is not None:
        lines.append(f"cupy {cupy or '(version unknown)'}")
    else:
        lines.append("cupy: not installed (optional: pip install 'varcomm[cupy]')")
    lines.append(next((ln for ln in fab if ln.startswith("libfabric")), "libfabric: unknown"))
    return lines


def _launcher_names() -> list[str]:
    names: list[str] = []
    for la in bootstrap.LAUNCHERS:
        names += [n for n in (la.rank, la.world_size, la.local_rank, la.local_world_size) if n]
    names += [bootstrap.MASTER_ADDR_VAR, *bootstrap.SLURM_NODELIST_VARS, bootstrap.SLURM_LAUNCH_ADDR_VAR,
              bootstrap.MASTER_PORT_VAR, *bootstrap.JOB_ID_VARS, bootstrap.STEP_ID_VAR]
    return list(dict.fromkeys(names))


def _launcher(environ: dict[str, str] | None = None) -> list[str]:
    """The launcher variables set here, and what bootstrap makes of them."""
    env = dict(os.environ if environ is None else environ)
    known = _launcher_names()
    seen = [k for k in known if env.get(k)]
    seen += sorted(k for k in env if k.startswith(("OMPI_COMM_WORLD_", "PMI_", "PMIX_")) and k not in seen)
    slurm = sorted(k for k in env if k.startswith("SLURM_") and k not in seen)
    lines = [f"{k}={shown(k, env[k])}" for k in seen]
    if slurm:
        lines.append(f"(and {len(slurm)} other SLURM_* variables)")
    if not seen:
        lines.append("none (a single process: varcomm.init() is world size 1 unless given rank and world_size)")
    try:
        p = bootstrap.placement(None, None, have_store=True)
        lines.append(f"=> rank {p.rank} of {p.world_size}, local rank {p.local_rank} of {p.local_world_size}")
    except Exception as e:  # a bad launcher variable is what the report is for
        lines.append(f"=> cannot place this process: {e}")
    return lines


def _checked_options() -> tuple[_options.Options, dict[str, str]]:
    """(the options, {variable: what is wrong with it}) for this environment.
    Bad variables are left at their defaults, so the rest of the report is
    still about what this environment sets."""
    import warnings

    try:
        with warnings.catch_warnings():  # (a misspelt name: the environment section says it, with the near one)
            warnings.simplefilter("ignore")
            return _options.resolve_valid(), {}
    except _options.InvalidEnvironment as e:
        return e.options, e.problems


def _effective_options(opts: _options.Options, problems: dict[str, str]) -> list[str]:
    env = _options.environment()
    lines = [f"FAIL  {text}; or unset it (shown below at its default)" for text in problems.values()]
    for name, spec in _options.Options.specs().items():
        if spec.env in problems:
            origin = f"default: {spec.env} is invalid"
        else:
            origin = spec.env if env.get(spec.env, "").strip() else "default"
        value = getattr(opts, name)
        # None is "decided at init" for most: say by what, as the README does.
        text = spec.default_doc.replace("`", "") if value is None and not spec.none_is_value else shown(name, value)
        lines.append(f"{name:18} {text!s:24} ({origin})")
    return lines


# ---------------------------------------------------------------------------
# --selftest: two processes per transport, one timed message each way

_SELFTEST_BYTES = 8192


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def selftest_child(transport: str) -> int:
    """One rank of the self-test (run by selftest with RANK/WORLD_SIZE set):
    rank 0 sends a message, rank 1 sends it back; rank 0 prints a JSON line.

    A rank that fails prints {"error": ..., "at": ...} at once, before it
    closes: close waits for the peers (up to 30 s), and a peer left waiting
    fails in turn with an error of its own (a timeout, PeerFailure). "at"
    (CLOCK_MONOTONIC, one clock for the host) tells the parent which came first."""
    reported = False

    def report(e: BaseException) -> None:
        nonlocal reported
        if not reported:
            reported = True
            traceback.print_exc()
            print(json.dumps({"error": _one_line(e), "at": time.monotonic()}), flush=True)

    try:
        import numpy as np

        import varcomm

        t0 = time.perf_counter()
        comm = varcomm.init(transport=transport, bound=1 << 16, slots=2, timeout=30, array="numpy")
        try:
            setup = time.perf_counter() - t0
            peer = 1 - comm.rank
            msg = np.arange(_SELFTEST_BYTES // 8, dtype=np.int64)
            if comm.rank == 0:
                t1 = time.perf_counter()
                comm.send(msg, peer)
                back = comm.recv(peer)
                rtt = time.perf_counter() - t1
                ok = isinstance(back, np.ndarray) and np.array_equal(back, msg)
                route = comm.describe_transport(peer).split("; GPU tensors")[0]
                print(json.dumps({"ok": bool(ok), "rtt": rtt, "setup": setup, "route": route,
                                  "error": "" if ok else "the message came back changed"}), flush=True)
            else:
                comm.send(comm.recv(peer), peer)
        except Exception as e:
            report(e)
            raise
        finally:
            comm.close()
    except Exception as e:
        report(e)
        return 1
    return 0


def _selftest_env(transport: str, rank: int, port: int) -> dict[str, str]:
    # This process's environment, less every launcher's variables: the children are a job of their own.
    env = dict(os.environ)
    for k in [k for k in env if k in _launcher_names() or k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))]:
        del env[k]
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VARCOMM_TRANSPORT=transport)
    if transport == "rdma":
        env["VARCOMM_FI_PROVIDER"] = "tcp;ofi_rxm"  # present wherever libfabric is; NIC providers need a NIC
    import varcomm

    root = str(Path(varcomm.__file__).resolve().parents[1])  # this varcomm, installed or not
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


#: After the first rank fails, how long the others get to report their own
#: errors (which may have come first) before they are killed.
_SETTLE_S = 0.5


def _read_lines(stream: Any, into: list[str]) -> None:
    for line in iter(stream.readline, ""):
        into.append(line.rstrip("\n"))
    stream.close()


def _errors(stdout: list[str]) -> list[dict[str, Any]]:
    found = []
    for ln in stdout:
        if ln.startswith("{"):
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            if isinstance(d, dict) and "at" in d:
                found.append(d)
    return found


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_text(code: int, stderr: list[str]) -> str:
    last = next((ln.strip() for ln in reversed(stderr) if ln.strip()), "")
    how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit {code}"
    return f"{last} ({how})" if last else f"ended without a result ({how})"


def selftest_one(transport: str, timeout: float = 60) -> tuple[bool, str]:
    """(passed, the report line's text) for one transport.

    The first rank to fail is reported with its own error, as soon as it
    fails: the other rank is then stuck waiting for it, and its timeout (or
    PeerFailure) would only hide the cause."""
    port = _free_port()
    argv = [sys.executable, "-m", "varcomm.tools.doctor", "--selftest-child", transport]
    procs = [subprocess.Popen(argv, env=_selftest_env(transport, r, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs: list[tuple[list[str], list[str]]] = [([], []) for _ in procs]
    readers = [threading.Thread(target=_read_lines, args=(stream, lines), daemon=True)
               for p, out in zip(procs, outs) for stream, lines in ((p.stdout, out[0]), (p.stderr, out[1]))]
    for t in readers:
        t.start()
    ended: dict[int, float] = {}  # rank -> when it was seen to exit (on its own)
    first_failure: float | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(ended) < len(procs):
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = now
            if first_failure is None and (any(procs[r].returncode for r in ended)
                                          or any(_errors(out[0]) for out in outs)):
                first_failure = now
            if (first_failure is not None and now - first_failure >= _SETTLE_S) or now >= deadline:
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in readers:
            t.join(timeout=5)

    failures: list[tuple[float, int, str]] = []
    for r, (stdout, stderr) in enumerate(outs):
        errors = _errors(stdout)
        if errors:
            failures.append((float(errors[0]["at"]), r, str(errors[0]["error"])))
        elif r in ended and procs[r].returncode:
            failures.append((ended[r], r, _exit_text(procs[r].returncode, stderr)))
    if failures:
        _, r, text = min(failures)
        others = sorted(q for _, q, _ in failures if q != r)
        then = f" (then rank {', '.join(map(str, others))} failed too)" if others else ""
        return False, f"FAIL  rank {r}: {text}{then}"
    if len(ended) < len(procs):
        hung = [r for r in range(len(procs)) if r not in ended]
        return False, (f"FAIL  no answer within {timeout:.0f} s: rank {', '.join(map(str, hung))} still "
                       "running, and no rank reported an error (a hang)")
    result = next((json.loads(ln) for ln in outs[0][0] if ln.startswith("{")), None)
    if result is None:
        return False, f"FAIL  rank 0: {_exit_text(procs[0].returncode, outs[0][1])}"
    if not result["ok"]:
        return False, f"FAIL  {result['error']}"
    return True, (f"pass  {result['rtt'] * 1e6:.0f} us for {_SELFTEST_BYTES // 1024} KiB there and back "
                  f"(set-up {result['setup']:.2f} s; {result['route']}; one cold message: varcomm-bench p2p "
                  "measures speed)")


def selftest(transports: list[str]) -> tuple[bool, list[str]]:
    lines, ok = [], True
    for t in ("shm", "rdma", "fallback"):
        if t not in transports:
            lines.append(f"{t:9} not built")
            continue
        passed, text = selftest_one(t)
        ok &= passed
        lines.append(f"{t + (' (tcp;ofi_rxm)' if t == 'rdma' else ''):22} {text}")
    if "nvlink" in transports:
        lines.append(f"{'nvlink':22} not checked here (GPU to GPU: bash bench/gpu_check.sh)")
    return ok, lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="varcomm-doctor",
        description="What this machine offers varcomm: versions, git commit, build, libfabric, RDMA and CUDA "
                    "devices, launcher variables, effective options and the transport each peer class gets. "
                    "Plain text, paste-ready for a bug report (secrets are never printed).")
    p.add_argument("--selftest", action="store_true",
                   help="also run 2 local processes per built transport (shm, rdma over tcp;ofi_rxm, fallback) "
                        "and time one message each; exit status 1 when one fails")
    p.add_argument("--selftest-child", metavar="TRANSPORT", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.selftest_child:
        return selftest_child(args.selftest_child)
    out: list[str] = []
    w = out.append
    w("varcomm doctor")
    w(f"host: {socket.gethostname()}  {platform.platform()}  python {platform.python_version()}  cpus {os.cpu_count()}")
    build, C, why = _build()
    opts, problems = _checked_options()
    fab, _ = _libfabric(C, build, opts)
    transports = set(build.get("transports", ())) if build else set()
    misfits: list[str] = []  # (VARCOMM_FI_PROVIDER / VARCOMM_FI_IFACE that libfabric here cannot give)

    w("")
    w("versions:")
    out += ["  " + ln for ln in _versions(fab)]
    if build is None:
        w(f"  build: {why}")
    else:
        w("  build: " + ", ".join(f"{k}={v}" for k, v in sorted(build.items())))

    w("")
    w("libfabric:")
    out += ["  " + ln for ln in fab]

    w("")
    w("RDMA devices:")
    devs = _rdma_devices()
    out += ["  " + d for d in devs] or ["  none (no /sys/class/infiniband entries; tcp;ofi_rxm still works)"]

    w("")
    w("CUDA devices:")
    gpus, ngpu = _cuda_devices()
    out += ["  " + g for g in gpus] or ["  none (no torch.cuda devices, no nvidia-smi)"]

    w("")
    w("launcher:")
    out += ["  " + ln for ln in _launcher()]

    env = _options.environment()
    known = _options.known_variables()
    if env:
        w("")
        w("environment:")
        out += [f"  {k}={shown(k, v)}" + ("" if k in known or not k.startswith("VARCOMM_")
                                          or k.startswith("VARCOMM_BENCH_")
                                          else "  (not a varcomm variable: "
                                          + (f"did you mean {near}" if (near := _options.nearest_variable(k))
                                             else "misspelt") + "?)")
                for k, v in env.items()]

    w("")
    w("effective options (varcomm.Options: keyword > VARCOMM_* > default):")
    out += ["  " + ln for ln in _effective_options(opts, problems)]

    w("")
    w("transport per peer class:")
    forced = opts.transport
    fallback = ("fallback: varcomm's slot writes carried by torch.distributed gloo (transport/fallback; "
                "GPU tensors staged through host memory)")
    if forced == "fallback":
        w(f"  every pair: {fallback} (VARCOMM_TRANSPORT=fallback)")
    else:
        shm = f"shm (mapped host memory; {_cma()})" if build is not None else f"unknown: {why}"
        if forced == "rdma":
            shm = "rdma (VARCOMM_TRANSPORT=rdma forces it on the same host too)"
        w(f"  same host, host memory:  {shm}")
        if "nvlink" in transports:
            gpu = "nvlink (CUDA IPC, stream-ordered)" + ("" if ngpu >= 2 else f"; {ngpu or 'no'} GPU visible here")
        else:
            gpu = "no device transport in this build (no CUDA): CUDA tensors are staged through host memory"
        w(f"  same host, GPU memory:   {gpu}")
        if "rdma" in transports:
            remote = "rdma, provider " + _rdma_provider_choice(fab, opts.rdma_provider, C)
            misfits = _rdma_misfits(fab)
            if misfits:
                remote += "".join(f"\nFAIL  {text}" for text in misfits)
        elif build is None:
            remote = f"unknown: {why}"
        else:
            remote = ("the fallback: this build has no rdma (pkg-config found no libfabric at build time, "
                      "or VARCOMM_NO_RDMA was set)")
        w(f"  other host:              {remote}")
        if "rdma-gpu" in transports:
            w("  other host, GPU memory:  rdma-gpu (in VARCOMM_RDMA_CHUNK chunks, stream-ordered, one progress "
              "thread: GPUDirect RDMA per the FI_HMEM line above and VARCOMM_RDMA_HMEM, else staged through "
              "pinned memory)")
        elif "rdma" in transports:
            w("  other host, GPU memory:  staged through host memory (this build has no CUDA support)")
        w(f"  nothing fits:            {fallback}")
        w("  (VARCOMM_TRANSPORT=shm|rdma|fallback forces one; rdma: VARCOMM_FI_PROVIDER, VARCOMM_FI_IFACE)")
    rc = 1 if problems or misfits else 0
    if args.selftest:
        print("\n".join(out), flush=True)  # the self-test takes seconds: show the rest first
        out = ["", "selftest (2 local processes per transport, one 8 KiB message there and back):"]
        if build is None:
            out.append(f"  not run: {why}")
            rc = 1
        elif problems:
            # Every rank would refuse the same values at init: fix them first.
            out.append(f"  not run: {', '.join(problems)} invalid (FAIL above); fix or unset, then rerun")
        else:
            ok, lines = selftest(sorted(transports))
            out += ["  " + ln for ln in lines]
            rc = 0 if ok else 1
    print("\n".join(out))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
