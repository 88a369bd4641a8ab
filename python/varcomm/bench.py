"""varcomm-bench: varcomm measured against its baselines, all in one run.

    varcomm-bench p2p [-b 8] [-e 64M] [-f 2] [-n ITERS] [-w WARMUP] [-r 5] [-c]
                      [--json FILE] [--md FILE] [--save DIR]

``p2p`` is a two-rank ping-pong (half round trip latency, and bandwidth =
size / half round trip) of

  numpy     varcomm shm, ``comm.send(a, 1)`` / ``comm.recv(0, out=b)`` on numpy arrays
  torch     the same with torch tensors
  zerocopy  varcomm shm, ``x = comm.recv(src, copy=False)`` and x is sent back
  fallback  varcomm over torch.distributed gloo (shape header, then payload)
  mpi4py    Comm.Send/Comm.Recv on numpy buffers, Open MPI (bench/mpi_pingpong.py)
  memcpy    single-thread ``np.copyto`` in one process: the one-copy limit

Every point is the median of ``--repeats`` samples (min and max kept in the
JSON). A sample is ``iters`` timed round trips after ``warmup`` untimed ones.
The repeats are rounds over all methods, each round in a rotated order, so
slow drifts of a noisy machine hit every method alike. Buffers are allocated
and touched before anything is timed; a barrier separates methods.

Started outside a launcher, it relaunches itself on 2 ranks with varcomm.run;
under varcomm-run/torchrun it uses their environment.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "parse_bytes", "fmt_bytes"]

_PREFIX = "varcomm-bench: "
METHODS = ("numpy", "torch", "zerocopy", "fallback", "mpi4py", "memcpy")
VARCOMM_SHM = ("numpy", "torch", "zerocopy")
_LABEL = {"numpy": "varcomm numpy", "torch": "varcomm torch", "zerocopy": "varcomm zero-copy recv",
          "fallback": "varcomm fallback (gloo)", "mpi4py": "mpi4py + Open MPI", "memcpy": "memcpy (1 thread)"}
# Rough (latency s, bandwidth B/s) per kind, used only to pick iteration counts
# so a sample lasts about --sample-ms whatever the size. Deterministic, so both
# ranks (and the MPI job) agree on the counts without talking.
_MODEL = {"shm": (4e-6, 4e9), "fallback": (6e-4, 1e9), "memcpy": (3e-7, 1e10)}
_KIND = {"numpy": "shm", "torch": "shm", "zerocopy": "shm", "mpi4py": "shm", "fallback": "fallback",
         "memcpy": "memcpy"}
_LAUNCH_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


# ---- small helpers -----------------------------------------------------------

def parse_bytes(s: str) -> int:
    """'8', '8B', '64K', '64KiB', '1M', '2G' -> bytes (powers of two)."""
    v = s.strip().upper().replace("IB", "").rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if v and v[-1] in mult:
        return int(float(v[:-1]) * mult[v[-1]])
    return int(v)


def fmt_bytes(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 1 or hi < lo or factor < 2:
        raise SystemExit(f"{_PREFIX}need 1 <= minbytes <= maxbytes and stepfactor >= 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def pattern(size: int) -> Any:
    """Payload of a `size`-byte message under --check (differs per size); the
    same formula as bench/mpi_pingpong.py."""
    import numpy as np

    return ((np.arange(size, dtype=np.int64) + size * 13) % 251).astype(np.uint8)


def _plan(method: str, size: int, a: argparse.Namespace) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) of one sample."""
    if a.iters:
        n = a.iters
    else:
        lat, bw = _MODEL[_KIND[method]]
        per = (lat + size / bw) * (1 if method == "memcpy" else 2)
        n = int(a.sample_ms * 1e-3 / per)
        n = max(a.min_iters, min(n, 20000))
    w = a.warmup if a.warmup is not None else max(2, n // 10)
    return n, w


def _in_launcher() -> bool:
    return any(os.environ.get(k) not in (None, "") for k in _LAUNCH_VARS) and bool(
        os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
        or os.environ.get("SLURM_NTASKS"))


def _log(msg: str) -> None:
    print(_PREFIX + msg, file=sys.stderr, flush=True)


# ---- machine description -------------------------------------------------------

def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": platform.node(), "kernel": platform.release(),
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
    for mod in ("numpy", "torch", "mpi4py"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    try:
        import varcomm

        info["varcomm"] = varcomm.__version__
        info["varcomm_build"] = varcomm.build_info()
    except Exception as e:  # noqa: BLE001 - informational only
        info["varcomm_build"] = f"unavailable: {e}"
    return info


# ---- the ping-pong kernels (one sample each) -----------------------------------

class _Ctx:
    """Everything both ranks preallocate once."""

    def __init__(self, a: argparse.Namespace, rank: int) -> None:
        import numpy as np
        import torch

        import varcomm

        # One intra-op thread per rank, as torchrun sets OMP_NUM_THREADS=1: an
        # OpenMP worker spinning after a parallel fill would steal the peer's core.
        torch.set_num_threads(1)
        self.a, self.rank, self.peer = a, rank, 1 - rank
        cap = max(a.sizes)
        self.np_src = np.full(cap, 1, dtype=np.uint8)
        self.np_dst = np.zeros(cap, dtype=np.uint8)
        self.t_src = torch.full((cap,), 1, dtype=torch.uint8)
        self.t_dst = torch.zeros(cap, dtype=torch.uint8)
        self.cp_src = np.full(cap, 1, dtype=np.uint8) if rank == 0 else None  # memcpy, rank 0 only
        self.cp_dst = np.zeros(cap, dtype=np.uint8) if rank == 0 else None
        self.comm = varcomm.init(bound=cap, slots=2, array="numpy")
        if self.comm.transport_for(self.peer) != "shm":
            raise SystemExit(f"{_PREFIX}expected the shm transport to rank {self.peer}, got "
                             f"{self.comm.transport_for(self.peer)!r}")
        self.fb = None
        self.skipped: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        if "fallback" in a.methods:
            fb_sizes = [s for s in a.sizes if s <= a.fallback_maxbytes]
            if not fb_sizes:
                self.skipped["fallback"] = f"no size <= --fallback-maxbytes {a.fallback_maxbytes}"
            else:
                try:
                    self.fb = varcomm.init(bound=max(fb_sizes), slots=2, transport="fallback", array="numpy")
                except Exception as e:  # noqa: BLE001 - symmetric on both ranks: report and go on
                    self.skipped["fallback"] = f"varcomm.init(transport='fallback') failed: {type(e).__name__}: {e}"
        self.mpi_info: dict[str, Any] = {}

    def close(self) -> None:
        if self.fb is not None:
            self.fb.close()
        self.comm.close()


def _pingpong(ctx: _Ctx, method: str, size: int, n: int, w: int) -> float | None:
    """One sample of `n` round trips; returns seconds per half round trip on rank 0."""
    import numpy as np
    import torch

    a, rank, peer = ctx.a, ctx.rank, ctx.peer
    check = a.check
    comm = ctx.fb if method == "fallback" else ctx.comm
    send, recv = comm.send, comm.recv
    if method == "torch":
        src, dst = ctx.t_src[:size], ctx.t_dst
    else:
        src, dst = ctx.np_src[:size], ctx.np_dst
    expect: Any = None
    if check:
        expect = pattern(size)
        if method == "torch":
            expect = torch.from_numpy(expect)
        if rank == 0:
            src.copy_(expect) if method == "torch" else np.copyto(src, expect)

    def verify(r: Any) -> None:
        ok = tuple(r.shape) == (size,) and (torch.equal(r, expect) if method == "torch" else np.array_equal(r, expect))
        if not ok:
            raise SystemExit(f"{_PREFIX}rank {rank}: {method} {size} B: wrong payload "
                             f"(shape {tuple(r.shape)}, dtype {r.dtype})")

    perf = time.perf_counter
    if rank == 0:
        if method == "zerocopy":
            for _ in range(w):
                send(src, peer)
                recv(peer, copy=False)
            t0 = perf()
            if check:
                for _ in range(n):
                    send(src, peer)
                    x = recv(peer, copy=False)
                    verify(x)
                    del x
            else:
                for _ in range(n):
                    send(src, peer)
                    recv(peer, copy=False)  # the view dies here: the slot goes back
            dt = perf() - t0
        else:
            for _ in range(w):
                send(src, peer)
                recv(peer, out=dst)
            t0 = perf()
            if check:
                for _ in range(n):
                    send(src, peer)
                    dst[:size] = 0
                    verify(recv(peer, out=dst))
            else:
                for _ in range(n):
                    send(src, peer)
                    recv(peer, out=dst)
            dt = perf() - t0
        return dt / n / 2
    # rank 1: echo what arrived
    for i in range(w + n):
        if method == "zerocopy":
            x = recv(peer, copy=False)
        else:
            if check:
                dst[:size] = 0
            x = recv(peer, out=dst)
        if check:
            verify(x)
        send(x, peer)
        del x
    return None


def _memcpy(ctx: _Ctx, size: int, n: int, w: int) -> float:
    import numpy as np

    s, d = ctx.cp_src[:size], ctx.cp_dst[:size]
    copyto = np.copyto
    for _ in range(w):
        copyto(d, s)
    t0 = time.perf_counter()
    for _ in range(n):
        copyto(d, s)
    return (time.perf_counter() - t0) / n


def _mpi_script(a: argparse.Namespace) -> Path | None:
    if a.mpi_script:
        return Path(a.mpi_script)
    p = Path(__file__).resolve().parents[2] / "bench" / "mpi_pingpong.py"
    return p if p.is_file() else None


def _mpi_unavailable(a: argparse.Namespace) -> str | None:
    import importlib.util

    if any(os.environ.get(k) for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        return "this benchmark itself runs under MPI: cannot start a nested mpirun"
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed for {sys.executable} (pip install mpi4py)"
    if not shutil.which(a.mpirun):
        return f"{a.mpirun!r} not found on PATH (apt-get install openmpi-bin)"
    if _mpi_script(a) is None:
        return "bench/mpi_pingpong.py not found (run from a source checkout or pass --mpi-script)"
    return None


def _mpi_round(ctx: _Ctx, sizes: list[int], timeout: float) -> dict[int, float]:
    """One mpirun job: one sample per size. Rank 0 of varcomm waits for it."""
    a = ctx.a
    plans = [_plan("mpi4py", s, a) for s in sizes]
    cmd = [a.mpirun, "-n", "2", "--oversubscribe", *shlex.split(a.mpirun_args)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, str(_mpi_script(a)), "--sizes", ",".join(map(str, sizes)),
            "--iters", ",".join(str(n) for n, _ in plans), "--warmup", ",".join(str(w) for _, w in plans)]
    if a.check:
        cmd.append("--check")
    ctx.mpi_info.setdefault("command", shlex.join(cmd))
    # Not our launcher's variables: the MPI job is its own 2-rank world.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VARCOMM_LAUNCHER")}
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"mpirun did not finish in {timeout:.0f} s (machine overloaded?)")
    ctx.mpi_info["job_seconds"] = ctx.mpi_info.get("job_seconds", 0.0) + time.monotonic() - t0
    out: dict[int, float] = {}
    for line in r.stdout.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("kind") == "info":
            ctx.mpi_info.update({k: (v.rstrip("\x00").strip() if isinstance(v, str) else v)
                                 for k, v in d.items() if k != "kind"})
        elif d.get("kind") == "sample":
            out[int(d["size"])] = float(d["seconds"]) / int(d["iters"]) / 2
    if r.returncode != 0 or len(out) != len(sizes):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"mpirun exited with {r.returncode}: " + " | ".join(tail))
    return out


# ---- the run ---------------------------------------------------------------------

def _sizes_for(method: str, a: argparse.Namespace) -> list[int]:
    if method == "fallback":
        return [s for s in a.sizes if s <= a.fallback_maxbytes]
    return list(a.sizes)


def _run_ranks(a: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
               or os.environ.get("SLURM_PROCID") or 0)
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
                or os.environ.get("SLURM_NTASKS") or 1)
    if world != 2:
        if rank == 0:
            _log(f"p2p needs exactly 2 ranks, got {world}")
        return 2
    t_start = time.monotonic()
    info = machine() if rank == 0 else {}
    ctx = _Ctx(a, rank)
    methods = [m for m in a.methods if m not in ctx.skipped]
    if "mpi4py" in methods and rank == 0:
        why = _mpi_unavailable(a)
        if why:
            ctx.skipped["mpi4py"] = why
    samples: dict[str, dict[int, list[float]]] = {m: {} for m in METHODS}
    spent: dict[str, float] = {}
    plans = {m: {s: _plan(m, s, a) for s in _sizes_for(m, a)} for m in METHODS}
    comm = ctx.comm
    gc.collect()
    import numpy as np

    t_rounds, longest, rounds = time.monotonic(), 0.0, 0
    for rnd in range(a.repeats):
        if rnd > 0:
            # Another round only if it fits in --max-seconds (rank 0 decides, rank 1 is told).
            if rank == 0:
                now = time.monotonic()
                go = not a.max_seconds or now - t_start + longest <= a.max_seconds
                comm.send(np.array([int(go)], dtype=np.int64), 1)
            else:
                go = bool(comm.recv(0)[0])
            if not go:
                break
        t_round = time.monotonic()
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for m in order:
            comm.barrier()
            t0 = time.monotonic()
            if m == "mpi4py":
                if rank == 0 and "mpi4py" not in ctx.skipped and "mpi4py" not in ctx.notes:
                    left = a.max_seconds - (time.monotonic() - t_start) if a.max_seconds else a.mpi_timeout
                    try:
                        for s, v in _mpi_round(ctx, _sizes_for(m, a), max(60.0, min(a.mpi_timeout, left))).items():
                            samples[m].setdefault(s, []).append(v)
                    except (RuntimeError, OSError, ValueError) as e:
                        if samples[m]:  # keep the rounds that worked
                            ctx.notes["mpi4py"] = f"stopped after round {rnd}: {e}"
                        else:
                            ctx.skipped["mpi4py"] = str(e)
            elif m == "memcpy":
                if rank == 0:
                    for s in _sizes_for(m, a):
                        samples[m].setdefault(s, []).append(_memcpy(ctx, s, *plans[m][s]))
            else:
                gc.disable()
                try:
                    for s in _sizes_for(m, a):
                        v = _pingpong(ctx, m, s, *plans[m][s])
                        if v is not None:
                            samples[m].setdefault(s, []).append(v)
                finally:
                    gc.enable()
            spent[m] = spent.get(m, 0.0) + time.monotonic() - t0
            if rank == 0 and not a.quiet:
                _log(f"round {rnd + 1}/{a.repeats}: {m:<8} {time.monotonic() - t0:6.2f} s")
        longest = max(longest, time.monotonic() - t_round)
        rounds += 1
    comm.barrier()
    ctx.close()
    if rank != 0:
        return 0
    elapsed = time.monotonic() - t_start
    try:
        info["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    info["seconds_per_method"] = {m: round(v, 2) for m, v in spent.items()}
    info["rounds"] = rounds
    if rounds < a.repeats:
        _log(f"only {rounds} of {a.repeats} repeats fit in --max-seconds {a.max_seconds:g}")
    res = _results(a, samples, plans, ctx, info, elapsed)
    _emit(a, res)
    return 0


def _results(a: argparse.Namespace, samples: dict[str, dict[int, list[float]]], plans: dict[str, dict[int, Any]],
             ctx: _Ctx, info: dict[str, Any], elapsed: float) -> dict[str, Any]:
    points: dict[str, list[dict[str, Any]]] = {}
    for m in a.methods:
        if m in ctx.skipped:
            continue
        rows = []
        for s, v in sorted(samples[m].items()):
            med, lo, hi = statistics.median(v), min(v), max(v)
            n, w = plans[m][s]
            key = "copy_us" if m == "memcpy" else "half_rtt_us"
            rows.append({"size": s, "iters": n, "warmup": w, "repeats": len(v),
                         key: {"median": med * 1e6, "min": lo * 1e6, "max": hi * 1e6,
                               "samples": [x * 1e6 for x in v]},
                         "gbps": {"median": s / med / 1e9, "min": s / hi / 1e9, "max": s / lo / 1e9}})
        points[m] = rows
    if ctx.mpi_info:
        info["mpi"] = ctx.mpi_info
    cmd = os.environ.get("VARCOMM_BENCH_CMD") or shlex.join(getattr(sys, "orig_argv", sys.argv))
    res = {"benchmark": "p2p", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": cmd, "elapsed_s": round(elapsed, 1), "machine": info,
           "options": {k: v for k, v in vars(a).items() if k not in ("func",)},
           "methods": {m: _LABEL[m] for m in a.methods}, "skipped": ctx.skipped, "notes": ctx.notes, "points": points}
    res["targets"] = _targets(res)
    return res


def _lookup(res: dict[str, Any], m: str, size: int, key: str) -> float | None:
    for p in res["points"].get(m, []):
        if p["size"] == size:
            k = ("copy_us" if m == "memcpy" else "half_rtt_us") if key == "us" else "gbps"
            return float(p[k]["median"])
    return None


def _targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, all from this run's medians."""
    out: list[dict[str, Any]] = []

    def add(name: str, got: float | None, limit: float, le: bool, detail: str) -> None:
        met = None if got is None else (got <= limit if le else got >= limit)
        out.append({"target": name, "ratio": got, "limit": limit, "met": met, "detail": detail})

    for m, limit in (("numpy", 1.0), ("torch", 2.0)):
        v, ref = _lookup(res, m, 8, "us"), _lookup(res, "mpi4py", 8, "us")
        add(f"8 B half-RTT latency, {m}: <= {limit:g}x mpi4py", v / ref if v and ref else None, limit, True,
            f"{v:.2f} us vs {ref:.2f} us" if v and ref else "not measured")
    big = 16 << 20
    for m in VARCOMM_SHM:
        v, ref = _lookup(res, m, big, "bw"), _lookup(res, "mpi4py", big, "bw")
        add(f"16 MiB bandwidth, {m}: >= 2x mpi4py", v / ref if v and ref else None, 2.0, False,
            f"{v:.2f} GB/s vs {ref:.2f} GB/s" if v and ref else "not measured")
    for m in VARCOMM_SHM:
        v, ref = _lookup(res, m, big, "bw"), _lookup(res, "memcpy", big, "bw")
        add(f"16 MiB bandwidth, {m}: >= 0.6x memcpy", v / ref if v and ref else None, 0.6, False,
            f"{v:.2f} GB/s vs {ref:.2f} GB/s" if v and ref else "not measured")
    for m in ("numpy", "torch"):
        worst: tuple[float, int] | None = None
        for p in res["points"].get("fallback", []):
            s = p["size"]
            if s > 64 << 10:
                continue
            v = _lookup(res, m, s, "us")
            if v:
                r = p["half_rtt_us"]["median"] / v
                worst = min(worst, (r, s)) if worst else (r, s)
        add(f"<= 64 KiB, {m}: >= 50x faster than fallback", worst[0] if worst else None, 50.0, False,
            f"slowest ratio {worst[0]:.0f}x, at {fmt_bytes(worst[1])}" if worst else "not measured")
    return out


# ---- output ----------------------------------------------------------------------

def _cell(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _us_fmt(v: float) -> str:
    return ".2f" if v < 10 else ".1f" if v < 1000 else ".0f"


def tables(res: dict[str, Any]) -> str:
    ms = [m for m in METHODS if m in res["points"]]
    sizes = sorted({p["size"] for m in ms for p in res["points"][m]})
    lat_ms = [m for m in ms if m != "memcpy"]
    lines = ["Half round-trip latency, us (median; memcpy: one copy)", ""]
    ratios = [("numpy/mpi", "numpy", "mpi4py"), ("torch/mpi", "torch", "mpi4py"), ("fb/numpy", "fallback", "numpy")]
    ratios = [r for r in ratios if r[1] in ms and r[2] in ms]
    hdr = ["size"] + lat_ms + (["memcpy"] if "memcpy" in ms else []) + [r[0] for r in ratios]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "|".join("---:" for _ in hdr) + "|")
    for s in sizes:
        row = [fmt_bytes(s)]
        for m in lat_ms + (["memcpy"] if "memcpy" in ms else []):
            v = _lookup(res, m, s, "us")
            row.append(_cell(v, _us_fmt(v) if v is not None else ""))
        for _, x, y in ratios:
            vx, vy = _lookup(res, x, s, "us"), _lookup(res, y, s, "us")
            row.append(_cell(vx / vy if vx and vy else None, ".2f" if x != "fallback" else ".0f"))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Bandwidth, GB/s (1e9 B/s; size / half round trip; memcpy: size / copy time)", ""]
    ratios = [("numpy/mpi", "numpy", "mpi4py"), ("zcopy/mpi", "zerocopy", "mpi4py"),
              ("numpy/memcpy", "numpy", "memcpy"), ("zcopy/memcpy", "zerocopy", "memcpy")]
    ratios = [r for r in ratios if r[1] in ms and r[2] in ms]
    hdr = ["size"] + ms + [r[0] for r in ratios]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|" + "|".join("---:" for _ in hdr) + "|")
    for s in sizes:
        if s < 1024:
            continue
        row = [fmt_bytes(s)]
        for m in ms:
            row.append(_cell(_lookup(res, m, s, "bw"), ".3f" if s < 64 << 10 else ".2f"))
        for _, x, y in ratios:
            vx, vy = _lookup(res, x, s, "bw"), _lookup(res, y, s, "bw")
            row.append(_cell(vx / vy if vx and vy else None, ".2f"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def targets_block(res: dict[str, Any]) -> str:
    lines = ["Targets (same run, medians):"]
    for t in res["targets"]:
        state = "n/a" if t["met"] is None else "MET" if t["met"] else "NOT MET"
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.2f}x  "
        lines.append(f"  {state:<8} {t['target']:<44} {ratio}({t['detail']})")
    for m, why in res["skipped"].items():
        lines.append(f"  skipped  {m}: {why}")
    for m, why in res.get("notes", {}).items():
        lines.append(f"  note     {m}: {why}")
    return "\n".join(lines)


def _describe(res: dict[str, Any]) -> str:
    mc = res["machine"]
    mpi = mc.get("mpi", {})
    return (f"{res['date']}, {mc.get('cpu', '?')}, {mc.get('cores')} cores, load {mc.get('loadavg_start', ['?'])[0]}"
            f" -> {mc.get('loadavg_end', ['?'])[0]}; python {mc.get('python')}, numpy {mc.get('numpy')}, "
            f"torch {mc.get('torch')}, varcomm {mc.get('varcomm')}, mpi4py {mc.get('mpi4py')}"
            + (f" on {mpi.get('vendor', ['?'])[0]} {mpi.get('vendor', ['', '?'])[-1]}" if mpi else "")
            + f"; {mc.get('rounds', res['options']['repeats'])} of {res['options']['repeats']} repeats, "
              f"{res['elapsed_s']} s")


def markdown(res: dict[str, Any]) -> str:
    return "\n".join([
        f"# varcomm-bench p2p, {res['date']}", "", "```", res["command"], "```", "", _describe(res), "",
        "Methods: " + "; ".join(f"`{m}` = {lbl}" for m, lbl in res["methods"].items()), "",
        tables(res), "", "```", targets_block(res), "```", "",
        f"MPI job: `{res['machine'].get('mpi', {}).get('command', 'not run')}`", ""])


def _emit(a: argparse.Namespace, res: dict[str, Any]) -> None:
    print(_describe(res))
    print()
    print(tables(res))
    print()
    print(targets_block(res))
    paths: list[tuple[Path, str]] = []
    if a.save:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        d = Path(a.save)
        d.mkdir(parents=True, exist_ok=True)
        paths += [(d / f"p2p-{stamp}.json", "json"), (d / f"p2p-{stamp}.md", "md")]
    if a.json:
        paths.append((Path(a.json), "json"))
    if a.md:
        paths.append((Path(a.md), "md"))
    for p, kind in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(res, indent=1) + "\n" if kind == "json" else markdown(res))
        print(f"wrote {p}")


# ---- command line ------------------------------------------------------------------

def _p2p_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("p2p", help="two-rank ping-pong: varcomm shm/fallback vs mpi4py vs memcpy",
                       description="Two-rank ping-pong latency and bandwidth, all methods in one run.")
    p.add_argument("-b", "--minbytes", type=parse_bytes, default=8, help="smallest message (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_bytes, default=64 << 20, help="largest message (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier (default 2)")
    p.add_argument("-n", "--iters", type=int, default=0,
                   help="timed round trips per sample (default: adaptive, about --sample-ms per sample)")
    p.add_argument("-w", "--warmup", type=int, default=None, help="untimed round trips (default: max(2, iters/10))")
    p.add_argument("-r", "--repeats", type=int, default=5, help="samples per point, the median is reported (default 5)")
    p.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                   help="verify every payload (slower; off by default)")
    p.add_argument("--sample-ms", type=float, default=25.0, help="target duration of one adaptive sample (default 25)")
    p.add_argument("--min-iters", type=int, default=3, help="fewest adaptive iterations (default 3)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--fallback-maxbytes", type=parse_bytes, default=4 << 20,
                   help="largest size for the fallback, ~0.5 ms per message (default 4M)")
    p.add_argument("--mpirun", default="mpirun", help="mpirun to use (default: mpirun on PATH)")
    p.add_argument("--mpirun-args", default="--bind-to none",
                   help="extra mpirun options, as one string: --mpirun-args='--bind-to core' "
                        "(default '--bind-to none': unpinned, like the varcomm ranks)")
    p.add_argument("--mpi-script", default=None, help="path of mpi_pingpong.py (default: the checkout's bench/)")
    p.add_argument("--mpi-timeout", type=float, default=300.0,
                   help="seconds for one mpirun job, at most what --max-seconds leaves, at least 60 (default 300)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every number and the machine here")
    p.add_argument("--md", default=None, metavar="FILE", help="write the tables and the command here (markdown)")
    p.add_argument("--save", default=None, metavar="DIR", help="write DIR/p2p-<date>.json and .md")
    p.add_argument("--max-seconds", type=float, default=150.0,
                   help="start no further repeat round once this would be exceeded; 0: no limit (default 150)")
    p.add_argument("--timeout", type=float, default=None,
                   help="when relaunching on 2 ranks: kill the job after S seconds "
                        "(default: 3 x --max-seconds + 120, or none)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="varcomm-bench", description="varcomm microbenchmarks against their baselines.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True
    _p2p_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``varcomm-bench``)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(args_in)
    if a.cmd == "p2p":
        a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        bad = [m for m in a.methods if m not in METHODS]
        if bad:
            raise SystemExit(f"{_PREFIX}unknown method(s) {bad}; choose from {list(METHODS)}")
        a.sizes = _sizes(a.minbytes, a.maxbytes, a.stepfactor)
        if not _in_launcher():
            timeout = a.timeout if a.timeout is not None else (3 * a.max_seconds + 120 if a.max_seconds else None)
            return _relaunch(args_in, timeout)
        return _run_ranks(a)
    return 2


def _relaunch(args_in: list[str], timeout: float | None) -> int:
    """Not under a launcher: run this same command as 2 ranks through varcomm.run."""
    from . import __file__ as pkg_init, run

    pkg_root = str(Path(pkg_init).absolute().parents[1])  # where this varcomm was imported from
    pp = os.environ.get("PYTHONPATH", "")
    if pkg_root not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = pkg_root + (os.pathsep + pp if pp else "")
    os.environ.setdefault("VARCOMM_BENCH_CMD", shlex.join(getattr(sys, "orig_argv", sys.argv)))
    return run.launch([sys.executable, "-m", "varcomm.bench", *args_in], 2, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
