"""varcomm-bench: varcomm measured against its baselines, all in one run.

    varcomm-bench p2p      [-b 8] [-e 64M] [-f 2] [--tests latency,unibw,bibw] [--window 8]
    varcomm-bench varlen   [--dist uniform|lognormal|file:PATH] [--messages 64]
    varcomm-bench alltoall [--routing uniform,zipf,all-to-one] [--hidden 1024]
    varcomm-bench all      (all three in one job)
    varcomm-bench moe      MoE dispatch + combine on GPUs, device splits vs NCCL two-phase (varcomm_bench.moe)

    common: -n/--iters -w/--warmup -r/--repeats -c/--check --dtype --device cpu|cuda
            --transport auto|shm|rdma|fallback --baselines fallback,mpi4py,... --quick
            --json FILE --plot FILE.png --md FILE --save DIR --nranks N

Baselines (each skipped with a stated reason when missing): varcomm's fallback
(the same writes over gloo), mpi4py (in-process, when the job runs under
mpirun), raw libfabric (fi_pingpong.c beside this package, p2p latency), single-thread memcpy,
device-to-device copy (--device cuda), and for alltoall the two-phase algorithm.

Started outside a launcher it relaunches itself on --nranks ranks (default 2):
under mpirun when mpi4py and mpirun are there (so the MPI baseline runs in the
same processes), else under python -m varcomm.run. Under varcomm-run, torchrun
or mpirun it uses their environment. Timing rules: see varcomm_bench.core.

Every option is checked by argparse before any rank starts: a bad value is a
usage error (exit status 2) that names the option.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from .alltoall import ROUTINGS
from .core import BASELINES, LABELS, BenchError, fmt_bytes, log, parse_bytes
from .p2p import TESTS
from .varlen import read_sizes

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
OTHER = {"tests": ["latency", "unibw", "bibw"], "fi_provider": None, "fi_pingpong": None, "fi_timeout": 20.0,
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


def provider_used(ctx: Any) -> str:
    """The provider fi_pingpong reported running on; one asked for that never ran, said so."""
    return ctx.fi_seen_provider or f"{ctx.fi_provider_used} asked for; fi_pingpong did not run"


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
        except Exception:
            info[mod] = None
    try:
        import varcomm

        info["varcomm"] = varcomm.__version__
        info["varcomm_build"] = varcomm.build_info()
    except Exception as e:  # informational only
        info["varcomm_build"] = f"unavailable: {e}"
    else:
        # How rank 0's large copies into peers' memory went (ordinary or non-temporal stores: csrc/hostmem.h): the
        # VM's slow spells show here.
        _, ordinary, streamed, _, _ = varcomm._C.peer_copy_stats()
        _, l_ordinary, l_streamed, _, _ = varcomm._C.peer_copy_stats(landing=True)
        info["slot_copies"] = {"ordinary": ordinary, "streamed": streamed,
                               "landing_ordinary": l_ordinary, "landing_streamed": l_streamed}
    fi: dict[str, Any] = {}
    v = _cmd_out(["pkg-config", "--modversion", "libfabric"])
    if v:
        fi["version"] = v
    provs = _cmd_out(["fi_info", "-l"])
    if provs:
        fi["providers"] = [ln.rstrip(":") for ln in provs.splitlines() if ln.endswith(":")]
    if ctx is not None:
        if getattr(ctx, "fi_provider_used", None):
            fi["provider_used"] = provider_used(ctx)
        if ctx.mpi is not None:
            info["mpi"] = ctx.mpi.Get_library_version().strip().splitlines()[0].rstrip("\x00").strip()
        info["transport"] = ctx.transport
        info["transport_detail"] = ctx.transport_detail
        if ctx.device.type == "cuda":
            info["gpu"] = ctx.torch.cuda.get_device_name(ctx.device)
    info["libfabric"] = fi
    return info


# ---- command line ------------------------------------------------------------------------
# Each option is parsed and checked by its argparse type, so a bad value is a
# usage error naming the option, raised before any rank starts.

def _number(zero: bool) -> Callable[[str], float]:
    """A finite number > 0 (seconds: a rank that got -1 died with a traceback), or >= 0 with `zero`
    (a spread: 0 makes every message the same size)."""
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if not (v >= 0 if zero else v > 0) or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{s}: must be a number {'>=' if zero else '>'} 0")
        return v

    return conv


def _at_least(low: int) -> Callable[[str], int]:
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v}: must be >= {low}")
        return v

    return conv


def _size(s: str) -> int:
    try:
        v = parse_bytes(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size (bytes, or with K/M/G: 64K, 1M)") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: must be at least 1 byte")
    return v


def _dtype(s: str) -> str:
    v = DTYPES.get(s, s)
    if v not in _OK_DTYPES:
        raise argparse.ArgumentTypeError(f"{s!r}: use one of {', '.join(_OK_DTYPES)} (or float, half)")
    return v


def _baselines(s: str) -> list[str]:
    names = [b.strip() for b in s.split(",") if b.strip()]
    if names == ["all"]:
        return list(BASELINES)
    if names in (["none"], []):
        return []
    alias = {"fi": "libfabric", "mpi": "mpi4py", "gloo": "fallback", "two_phase": "two-phase"}
    names = [alias.get(b, b) for b in names]
    bad = [b for b in names if b not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(BASELINES)}, all or none")
    return names


def _tests(s: str) -> list[str]:
    names = [t.strip() for t in s.split(",") if t.strip()]
    bad = [t for t in names if t not in TESTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {bad or [s]}; choose from {', '.join(TESTS)}")
    return names


def _routing(s: str) -> str:
    names = [r.strip() for r in s.split(",") if r.strip()]
    bad = [r for r in names if r not in ROUTINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {bad or [s]}; use {', '.join(ROUTINGS)}, or a comma list")
    return s


def _dist(s: str) -> str:
    if s.startswith("file:"):
        try:
            read_sizes(s[5:])  # read here so that a bad file stops the command before ranks start
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    elif s not in ("uniform", "lognormal"):
        raise argparse.ArgumentTypeError(f"{s!r}: use uniform, lognormal or file:PATH")
    return s


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (nccl-tests flags)")
    g.add_argument("-b", "--minbytes", type=_size, default=None, help="smallest size (default per subcommand)")
    g.add_argument("-e", "--maxbytes", type=_size, default=None, help="largest size (default per subcommand)")
    g.add_argument("-f", "--stepfactor", type=_at_least(2), default=None,
                   help="size multiplier (default per subcommand)")
    g.add_argument("-n", "--iters", type=_at_least(0), default=0,
                   help="timed iterations per sample (default: calibrated, about --sample-ms per sample)")
    g.add_argument("-w", "--warmup", type=_at_least(0), default=None,
                   help="untimed iterations before each sample (2; quick 1)")
    g.add_argument("-r", "--repeats", type=_at_least(1), default=None,
                   help="samples per point, median reported (5; quick 3)")
    g.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                   help="verify every message of the warm-up iterations (sizes and bytes); #wrong counts them")
    g.add_argument("--sample-ms", type=float, default=None, help="calibrated sample length (20; quick 3)")
    g.add_argument("--min-iters", type=_at_least(1), default=2, help="fewest calibrated iterations (default 2)")
    g.add_argument("--max-iters", type=_at_least(1), default=20000, help="most calibrated iterations (default 20000)")
    g.add_argument("--cal-iters", type=_at_least(1), default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("what to run")
    g.add_argument("--dtype", type=_dtype, default="float32",
                   help=f"element type: {', '.join(_OK_DTYPES)} (or float, half)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the buffers live (default cpu)")
    g.add_argument("--transport", choices=("auto", "shm", "rdma", "fallback"), default=None,
                   help="varcomm's transport (default: VARCOMM_TRANSPORT or auto)")
    g.add_argument("--baselines", type=_baselines, default="all",
                   help=f"comma list of {','.join(BASELINES)}, 'all' or 'none' (default all)")
    g.add_argument("--quick", action="store_true", help="a few seconds per subcommand: fewer sizes and repeats")
    g.add_argument("--nranks", type=_at_least(2), default=2,
                   help="ranks to start when not under a launcher (default 2; p2p takes 2)")
    g.add_argument("--launcher", choices=("auto", "mpirun", "varcomm"), default="auto",
                   help="how to start the ranks when not under a launcher (auto: mpirun if mpi4py is there)")
    g.add_argument("--mpirun", default="mpirun", help="mpirun to use (default: on PATH)")
    g.add_argument("--mpirun-args", default="--bind-to none", help="extra mpirun options as one string")
    g.add_argument("--timeout", type=_number(False), default=None,
                   help="kill the relaunched job after S seconds (default 900)")
    g.add_argument("--op-timeout", type=_number(False), default=120.0,
                   help="timeout of one varcomm operation (default 120)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="every number, the options and the machine")
    g.add_argument("--plot", metavar="FILE.png", help="time and bandwidth against size, varcomm and baselines")
    g.add_argument("--md", metavar="FILE", help="the tables and the command as markdown")
    g.add_argument("--save", metavar="DIR", help="write DIR/<subcommand>-<date>.json and .md")
    g.add_argument("--osu", action="store_true",
                   help="print OSU micro-benchmark columns (# Size  Latency (us) / Bandwidth (MB/s)) instead of the"
                        " nccl-tests table")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _p2p_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("p2p")
    g.add_argument("--tests", type=_tests, default="latency,unibw,bibw",
                   help="comma list of latency, unibw, bibw (default all)")
    g.add_argument("--window", type=_at_least(1), default=None, help="messages in flight for unibw/bibw (8; quick 4)")
    g.add_argument("--fallback-maxbytes", type=_size, default=None,
                   help="largest size for the fallback, ~0.5 ms per message (4M; quick 1M)")
    g.add_argument("--fi-provider", default=None,
                   help="libfabric provider of the raw baseline (default: the one varcomm was asked for, else shm)")
    g.add_argument("--fi-pingpong", default=None, help="path of fi_pingpong (default: built from the package's "
                   "fi_pingpong.c)")
    g.add_argument("--fi-timeout", type=_number(False), default=20.0,
                   help="seconds for one fi_pingpong run; past it the baseline stops (default 20)")


def _varlen_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("varlen")
    g.add_argument("--dist", type=_dist, default="lognormal",
                   help="uniform | lognormal | file:PATH (sizes, one per line)")
    g.add_argument("--sigma", type=_number(True), default=0.8, help="lognormal sigma (default 0.8)")
    g.add_argument("--messages", type=_at_least(1), default=None, help="distinct sizes per point (64; quick 16)")
    g.add_argument("--slots", type=_at_least(1), default=8,
                   help="varcomm slots: messages in flight per stage (default 8)")


def _a2a_opts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("alltoall")
    g.add_argument("--routing", type=_routing, default="uniform", help="uniform | zipf | all-to-one, or a comma list")
    g.add_argument("--hidden", type=_at_least(1), default=1024, help="elements per token row (default 1024)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="varcomm-bench", description="varcomm microbenchmarks against their baselines.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="also:\n  moe       MoE dispatch + combine on GPUs against their baselines "
                                       "(its own options: varcomm-bench moe --help)")
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
    """Fill presets and the defaults of options the subcommand does not have."""
    for k, v in OTHER.items():
        if not hasattr(a, k):
            setattr(a, k, v)
    preset = QUICK if a.quick else FULL
    for k, v in preset.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.transport is None:
        a.transport = (os.environ.get("VARCOMM_TRANSPORT") or "auto").lower()
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
    if args_in[:1] == ["moe"]:  # its own options and launch (GPU only): varcomm_bench.moe
        from . import moe

        return moe.main(args_in[1:])
    parser = _parser()
    a = _finish_args(parser.parse_args(args_in))
    if a.minbytes is not None and a.maxbytes is not None and a.maxbytes < a.minbytes:
        parser.error(f"-e/--maxbytes: {fmt_bytes(a.maxbytes)} is below -b/--minbytes {fmt_bytes(a.minbytes)}; "
                     "give the smallest size with -b and the largest with -e")
    _check_device(a)
    if not _in_launcher():
        _check_before_launch(parser, a)
        try:
            return _relaunch(args_in, a)
        except KeyboardInterrupt:  # (the job was stopped: the ranks' tracebacks would say nothing more)
            log("interrupted: the job was stopped")
            return 130
    try:
        return run_job(a)
    except KeyboardInterrupt:  # (^C reaches every rank: the launcher says it once)
        return 130
    except Exception:
        _abort_mpi_job()
        raise


def _recorded_environment() -> dict[str, str]:
    from varcomm.options import Options

    names = {spec.env: spec.secret for spec in Options.specs().values()}
    return {k: v for k, v in sorted(os.environ.items())
            if (k in names and not names[k]) or k.startswith("FI_")}


def _check_before_launch(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """What would fail every rank the same way, or only after the run: said once, before any rank starts."""
    import warnings

    from varcomm.options import resolve_valid

    if a.cmd == "p2p" and a.nranks != 2:  # (all runs p2p on ranks 0 and 1, the others idle)
        parser.error(f"--nranks: the p2p benchmark is a ping-pong between 2 ranks, not {a.nranks} (--nranks 2)")
    if a.launcher == "mpirun" and not shutil.which(a.mpirun):
        parser.error(f"--launcher mpirun: {a.mpirun!r} not found (install Open MPI, pass --mpirun PATH, or use "
                     "--launcher varcomm)")
    try:  # a bad VARCOMM_* value (as varcomm-run checks it)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resolve_valid()
    except ValueError as e:
        parser.error(str(e))
    for w in seen:
        log(f"warning: {w.message}")
    import torch

    isz = getattr(torch, a.dtype).itemsize
    for opt, v in (("-b/--minbytes", a.minbytes), ("-e/--maxbytes", a.maxbytes)):
        if v is not None and a.cmd != "alltoall" and v % isz:  # (the tables would show other sizes, unexplained)
            log(f"note: {opt} {v}: messages are whole {a.dtype} elements ({isz} B each), so this size runs as "
                f"{max(isz, v - v % isz)} B")
    for name in a.baselines:  # (silently dropped, where d2d off the GPU says why)
        if name in ALLTOALL_ONLY and a.cmd in ("p2p", "varlen"):
            log(f"note: --baselines {name}: only the alltoall benchmark has it; {a.cmd} skips it")
    for opt in ("json", "md", "plot", "save"):
        path = getattr(a, opt, None)
        if path:
            # (the writer makes missing folders: the first one that exists must take them)
            folder = os.path.abspath(path) if opt == "save" else os.path.dirname(os.path.abspath(path))
            while not os.path.exists(folder):
                folder = os.path.dirname(folder)
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                parser.error(f"--{opt}: cannot write there: {path} ({folder} is not a writable folder)")
            if opt != "save" and os.path.isdir(path):
                example = os.path.join(path, "run." + opt)
                parser.error(f"--{opt}: {path} is a folder; name a file in it (e.g. {example})")
    need = _memory_needed(a)
    have = _memory_available()
    if need and have and need > have:
        parser.error(f"-e/--maxbytes {fmt_bytes(a.maxbytes)}: the ranks would need at least {need / 2**30:.1f} GiB "
                     f"({BUFFERS_PER_RANK} buffers of the largest size on each of {a.nranks} ranks) and this machine "
                     f"has {have / 2**30:.1f} GiB available; pass a smaller -e")


#: Baselines of the all-to-all alone.
ALLTOALL_ONLY = ("two-phase", "nccl")


#: Buffers of the largest size a rank holds at once: the source, the
#: destination, the check pattern, and a baseline's or a result's own.
BUFFERS_PER_RANK = 4


def _memory_needed(a: argparse.Namespace) -> int:
    """A floor of the host memory the ranks take (0: not checked): with
    --device cuda the buffers are GPU memory; receive slots and all-to-one's
    gathered output come on top."""
    if not a.maxbytes or a.device != "cpu":
        return 0
    return BUFFERS_PER_RANK * a.nranks * a.maxbytes


def _memory_available() -> int:
    """MemAvailable (0: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _abort_mpi_job() -> None:
    """A rank that fails under mpirun stops the job now: otherwise it waits in
    MPI_Finalize while its peers spin in their next MPI call, until --timeout,
    which then hides the error."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    import traceback

    traceback.print_exc()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)


# ---- the job -------------------------------------------------------------------------------

def run_job(a: argparse.Namespace) -> int:
    from . import alltoall, p2p, report, varlen
    from .core import Ctx

    mods = {"p2p": p2p, "varlen": varlen, "alltoall": alltoall}
    t0 = time.monotonic()
    try:
        load0 = list(os.getloadavg())
    except OSError:
        load0 = None
    ctx = Ctx(a)
    results: list[dict[str, Any]] = []
    try:
        if os.environ.get("VARCOMM_BENCH_TEST_RAISE_ON_RANK", "") == str(ctx.rank):  # (core.py's test hooks)
            raise RuntimeError(f"raised on rank {ctx.rank} for the test (VARCOMM_BENCH_TEST_RAISE_ON_RANK)")
        if ctx.rank == 0 and not a.quiet:
            log(f"{a.cmd} on {ctx.world} ranks ({os.environ.get('VARCOMM_BENCH_LAUNCHER') or _launcher_name()}), "
                f"{a.dtype} on {a.device}, transport {a.transport}, baselines {','.join(a.baselines) or 'none'}")
        for bench in a.benches:
            ctx.a = for_bench(a, bench)
            results += mods[bench].run(ctx)
        info = machine(ctx) if ctx.rank == 0 else None
    except Exception:
        _abort_mpi_job()  # before close(), which on rank 0 (the store's host) waits for the peers
        raise
    finally:
        ctx.close()
    if ctx.rank != 0:
        return 0
    assert info is not None  # rank 0
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
           # what else decides the numbers (compare warns where two runs differ): the options' variables
           # (never a secret one) and libfabric's; not the launcher's own (VARCOMM_TEST_SEED: per job)
           "environment": _recorded_environment(),
           "labels": dict(LABELS), "results": results}
    doc["wrong_total"] = report.wrong_total(results)
    print(report.osu(doc) if a.osu else report.text(doc), flush=True)
    _write(a, doc)
    if doc["wrong_total"]:
        per = report.wrong_by_method(results)
        log(f"FAILED: -c found {doc['wrong_total']} wrong messages/results: "
            + ", ".join(f"{m} {k}" for m, k in per.items())
            + " (#wrong in the tables; every column, variants too, in --json and --osu)")
        return 1
    return 0


def _launcher_name() -> str:
    if os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE"):
        return "mpirun"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    return os.environ.get("VARCOMM_LAUNCHER") or "launcher"


def _write(a: argparse.Namespace, doc: dict[str, Any]) -> None:
    from . import report

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
        p.write_text(json.dumps(doc, indent=1, default=str) + "\n" if kind == "json" else report.markdown(doc))
        log(f"wrote {p}")
    if a.plot:
        try:
            Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
            report.plot(doc, a.plot)
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


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stopped_by(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _relaunch(args_in: list[str], a: argparse.Namespace) -> int:
    """Not under a launcher: run this same command on --nranks ranks."""
    import varcomm
    from varcomm.tools import run

    n = a.nranks
    # The ranks import this varcomm and this varcomm_bench, installed or not.
    pp = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for mod in (varcomm.__file__, __file__):
        root = str(Path(mod).absolute().parents[1])
        if root not in pp:
            pp.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(pp)
    os.environ.setdefault("VARCOMM_BENCH_CMD", shlex.join(["varcomm-bench", *args_in]))
    timeout = a.timeout if a.timeout is not None else 900.0
    cmd = [sys.executable, "-m", "varcomm_bench", *args_in]
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
        # mpirun runs in a session of its own (so that stopping it reaches every rank): a SIGTERM or SIGHUP
        # to this process (timeout(1), a batch system, a closed terminal) must stop that group too
        stops = (signal.SIGTERM, signal.SIGHUP)
        before = {s: signal.signal(s, _stopped_by) for s in stops}
        try:
            return p.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt, _Stopped) as e:
            for s in stops:  # a second signal must not cut the stopping short
                signal.signal(s, signal.SIG_IGN)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            if isinstance(e, KeyboardInterrupt):
                raise
            if isinstance(e, _Stopped):
                log(f"stopped by {signal.Signals(e.signum).name}: the job's ranks were stopped too")
                return 128 + e.signum
            log(f"the job did not finish in {timeout:g} s (--timeout): stopped")
            return 124
        finally:
            for s, h in before.items():
                signal.signal(s, h)
    if why != "not selected":
        os.environ["VARCOMM_BENCH_NO_MPI"] = f"not run under mpirun: {why}"
    os.environ["VARCOMM_BENCH_LAUNCHER"] = f"varcomm.run -n {n}"
    return run.launch(cmd, n, timeout=timeout)
