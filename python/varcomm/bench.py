"""varcomm-bench: varcomm measured against its baselines, all in one run.

    varcomm-bench p2p      [-b 8] [-e 64M] [-f 2] [--tests latency,unibw,bibw] [--window 8]
    varcomm-bench varlen   [--dist uniform|lognormal|file:PATH] [--messages 64]
    varcomm-bench alltoall [--routing uniform,zipf,all-to-one] [--hidden 1024]
    varcomm-bench all      (all three in one job)

    common: -n/--iters -w/--warmup -r/--repeats -c/--check --dtype --device cpu|cuda
            --transport auto|shm|rdma|fallback --baselines fallback,mpi4py,... --quick
            --json FILE --plot FILE.png --md FILE --save DIR --nranks N

Baselines (each skipped with a stated reason when missing): varcomm's fallback
(gloo, shape header + payload), mpi4py (in-process, when the job runs under
mpirun), raw libfabric (bench/fi_pingpong, p2p latency), single-thread memcpy,
device-to-device copy (--device cuda), and for alltoall the two-phase algorithm.

Started outside a launcher it relaunches itself on --nranks ranks (default 2):
under mpirun when mpi4py and mpirun are there (so the MPI baseline runs in the
same processes), else under python -m varcomm.run. Under varcomm-run, torchrun
or mpirun it uses their environment. Timing rules: see varcomm.bench_core.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .bench_core import BASELINES, LABELS, BenchError, fmt_bytes, log, parse_bytes

__all__ = ["main", "parse_bytes", "fmt_bytes"]

BENCHES = ("p2p", "varlen", "alltoall")
_LAUNCH_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
DTYPES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16", "fp16": "float16",
          "fp32": "float32"}
_OK_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64")

# Per subcommand (minbytes, maxbytes, stepfactor): full and --quick.
SIZES = {"p2p": ((8, 64 << 20, 2), (8, 8 << 20, 32)),
         "varlen": ((1 << 10, 16 << 20, 4), (4 << 10, 1 << 20, 16)),
         "alltoall": ((8 << 10, 8 << 20, 4), (16 << 10, 1 << 20, 8))}
# Options that --quick changes when they are not given.
QUICK = {"repeats": 3, "warmup": 1, "sample_ms": 3.0, "cal_iters": 2, "window": 4, "messages": 16,
         "fallback_maxbytes": 1 << 20}
FULL = {"repeats": 5, "warmup": 2, "sample_ms": 20.0, "cal_iters": 3, "window": 8, "messages": 64,
        "fallback_maxbytes": 4 << 20}
# Defaults of options a subcommand does not have (so every namespace has all).
OTHER = {"tests": "latency,unibw,bibw", "fi_provider": None, "fi_pingpong": None, "fi_timeout": 20.0,
         "dist": "lognormal", "sigma": 0.8, "slots": 8, "routing": "uniform", "hidden": 1024}


# ---- machine description ---------------------------------------------------------------

def _cmd_out(argv: list[str]) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine(ctx: Any = None) -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": platform.node(), "kernel": platform.release(), "arch": platform.machine(),
                            "python": platform.python_version(), "cores": os.cpu_count()}
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        info["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    for mod in ("numpy", "torch", "mpi4py", "matplotlib"):
        try:
            info[mod] = __import__(mod).__version__ if importlib.util.find_spec(mod) else None
        except Exception:  # noqa: BLE001
            info[mod] = None
    try:
        import varcomm

        info["varcomm"] = varcomm.__version__
        info["varcomm_build"] = varcomm.build_info()
    except Exception as e:  # noqa: BLE001 - informational only
        info["varcomm_build"] = f"unavailable: {e}"
    fi: dict[str, Any] = {}
    v = _cmd_out(["pkg-config", "--modversion", "libfabric"])
    if v:
        fi["version"] = v
    provs = _cmd_out(["fi_info", "-l"])
    if provs:
        fi["providers"] = [ln.rstrip(":") for ln in provs.splitlines() if ln.endswith(":")]
    if ctx is not None:
        if getattr(ctx, "fi_provider_used", None):
            fi["provider_used"] = getattr(ctx, "fi_seen_provider", None) or ctx.fi_provider_used
        if ctx.mpi is not None:
            info["mpi"] = ctx.mpi.Get_library_version().strip().splitlines()[0].rstrip("\x00").strip()
        try:
            info["transport"] = ctx.transport
        except AttributeError:
            pass
        if ctx.device.type == "cuda":
            info["gpu"] = ctx.torch.cuda.get_device_name(ctx.device)
    info["libfabric"] = fi
    return info


# ---- command line ------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (nccl-tests flags)")
    g.add_argument("-b", "--minbytes", type=parse_bytes, default=None, help="smallest size (default per subcommand)")
    g.add_argument("-e", "--maxbytes", type=parse_bytes, default=None, help="largest size (default per subcommand)")
    g.add_argument("-f", "--stepfactor", type=int, default=None, help="size multiplier (default per subcommand)")
    g.add_argument("-n", "--iters", type=int, default=0,
                   help="timed iterations per sample (default: calibrated, about --sample-ms per sample)")
    g.add_argument("-w", "--warmup", type=int, default=None, help="untimed iterations before each sample (2; quick 1)")
    g.add_argument("-r", "--repeats", type=int, default=None, help="samples per point, median reported (5; quick 3)")
    g.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                   help="verify every message of the warm-up iterations (sizes and bytes); #wrong counts them")
    g.add_argument("--sample-ms", type=float, default=None, help="calibrated sample length (20; quick 3)")
    g.add_argument("--min-iters", type=int, default=2, help="fewest calibrated iterations (default 2)")
    g.add_argument("--max-iters", type=int, default=20000, help="most calibrated iterations (default 20000)")
    g.add_argument("--cal-iters", type=int, default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("what to run")
    g.add_argument("--dtype", default="float32", help=f"element type: {', '.join(_OK_DTYPES)} (or float, half)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the buffers live (default cpu)")
    g.add_argument("--transport", choices=("auto", "shm", "rdma", "fallback"), default=None,
                   help="varcomm's transport (default: VARCOMM_TRANSPORT or auto)")
    g.add_argument("--baselines", default="all",
                   help=f"comma list of {','.join(BASELINES)}, 'all' or 'none' (default all)")
    g.add_argument("--quick", action="store_true", help="a few seconds per subcommand: fewer sizes and repeats")
    g.add_argument("--nranks", type=int, default=2, help="ranks to start when not under a launcher (default 2)")
    g.add_argument("--launcher", choices=("auto", "mpirun", "varcomm"), default="auto",
                   help="how to start the ranks when not under a launcher (auto: mpirun if mpi4py is there)")
    g.add_argument("--mpirun", default="mpirun", help="mpirun to use (default: on PATH)")
    g.add_argument("--mpirun-args", default="--bind-to none", help="extra mpirun options as one string")
    g.add_argument("--timeout", type=float, default=None, help="kill the relaunched job after S seconds (default 900)")
    g.add_argument("--op-timeout", type=float, default=120.0, help="timeout of one varcomm operation (default 120)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="every number, the options and the machine")
    g.add_argument("--plot", metavar="FILE.png", help="time and bandwidth against size, varcomm and baselines")
    g.add_argument("--md", metavar="FILE", help="the tables and the command as markdown")
    g.add_argument("--save", metavar="DIR", help="write DIR/<subcommand>-<date>.json and .md")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _p2p_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("p2p")
    g.add_argument("--tests", default="latency,unibw,bibw", help="comma list of latency, unibw, bibw (default all)")
    g.add_argument("--window", type=int, default=None, help="messages in flight for unibw/bibw (8; quick 4)")
    g.add_argument("--fallback-maxbytes", type=parse_bytes, default=None,
                   help="largest size for the fallback, ~0.5 ms per message (4M; quick 1M)")
    g.add_argument("--fi-provider", default=None,
                   help="libfabric provider of the raw baseline (default: varcomm's rdma provider, else shm)")
    g.add_argument("--fi-pingpong", default=None, help="path of fi_pingpong (default: built from bench/)")
    g.add_argument("--fi-timeout", type=float, default=20.0,
                   help="seconds for one fi_pingpong run; past it the baseline stops (default 20)")


def _varlen_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("varlen")
    g.add_argument("--dist", default="lognormal", help="uniform | lognormal | file:PATH (sizes, one per line)")
    g.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma (default 0.8)")
    g.add_argument("--messages", type=int, default=None, help="distinct sizes per point (64; quick 16)")
    g.add_argument("--slots", type=int, default=8, help="varcomm slots: messages in flight per stage (default 8)")


def _a2a_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("alltoall")
    g.add_argument("--routing", default="uniform", help="uniform | zipf | all-to-one, or a comma list")
    g.add_argument("--hidden", type=int, default=1024, help="elements per token row (default 1024)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="varcomm-bench", description="varcomm microbenchmarks against their baselines.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    helps = {"p2p": "two ranks: ping-pong latency, uni- and bidirectional bandwidth",
             "varlen": "pipeline stream of variable-size messages (receiver does not know sizes)",
             "alltoall": "all-to-all-v with uniform / zipf / all-to-one routing",
             "all": "p2p, varlen and alltoall in one job"}
    for name in ("p2p", "varlen", "alltoall", "all"):
        sp = sub.add_parser(name, help=helps[name], description=helps[name])
        _common(sp)
        if name in ("p2p", "all"):
            _p2p_opts(sp)
        if name in ("varlen", "all"):
            _varlen_opts(sp)
        if name in ("alltoall", "all"):
            _a2a_opts(sp)
    return p


def _finish_args(a: argparse.Namespace) -> argparse.Namespace:
    """Fill presets and defaults; validate what can be checked before launching."""
    for k, v in OTHER.items():
        if not hasattr(a, k):
            setattr(a, k, v)
    preset = QUICK if a.quick else FULL
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.dtype = DTYPES.get(a.dtype, a.dtype)
    if a.dtype not in _OK_DTYPES:
        raise BenchError(f"--dtype {a.dtype!r}: use one of {', '.join(_OK_DTYPES)}")
    if a.transport is None:
        a.transport = (os.environ.get("VARCOMM_TRANSPORT") or "auto").lower()
    names = [b.strip() for b in a.baselines.split(",") if b.strip()]
    if names in (["all"], []):
        names = list(BASELINES) if names == ["all"] else []
    if names == ["none"]:
        names = []
    alias = {"fi": "libfabric", "mpi": "mpi4py", "gloo": "fallback", "two_phase": "two-phase"}
    names = [alias.get(b, b) for b in names]
    bad = [b for b in names if b not in BASELINES]
    if bad:
        raise BenchError(f"--baselines: unknown {bad}; choose from {', '.join(BASELINES)}")
    a.baselines = names
    a.tests = [t.strip() for t in a.tests.split(",") if t.strip()] if isinstance(a.tests, str) else a.tests
    bad = [t for t in a.tests if t not in ("latency", "unibw", "bibw")]
    if bad:
        raise BenchError(f"--tests: unknown {bad}; choose from latency, unibw, bibw")
    for rt in a.routing.split(","):
        if rt.strip() and rt.strip() not in ("uniform", "zipf", "all-to-one"):
            raise BenchError(f"--routing {rt!r}: use uniform, zipf or all-to-one")
    if not (a.dist in ("uniform", "lognormal") or a.dist.startswith("file:")):
        raise BenchError(f"--dist {a.dist!r}: use uniform, lognormal or file:PATH")
    if a.dist.startswith("file:"):
        from .bench_varlen import read_sizes

        read_sizes(a.dist[5:])  # fail early, before starting ranks
    if a.window < 1 or a.repeats < 1 or a.messages < 1 or a.warmup < 0:
        raise BenchError("--window, --repeats and --messages must be >= 1, --warmup >= 0")
    if a.check:
        a.warmup = max(a.warmup, 1)  # -c verifies warm-up iterations
    a.benches = list(BENCHES) if a.cmd == "all" else [a.cmd]
    return a


def for_bench(a: argparse.Namespace, bench: str) -> argparse.Namespace:
    b = copy.copy(a)
    lo, hi, f = SIZES[bench][1 if a.quick else 0]
    b.minbytes = a.minbytes if a.minbytes is not None else lo
    b.maxbytes = a.maxbytes if a.maxbytes is not None else hi
    b.stepfactor = a.stepfactor if a.stepfactor is not None else f
    if b.maxbytes < b.minbytes:
        b.maxbytes = b.minbytes
    return b


def _check_device(a: argparse.Namespace) -> None:
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no usable GPU"
            raise BenchError(f"--device cuda: torch.cuda.is_available() is False ({why}, torch {torch.__version__});"
                             " run with --device cpu")


def _in_launcher() -> bool:
    return any(os.environ.get(k) not in (None, "") for k in _LAUNCH_VARS) and bool(
        os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
        or os.environ.get("SLURM_NTASKS"))


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``varcomm-bench``); returns 1 when -c found wrong data."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    a = _finish_args(_parser().parse_args(args_in))
    _check_device(a)
    if not _in_launcher():
        return _relaunch(args_in, a)
    return run_job(a)


# ---- the job -------------------------------------------------------------------------------

def run_job(a: argparse.Namespace) -> int:
    from . import bench_alltoall, bench_p2p, bench_report, bench_varlen
    from .bench_core import Ctx

    mods = {"p2p": bench_p2p, "varlen": bench_varlen, "alltoall": bench_alltoall}
    t0 = time.monotonic()
    try:
        load0 = list(os.getloadavg())
    except OSError:
        load0 = None
    ctx = Ctx(a)
    ctx.transport = None
    results: list[dict[str, Any]] = []
    try:
        if ctx.rank == 0 and not a.quiet:
            log(f"{a.cmd} on {ctx.world} ranks ({os.environ.get('VARCOMM_BENCH_LAUNCHER') or _launcher_name()}), "
                f"{a.dtype} on {a.device}, transport {a.transport}, baselines {','.join(a.baselines) or 'none'}")
        for bench in a.benches:
            ctx.a = for_bench(a, bench)
            results += mods[bench].run(ctx)
        info = machine(ctx) if ctx.rank == 0 else None
    finally:
        ctx.close()
    if ctx.rank != 0:
        return 0
    info["loadavg_start"] = load0
    try:
        info["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    doc = {"varcomm_bench": 2, "subcommand": a.cmd,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": os.environ.get("VARCOMM_BENCH_CMD") or shlex.join(getattr(sys, "orig_argv", sys.argv)),
           "launcher": os.environ.get("VARCOMM_BENCH_LAUNCHER") or _launcher_name(), "ranks": ctx.world,
           "elapsed_s": round(time.monotonic() - t0, 1), "machine": info,
           "options": {k: v for k, v in vars(a).items() if k not in ("func",)},
           "labels": dict(LABELS), "results": results}
    doc["wrong_total"] = bench_report.wrong_total(results)
    print(bench_report.text(doc), flush=True)
    _write(a, doc)
    if doc["wrong_total"]:
        log(f"FAILED: -c found {doc['wrong_total']} wrong messages/results (see #wrong)")
        return 1
    return 0


def _launcher_name() -> str:
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        return "mpirun"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    return os.environ.get("VARCOMM_LAUNCHER") or "launcher"


def _write(a: argparse.Namespace, doc: dict[str, Any]) -> None:
    from . import bench_report

    paths: list[tuple[Path, str]] = []
    if a.save:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        d = Path(a.save)
        paths += [(d / f"{a.cmd}-{stamp}.json", "json"), (d / f"{a.cmd}-{stamp}.md", "md")]
    if a.json:
        paths.append((Path(a.json), "json"))
    if a.md:
        paths.append((Path(a.md), "md"))
    for p, kind in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1, default=str) + "\n" if kind == "json" else bench_report.markdown(doc))
        log(f"wrote {p}")
    if a.plot:
        try:
            Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
            bench_report.plot(doc, a.plot)
            log(f"wrote {a.plot}")
        except ImportError:
            log("--plot: matplotlib is not installed (pip install matplotlib): no plot written")
        except RuntimeError as e:
            log(f"--plot: {e}")


# ---- relaunch ------------------------------------------------------------------------------

def _mpi_choice(a: argparse.Namespace) -> str | None:
    """None if the job should run under mpirun, else why not."""
    if a.launcher == "varcomm":
        return "started with --launcher varcomm"
    if "mpi4py" not in a.baselines and a.launcher == "auto":
        return "not selected"
    if a.device != "cpu" and a.launcher == "auto":
        return "host buffers only"
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed for {sys.executable} (pip install mpi4py)"
    if not shutil.which(a.mpirun):
        return f"{a.mpirun!r} not found on PATH (apt-get install openmpi-bin)"
    return None


def _relaunch(args_in: list[str], a: argparse.Namespace) -> int:
    """Not under a launcher: run this same command on --nranks ranks."""
    from . import __file__ as pkg_init, run

    n = a.nranks
    if n < 2:
        raise BenchError("--nranks must be >= 2")
    pkg_root = str(Path(pkg_init).absolute().parents[1])  # where this varcomm was imported from
    pp = os.environ.get("PYTHONPATH", "")
    if pkg_root not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = pkg_root + (os.pathsep + pp if pp else "")
    os.environ.setdefault("VARCOMM_BENCH_CMD", shlex.join(["varcomm-bench", *args_in]))
    timeout = a.timeout if a.timeout is not None else 900.0
    cmd = [sys.executable, "-m", "varcomm.bench", *args_in]
    why = _mpi_choice(a)
    if why is None:
        os.environ["VARCOMM_BENCH_LAUNCHER"] = f"mpirun -n {n}"
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run.free_port()), OMP_NUM_THREADS="1")
        mp = [a.mpirun, "-n", str(n), "--oversubscribe", *shlex.split(a.mpirun_args)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            mp.insert(1, "--allow-run-as-root")
            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        for k in sorted(os.environ):
            if k in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS") or k.startswith("VARCOMM_"):
                mp += ["-x", k]
        p = subprocess.Popen(mp + cmd, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            if isinstance(e, KeyboardInterrupt):
                raise
            log(f"the job did not finish in {timeout:g} s (--timeout): stopped")
            return 124
    if why != "not selected":
        os.environ["VARCOMM_BENCH_NO_MPI"] = f"not run under mpirun: {why}"
    os.environ["VARCOMM_BENCH_LAUNCHER"] = f"varcomm.run -n {n}"
    return run.launch(cmd, n, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
