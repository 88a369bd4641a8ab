"""varcomm-bench machinery shared by its subcommands: the per-rank context
(control channel, buffers, payload checks), the methods (varcomm and its
baselines, each skipped with a reason when missing) and the sweep loop that
takes every point as the median of repeats in rotated method order.

Timing rules (every subcommand):

* a sample = ``warmup`` untimed iterations, then ``iters`` timed ones;
  ``iters`` comes from ``-n`` or from calibration at the first repeat (the
  fastest of 3 short runs sets a count of about ``--sample-ms`` per sample,
  sent from rank 0 so every rank runs the same count);
* a point = the median of ``--repeats`` samples (min, max and all samples
  go to the JSON); the repeats of one size run in rounds over all methods,
  each round in a rotated order, so drifting load hits every method alike;
* host-blocked time: a collective kernel may also return the seconds the host
  spent in its calls (before the final device synchronize); the slowest
  rank's, per op, goes to the JSON (``host_us``) and to a table of its own;
* ``-c``: every message of every warm-up iteration is verified (sizes and
  bytes), so the timed iterations stay unperturbed; ``#wrong`` counts wrong
  messages (all-to-all: wrong results). ``VARCOMM_BENCH_CORRUPT=1`` (or a
  comma list of method names) flips a byte of each received message before
  the check: a test hook that proves ``-c`` catches corruption.
  ``VARCOMM_BENCH_TEST_RAISE_ON_RANK=r``: rank r raises once the job is up, a
  test hook that proves a failing rank stops the job at once.
"""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np

PREFIX = "varcomm-bench: "
CAL_RUNS = 3  # calibration runs per (method, size); the fastest sets the iteration count
CTL_TAG = 7_000_001

#: baseline names accepted by --baselines, in table order
BASELINES = ("two-phase", "fallback", "mpi4py", "libfabric", "memcpy", "d2d", "nccl")
LABELS = {
    "varcomm": "varcomm (torch tensors)",
    "varcomm-numpy": "varcomm (numpy buffers)",
    "varcomm-zerocopy": "varcomm (torch, zero-copy recv)",
    "varcomm-fresh": "varcomm (torch, a new tensor per recv)",
    "varcomm-empty": "varcomm (torch, out= a comm.empty buffer: written in place by the sender)",
    "mpi4py-fresh": "mpi4py (Probe, new buffer, Recv)",
    "mpi4py-torch": "mpi4py on varcomm's torch tensors (Send/Recv take them through DLPack)",
    "two-phase": "varcomm two-phase (counts first)",
    "fallback": "varcomm fallback (the same writes over gloo)",
    "mpi4py": "mpi4py + MPI",
    "libfabric": "raw libfabric fi_writedata (fi_pingpong)",
    "memcpy": "memcpy (1 thread, same buffers each time: cache-hot)",
    "d2d": "device-to-device copy",
    "nccl": "NCCL all_to_all_single, two-phase (counts, .tolist(), payload)",
}
SHORT = {"varcomm": "varcomm", "two-phase": "2-phase", "fallback": "fallback", "mpi4py": "mpi4py",
         "libfabric": "libfabric", "memcpy": "memcpy", "d2d": "d2d", "varcomm-numpy": "vc-numpy",
         "varcomm-zerocopy": "vc-0copy", "varcomm-fresh": "vc-fresh",
         "varcomm-empty": "vc-empty", "mpi4py-fresh": "mpi-fresh", "mpi4py-torch": "mpi-torch", "nccl": "nccl"}


class BenchError(SystemExit):
    def __init__(self, msg: str) -> None:
        super().__init__(PREFIX + msg)


# ---- small helpers -------------------------------------------------------------

def log(msg: str) -> None:
    print(PREFIX + msg, file=sys.stderr, flush=True)


def parse_bytes(s: str) -> int:
    """'8', '8B', '64K', '64KiB', '1M', '2G' -> bytes (powers of two)."""
    v = str(s).strip().upper().replace("IB", "").rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = mult[v[-1]] if v and v[-1] in mult else 1
    x = float(v[:-1] if scale > 1 else v) * scale
    if not math.isfinite(x):
        raise ValueError(f"{s!r} is not a finite size")
    return int(x)


def fmt_bytes(n: float) -> str:
    n = int(round(n))
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f}M"
    if n >= 10 << 10:
        return f"{n / 1024:.1f}K"
    return str(n)


def sweep(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 1 or hi < lo or factor < 2:
        raise BenchError(f"need 1 <= minbytes ({lo}) <= maxbytes ({hi}) and stepfactor ({factor}) >= 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def corrupting(method: str) -> bool:
    v = os.environ.get("VARCOMM_BENCH_CORRUPT", "").strip()
    return bool(v) and (v in ("1", "all") or method in v.split(","))


# ---- the per-rank context --------------------------------------------------------

class Ctx:
    """One rank: options, control channel, dtype/device, shared payload buffers."""

    def __init__(self, a: Any) -> None:
        import torch

        import varcomm

        torch.set_num_threads(1)
        self.a = a
        self.torch = torch
        self.varcomm = varcomm
        self.dtype = getattr(torch, a.dtype)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        if a.device == "cuda":
            lr = int(os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or 0)
            torch.cuda.set_device(lr % torch.cuda.device_count())  # before init: varcomm sees CUDA in use
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.ctl = varcomm.init(bound=1 << 12, slots=4, transport="auto", array="numpy", timeout=a.op_timeout)
        self.rank, self.world = self.ctl.rank, self.ctl.world_size
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
                               or self.world)
        self._f = np.zeros(8, dtype=np.float64)
        self.mpi, self.mpi_reason = self._mpi()
        self.cap = 0
        self.hostname = socket.gethostname()
        self.transport: str | None = None  # varcomm's route to the next rank (set by init_comms)
        self.transport_detail: str | None = None
        self.fi_provider_used: str | None = None  # the libfabric provider fi_pingpong was asked for
        self.fi_seen_provider: str | None = None  # and the one it reported

    # -- collective helpers over the control channel (shm: microseconds) --
    def gather(self, vals: Sequence[float]) -> np.ndarray | None:
        """Rank 0 gets a [world, len(vals)] array; other ranks None."""
        k = len(vals)
        mine = np.asarray(vals, dtype=np.float64)
        if self.rank != 0:
            self.ctl.send(mine, 0, tag=CTL_TAG)
            return None
        out = np.empty((self.world, k), dtype=np.float64)
        out[0] = mine
        buf = np.empty(k, dtype=np.float64)
        for r in range(1, self.world):
            out[r] = self.ctl.recv(r, tag=CTL_TAG, out=buf)  # buf, filled
        return out

    def bcast(self, vals: Sequence[float]) -> np.ndarray:
        k = len(vals)
        if self.rank == 0:
            mine = np.asarray(vals, dtype=np.float64)
            for r in range(1, self.world):
                self.ctl.send(mine, r, tag=CTL_TAG + 1)
            return mine
        return self.ctl.recv(0, tag=CTL_TAG + 1, out=np.empty(k, dtype=np.float64)).copy()

    def sync_all(self) -> None:
        """A fast barrier (gather + release over the control channel)."""
        self.gather([0.0])
        self.bcast([0.0])

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- MPI in-process, only when the job itself runs under an MPI launcher --
    def _mpi(self) -> tuple[Any, str | None]:
        a = self.a
        if "mpi4py" not in a.baselines:
            return None, "not selected"
        if a.device != "cpu":
            return None, "host buffers only (CUDA-aware MPI is not assumed)"
        if not any(os.environ.get(k) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
            why = os.environ.get("VARCOMM_BENCH_NO_MPI")
            return None, why or ("the job does not run under mpirun, so MPI cannot start in-process (start "
                                 "varcomm-bench without a launcher to get mpirun, or under mpirun -n N)")
        try:
            from mpi4py import MPI
        except Exception as e:
            return None, f"mpi4py not importable: {type(e).__name__}: {e}"
        if MPI.COMM_WORLD.Get_size() != self.world or MPI.COMM_WORLD.Get_rank() != self.rank:
            return None, "MPI world differs from the launcher's"
        return MPI, None

    def buffers(self, cap: int) -> None:
        """src (= the check pattern), dst (receive side) and the pattern, `cap` bytes each."""
        torch = self.torch
        cap = max(cap, 64)
        cap += (-cap) % 64
        if cap <= self.cap:
            return
        self.cap = cap
        # (251 bytes repeated: cap bytes, where an int32 arange % 251 took 8 x cap at once)
        pat = torch.arange(251, dtype=torch.uint8).repeat(cap // 251 + 1)[:cap].clone()
        self.pattern = pat.to(self.device)
        self.src = self.pattern.clone()
        self.dst = torch.zeros(cap, dtype=torch.uint8, device=self.device)
        self.ack_src = torch.ones(8, dtype=torch.uint8, device=self.device)
        self.ack_dst = torch.zeros(8, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            self.pattern_np, self.src_np, self.dst_np = self.pattern.numpy(), self.src.numpy(), self.dst.numpy()
            self.ack_src_np, self.ack_dst_np = self.ack_src.numpy(), self.ack_dst.numpy()

    def close(self) -> None:
        self.ctl.close()


# ---- endpoints: one interface over varcomm, its fallback and MPI -------------------

class _VarcommOps:
    """A varcomm Communicator's operations, whatever kind of buffer they carry;
    the ack buffers are the endpoint's own (`_acks`)."""

    ctx: Ctx
    comm: Any

    def __init__(self, ctx: Ctx, comm: Any, name: str) -> None:
        self.ctx, self.comm, self.name = ctx, comm, name
        self.corrupt = corrupting(name)

    def _acks(self) -> tuple[Any, Any]:
        return self.ctx.ack_src, self.ctx.ack_dst

    def send(self, x: Any, peer: int) -> None:
        self.comm.send(x, peer)

    def isend(self, x: Any, peer: int) -> Any:
        return self.comm.isend(x, peer)

    def wait(self, hs: list[Any]) -> None:
        for h in hs:
            h.wait()

    def recv(self, peer: int, out: Any) -> Any:
        return self.comm.recv(peer, out=out)

    def recv_new(self, peer: int) -> Any:
        return self.comm.recv(peer)

    def ack(self, peer: int) -> None:
        self.comm.send(self._acks()[0][:1], peer)

    def wait_ack(self, peer: int) -> None:
        self.comm.recv(peer, out=self._acks()[1])


class TorchEP(_VarcommOps):
    """varcomm (any transport) or its fallback: torch tensors on the bench device."""

    def msg(self, nbytes: int) -> Any:
        return self.ctx.src[:nbytes].view(self.ctx.dtype)

    def out(self) -> Any:
        c = self.ctx
        return c.dst[:c.cap - c.cap % c.itemsize].view(c.dtype)

    def clear(self, nbytes: int) -> None:
        self.ctx.dst[:nbytes].zero_()

    def bad(self, x: Any, nbytes: int) -> int:
        """1 if x is not the pattern's first nbytes (after the test-only corruption)."""
        torch = self.ctx.torch
        b = x.reshape(-1).view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8)
        if b.device != self.ctx.pattern.device:  # e.g. a GPU message received into host memory
            b = b.to(self.ctx.pattern.device)
        if self.corrupt and b.numel():
            b[:1].bitwise_xor_(0xFF)
        return int(b.numel() != nbytes or not torch.equal(b, self.ctx.pattern[:nbytes]))


class MpiEP:
    """mpi4py on numpy views of the same host buffers (Send/Recv of bytes)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.name = ctx, "mpi4py"
        self.MPI = ctx.mpi
        self.comm = ctx.mpi.COMM_WORLD
        self.status = ctx.mpi.Status()
        self.corrupt = corrupting("mpi4py")

    def msg(self, nbytes: int) -> Any:
        return self.ctx.src_np[:nbytes]

    def out(self) -> Any:
        return self.ctx.dst_np

    def clear(self, nbytes: int) -> None:
        self.ctx.dst_np[:nbytes] = 0

    def send(self, x: Any, peer: int) -> None:
        self.comm.Send([x, self.MPI.BYTE], peer)

    def isend(self, x: Any, peer: int) -> Any:
        return self.comm.Isend([x, self.MPI.BYTE], peer)

    def wait(self, hs: list[Any]) -> None:
        self.MPI.Request.Waitall(hs)

    def recv(self, peer: int, out: Any) -> Any:
        st = self.status
        self.comm.Recv([out, self.MPI.BYTE], peer, status=st)
        return out[:st.Get_count(self.MPI.BYTE)]

    def recv_new(self, peer: int) -> Any:
        """The receiver does not know the size: probe, allocate, receive."""
        st = self.status
        self.comm.Probe(peer, 0, st)
        buf = np.empty(st.Get_count(self.MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([buf, self.MPI.BYTE], peer)
        return buf

    def ack(self, peer: int) -> None:
        self.comm.Send([self.ctx.ack_src_np[:1], self.MPI.BYTE], peer)

    def wait_ack(self, peer: int) -> None:
        self.comm.Recv([self.ctx.ack_dst_np, self.MPI.BYTE], peer)

    def bad(self, x: Any, nbytes: int) -> int:
        if self.corrupt and x.size:
            x[0] ^= 0xFF
        return int(x.size != nbytes or not np.array_equal(x, self.ctx.pattern_np[:nbytes]))


class NumpyEP(_VarcommOps, MpiEP):
    """varcomm with numpy buffers (the buffer-protocol fast path), on MpiEP's host
    buffers: MpiEP's msg/out/clear/bad, varcomm's operations."""

    def _acks(self) -> tuple[Any, Any]:
        return self.ctx.ack_src_np, self.ctx.ack_dst_np


class FreshEP(TorchEP):
    """varcomm receiving a new tensor per message (no out=): the core sizes it
    from the header and copies into it."""

    def recv(self, peer: int, out: Any) -> Any:
        return self.comm.recv(peer)


class EmptyEP(TorchEP):
    """varcomm receiving into out= a buffer from comm.empty (the landing area):
    a large message is written there by its sender, one copy in all."""

    _buf: Any = None

    def _landing(self) -> Any:
        c = self.ctx
        if self._buf is None or self._buf.numel() < c.cap:
            self._buf = self.comm.empty(c.cap, "uint8", array="torch")
        return self._buf

    def out(self) -> Any:
        c = self.ctx
        return self._landing()[:c.cap - c.cap % c.itemsize].view(c.dtype)

    def clear(self, nbytes: int) -> None:
        self._landing()[:nbytes].zero_()


class MpiFreshEP(MpiEP):
    """mpi4py receiving into a new buffer per message, sized by a Probe (MPI's
    way to receive a message of unknown size)."""

    def recv(self, peer: int, out: Any) -> Any:
        return self.recv_new(peer)


class MpiTorchEP(MpiEP):
    """mpi4py on the torch tensors of varcomm's torch column, as a torch user
    calls it (mpi4py takes a tensor through DLPack), the message returned as a
    view of out's front as varcomm returns it: the baseline for varcomm's torch
    overhead, which numpy-buffer mpi4py does not pay."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.name = "mpi4py-torch"
        self.corrupt = corrupting(self.name)

    msg, out, clear, bad = TorchEP.msg, TorchEP.out, TorchEP.clear, TorchEP.bad

    def send(self, x: Any, peer: int) -> None:
        self.comm.Send([x, self.MPI.BYTE], peer)

    def isend(self, x: Any, peer: int) -> Any:
        return self.comm.Isend([x, self.MPI.BYTE], peer)

    def recv(self, peer: int, out: Any) -> Any:
        st = self.status
        self.comm.Recv([out, self.MPI.BYTE], peer, status=st)
        return out[:st.Get_count(self.MPI.BYTE) // self.ctx.itemsize]


class ZeroCopyEP(TorchEP):
    """varcomm receiving with copy=False: the result is a view of the receive slot
    (one copy per message in all), returned to the sender when dropped."""

    def recv(self, peer: int, out: Any) -> Any:
        return self.comm.recv(peer, copy=False)


# ---- methods -------------------------------------------------------------------------

class Method:
    """One column of the table. `where` = "all" (collective over the job) or "root"
    (rank 0 alone: memcpy, d2d, libfabric). `kernel(test, point, n, w)` returns
    (seconds for the n timed iterations or nan, timed ops, wrong messages), and
    a collective one optionally the host-blocked seconds of those iterations."""

    def __init__(self, name: str, where: str = "all", reason: str | None = None,
                 kernel: Callable[..., tuple[float, int, int] | tuple[float, int, int, float]] | None = None,
                 na: Callable[[str, Any], str | None] | None = None, checks: bool = True) -> None:
        self.name, self.where, self.reason, self.kernel = name, where, reason, kernel
        self._na = na
        self.checks = checks
        self.note: str | None = None
        self.failed: str | None = None  # a root-only method that broke mid-run (rank 0 only)
        self.size_failed: dict[int, str] = {}  # point index -> why (rank 0, external methods)
        self.agreed = False  # runs on this job: the same on every rank (see agree)

    def na(self, test: str, point: Any) -> str | None:
        return self._na(test, point) if self._na else None


def agree(ctx: Ctx, methods: list[Method]) -> None:
    """A method runs only if it is available on every rank (rank 0 states why not)."""
    ok = [0.0 if m.reason else 1.0 for m in methods]
    g = ctx.gather(ok)
    if ctx.rank == 0:
        for i, m in enumerate(methods):
            if m.reason is None and m.where == "all":
                bad = [r for r in range(ctx.world) if not g[r, i]]  # type: ignore[index]  # rank 0 has the table
                if bad:
                    m.reason = f"unavailable on rank(s) {bad}"
        ok = [0.0 if m.reason else 1.0 for m in methods]
    flags = ctx.bcast(ok)
    for m, f in zip(methods, flags):
        m.agreed = bool(f)
        if not f and m.reason is None:
            m.reason = "unavailable on rank 0"


# ---- the sweep -----------------------------------------------------------------------

class Test:
    """One table: a test of a subcommand over a list of points."""

    def __init__(self, bench: str, test: str, title: str, points: list[Any], size_of: Callable[[Any], float],
                 busbw_factor: float, notes: list[str] | None = None, short: str | None = None,
                 count_of: Callable[[Any], float] | None = None, extra: Callable[[Any], dict] | None = None) -> None:
        self.bench, self.test, self.title, self.points = bench, test, title, points
        self.short = short or title
        self.size_of, self.busbw_factor = size_of, busbw_factor
        self.notes = notes or []
        self.count_of = count_of
        self.extra = extra


def _calibrated_iters(a: Any, per_iter: float) -> int:
    if not per_iter > 0 or math.isnan(per_iter):
        return a.min_iters
    return int(max(a.min_iters, min(a.max_iters, round(a.sample_ms * 1e-3 / per_iter))))


def run_test(ctx: Ctx, t: Test, methods: list[Method], ext: dict[str, Callable[..., tuple[float, int]]]
             | None = None) -> dict[str, Any] | None:
    """Run one table's sweep; rank 0 returns its result dict (other ranks None).

    ext[name](point, prev) -> (seconds per op, iters): one sample of a root-only method
    measured by an external program, one launch per sample (libfabric); prev = the last
    (point, seconds per op) it measured. A size that fails is left out (noted); two
    failed sizes stop the method."""
    a = ctx.a
    active = [m for m in methods if m.agreed]  # never rank-local state: every rank runs the same order
    w = a.warmup
    samples: dict[str, dict[int, dict[str, Any]]] = {m.name: {} for m in methods}
    na_reasons: dict[str, str] = {}
    t_test = time.monotonic()
    prev_ext: dict[str, Any] = {}
    for pi, point in enumerate(t.points):
        t_pt = time.monotonic()
        iters: dict[str, int] = {}
        for rnd in range(a.repeats):
            k = (rnd + pi) % len(active) if active else 0
            order = active[k:] + active[:k]
            for m in order:
                why = m.na(t.test, point)
                if why:
                    na_reasons.setdefault(m.name, why)
                    continue
                rec = samples[m.name].setdefault(pi, {"t": [], "wrong": 0, "iters": None, "warmup": w})
                if m.where == "root":
                    if ctx.rank != 0 or m.failed:
                        continue
                    if ext and m.name in ext:
                        if (rnd > 0 and a.quick) or pi in m.size_failed:
                            continue  # --quick: one external run per size
                        try:
                            x, it = ext[m.name](point, prev_ext.get(m.name))
                        except RuntimeError as e:
                            m.size_failed[pi] = str(e)
                            log(f"{m.name} at {fmt_bytes(t.size_of(point))}: {e}")
                            if len(m.size_failed) >= 2:
                                m.failed = f"{len(m.size_failed)} sizes failed, the last: {e}"
                            continue
                        prev_ext[m.name] = (point, x)
                        rec["t"].append(x)
                        rec["iters"] = it
                        rec["wrong"] = None
                        rec["warmup"] = "internal"
                        continue
                    if m.name not in iters:
                        if a.iters:
                            iters[m.name] = a.iters
                        else:
                            per = min(_sample(ctx, m, t, point, a.cal_iters, w)[0] for _ in range(CAL_RUNS))
                            iters[m.name] = _calibrated_iters(a, per / a.cal_iters)
                    n = iters[m.name]
                    dt, ops, wrong = _sample(ctx, m, t, point, n, w)
                    rec["t"].append(dt / ops)
                    rec["iters"] = n
                    rec["wrong"] = rec["wrong"] + wrong if (a.check and m.checks) else None
                    continue
                # collective method
                ctx.sync_all()
                if m.name not in iters:
                    if a.iters:
                        iters[m.name] = a.iters
                    else:
                        per = math.inf  # the fastest of a few short runs: one stalled run must not set the count
                        for _ in range(CAL_RUNS):
                            ctx.sync_all()
                            g = ctx.gather([_sample(ctx, m, t, point, a.cal_iters, w)[0]])
                            if g is not None:
                                per = min(per, float(np.nanmax(g[:, 0])) / a.cal_iters)
                        iters[m.name] = int(ctx.bcast([_calibrated_iters(a, per if ctx.rank == 0 else 0.0)])[0])
                        ctx.sync_all()
                n = iters[m.name]
                res = _sample(ctx, m, t, point, n, w)
                dt, ops, wrong = res[:3]
                g = ctx.gather([dt, ops, wrong, res[3] if len(res) > 3 else math.nan])
                if g is not None:
                    i = int(np.nanargmax(np.where(np.isnan(g[:, 0]), -1, g[:, 0])))
                    rec["t"].append(float(g[i, 0] / g[i, 1]))
                    if not np.isnan(g[:, 3]).all():
                        rec.setdefault("host", []).append(float(np.nanmax(g[:, 3] / g[:, 1])))
                    rec["iters"] = n
                    rec["wrong"] = rec["wrong"] + int(g[:, 2].sum()) if a.check else None  # (every repeat's)
        if ctx.rank == 0 and not a.quiet:
            parts = []
            for m in methods:
                got = samples[m.name].get(pi)
                if got and got["t"]:
                    parts.append(f"{SHORT[m.name]} {fmt_time(np.median(got['t']) * 1e6)}")
            log(f"{t.bench} {t.test:<10} {fmt_bytes(t.size_of(point)):>7} "
                f"({pi + 1}/{len(t.points)}, {time.monotonic() - t_pt:5.2f} s): " + ", ".join(parts))
    ctx.sync_all()
    if ctx.rank != 0:
        return None
    return _result(ctx, t, methods, samples, na_reasons, time.monotonic() - t_test)


def _sample(ctx: Ctx, m: Method, t: Test, point: Any, n: int, w: int) -> tuple[float, ...]:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        return m.kernel(t.test, point, n, w)  # type: ignore[misc]  # agree() runs only methods with a kernel
    finally:
        if gc_was:
            gc.enable()


def fmt_time(us: float) -> str:
    if us is None or math.isnan(us):
        return "-"
    return f"{us:.2f} us" if us < 100 else f"{us:.0f} us" if us < 100_000 else f"{us / 1e6:.2f} s"


def _stats(v: list[float]) -> dict[str, Any]:
    return {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}


def _result(ctx: Ctx, t: Test, methods: list[Method], samples: dict[str, dict[int, dict[str, Any]]],
            na_reasons: dict[str, str], elapsed: float) -> dict[str, Any]:
    pts = []
    for pi, point in enumerate(t.points):
        nbytes = float(t.size_of(point))
        row: dict[str, Any] = {"size": nbytes, "count": t.count_of(point) if t.count_of else nbytes / ctx.itemsize,
                               "type": ctx.a.dtype, "methods": {}}
        if t.extra:
            row.update(t.extra(point))
        for m in methods:
            rec = samples[m.name].get(pi)
            if not rec or not rec["t"]:
                continue
            ts = rec["t"]
            bus = 1.0 if m.name in ("memcpy", "d2d") else t.busbw_factor
            algbw = [nbytes / x / 1e9 for x in ts]
            row["methods"][m.name] = {
                "time_us": {**{k: v * 1e6 for k, v in _stats(ts).items()}, "samples": [x * 1e6 for x in ts]},
                "algbw_gbps": {"median": float(nbytes / np.median(ts) / 1e9), "min": min(algbw), "max": max(algbw)},
                "busbw_gbps": {"median": float(nbytes / np.median(ts) / 1e9 * bus), "min": min(algbw) * bus,
                               "max": max(algbw) * bus},
                "wrong": rec["wrong"], "iters": rec["iters"], "warmup": rec["warmup"], "repeats": len(ts)}
            if rec.get("host"):
                row["methods"][m.name]["host_us"] = {k: v * 1e6 for k, v in _stats(rec["host"]).items()}
        v = row["methods"].get("varcomm")
        row["ratios"] = {b: row["methods"][b]["time_us"]["median"] / v["time_us"]["median"]
                         for b in row["methods"] if b != "varcomm" and v}
        pts.append(row)
    status: dict[str, dict[str, Any]] = {}
    for m in methods:
        have = any(m.name in p["methods"] for p in pts)
        if m.reason or (m.failed and not have):
            status[m.name] = {"label": LABELS[m.name], "status": "skipped", "reason": m.reason or m.failed}
        elif m.name in na_reasons and not any(m.name in p["methods"] for p in pts):
            status[m.name] = {"label": LABELS[m.name], "status": "n/a", "reason": na_reasons[m.name]}
        else:
            status[m.name] = {"label": LABELS[m.name], "status": "ok"}
            if m.name in na_reasons:
                status[m.name]["partial"] = na_reasons[m.name]
            fails = [f"{fmt_bytes(t.size_of(t.points[i]))}: {why}" for i, why in m.size_failed.items()
                     if i < len(t.points)]
            if fails:
                status[m.name]["failed_sizes"] = fails
            if m.note or m.failed or fails:
                status[m.name]["note"] = "; ".join(x for x in (
                    m.note, f"failed at {len(fails)} size(s) ({fails[0]})" if fails else None,
                    m.failed and "stopped after that") if x)
    return {"bench": t.bench, "test": t.test, "title": t.title, "short": t.short, "notes": t.notes, "ranks": ctx.world,
            "dtype": ctx.a.dtype, "device": ctx.a.device, "busbw_factor": t.busbw_factor,
            "elapsed_s": round(elapsed, 2), "methods": status, "points": pts}


# ---- method factories shared by the subcommands -----------------------------------------

def memcpy_method(ctx: Ctx, copies: Callable[[Any], list[int]]) -> Method:
    """Single-thread copy of the same bytes in one process (rank 0): `copies(point)` = the
    sizes copied, one after the other, per iteration (ops = iterations x len)."""
    reason = None if ctx.device.type == "cpu" else "host memory only (see d2d for --device cuda)"
    if "memcpy" not in ctx.a.baselines:
        reason = "not selected"

    def kernel(test: str, point: Any, n: int, w: int) -> tuple[float, int, int]:
        src, dst = ctx.src_np, ctx.dst_np
        sizes = copies(point)
        copyto = np.copyto
        pairs = [(dst[:s], src[:s]) for s in sizes]
        for _ in range(w):
            for d, s in pairs:
                copyto(d, s)
        t0 = time.perf_counter()
        for _ in range(n):
            for d, s in pairs:
                copyto(d, s)
        return time.perf_counter() - t0, n * len(sizes), 0

    return Method("memcpy", where="root", reason=reason, kernel=kernel, checks=False)


def d2d_method(ctx: Ctx, copies: Callable[[Any], list[int]]) -> Method:
    reason = None if ctx.device.type == "cuda" else "needs --device cuda"
    if "d2d" not in ctx.a.baselines:
        reason = "not selected"

    def kernel(test: str, point: Any, n: int, w: int) -> tuple[float, int, int]:
        src, dst = ctx.src, ctx.dst
        sizes = copies(point)
        pairs = [(dst[:s], src[:s]) for s in sizes]
        for _ in range(w):
            for d, s in pairs:
                d.copy_(s)
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            for d, s in pairs:
                d.copy_(s)
        ctx.sync()
        return time.perf_counter() - t0, n * len(sizes), 0

    return Method("d2d", where="root", reason=reason, kernel=kernel, checks=False)


def init_comms(ctx: Ctx, bound: int, slots: int) -> tuple[Any, Any, str | None]:
    """(varcomm comm with --transport, fallback comm or None, why no fallback). Every
    rank creates them in the same order."""
    a = ctx.varcomm
    opts = ctx.a
    bound = max(bound, 64)  # (the smallest bound varcomm takes: a sweep of 8-32 B sizes asks for less)
    vc = a.init(bound=bound, slots=slots, transport=opts.transport, array="torch", timeout=opts.op_timeout)
    try:  # informational: the route to the next rank, by name and described
        peer = (ctx.rank + 1) % ctx.world
        ctx.transport, ctx.transport_detail = vc.transport_for(peer), vc.describe_transport(peer)
    except Exception:
        pass
    fb, why = None, None
    if "fallback" not in opts.baselines:
        why = "not selected"
    elif opts.transport == "fallback":
        why = "--transport fallback: varcomm itself is the fallback"
    else:
        try:
            fb = a.init(bound=bound, slots=slots, transport="fallback", array="torch", timeout=opts.op_timeout)
        except Exception as e:  # symmetric on every rank: report and go on
            why = f"varcomm.init(transport='fallback') failed: {type(e).__name__}: {e}"
    return vc, fb, why


# ---- raw libfabric (fi_pingpong.c, beside this file) ------------------------------------

FI_SRC = Path(__file__).with_name("fi_pingpong.c")


def fi_binary(ctx: Ctx) -> tuple[str | None, str | None]:
    """(path, None) or (None, why). Builds fi_pingpong from the fi_pingpong.c next to
    this module when missing or stale and libfabric's pkg-config file is there: into
    this folder when it is writable (a checkout or an editable install), else /tmp."""
    a = ctx.a
    if a.fi_pingpong:
        p = Path(a.fi_pingpong)
        return (str(p), None) if os.access(p, os.X_OK) else (None, f"--fi-pingpong {p}: not executable")
    src = FI_SRC
    if not src.is_file():
        return None, f"{src} is missing from this install of varcomm_bench (or pass --fi-pingpong PATH)"
    exe = src.with_suffix("")
    if not os.access(exe.parent, os.W_OK):
        exe = Path("/tmp") / f"varcomm-fi_pingpong-{os.getuid()}"
    if os.access(exe, os.X_OK) and exe.stat().st_mtime >= src.stat().st_mtime:
        return str(exe), None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not shutil.which("pkg-config"):
        return None, "pkg-config not found: cannot locate libfabric to build fi_pingpong"
    r = subprocess.run(["pkg-config", "--cflags", "--libs", "libfabric"], capture_output=True, text=True)
    if r.returncode != 0:
        return None, "libfabric not found by pkg-config (apt-get install libfabric-dev)"
    if not cc:
        return None, "no C compiler (cc) to build fi_pingpong"
    b = subprocess.run([cc, "-O2", str(src), "-o", str(exe), *r.stdout.split()], capture_output=True, text=True)
    if b.returncode != 0:
        tail = " | ".join((b.stderr or b.stdout).strip().splitlines()[-2:])
        return None, f"building fi_pingpong from {src} failed: {tail}"
    log(f"built {exe} from {src}")
    return str(exe), None


def fi_provider(ctx: Ctx, vc: Any) -> str:
    """The provider the raw baseline uses: --fi-provider, else varcomm's (_rdma_provider)."""
    return ctx.a.fi_provider or _rdma_provider(vc)


def _rdma_provider(comm: Any) -> str:
    """The libfabric provider varcomm's rdma route to a peer chose (the core's
    route_info, never describe text); "shm", libfabric's same-host provider, when
    no peer is on rdma (fi_pingpong forks both sides on one host)."""
    for peer in range(comm.world_size):
        info = comm.route_info(peer)
        if info["route"] == "rdma":
            return info["provider"]
    return "shm"


def fi_runner(ctx: Ctx, exe: str, provider: str) -> Callable[..., tuple[float, int]]:
    """One fi_pingpong launch = one sample of one size (its multi-size runs can hang)."""
    env = dict(os.environ)
    env["FI_PROVIDER"] = provider.replace(";", ",")  # load only the providers it needs (faster start)
    a = ctx.a

    def run(nbytes: int, prev: Any) -> tuple[float, int]:
        if a.iters:
            n = a.iters
        elif prev is None:
            n = 20
        else:  # the previous size's latency, scaled by size: a pessimistic estimate
            psize, plat = prev
            n = _calibrated_iters(a, 2 * plat * max(1.0, nbytes / psize))
        n = max(5, min(n, 2000))
        est = (prev[1] * max(1.0, nbytes / prev[0])) if prev else 1e-3
        limit = min(a.fi_timeout, max(5.0, 50 * est * 2 * (n * 1.1 + 2)))
        cmd = [exe, "-p", provider, "-n", str(n), "-s", str(nbytes)]
        # Its own session: on a timeout the forked peer (still polling) dies with it.
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)  # (it closes its endpoint: the shm provider's /dev/shm file goes)
            try:
                p.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
            raise RuntimeError(f"fi_pingpong -p '{provider}' -s {nbytes} -n {n} hung (killed after "
                               f"{limit:.0f} s)") from None
        finally:
            if p.poll() is None:  # (^C, an error: SIGTERM first, so it closes its endpoint)
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        out = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        if p.returncode != 0 or len(out) != 1:
            tail = " | ".join((stderr or stdout).strip().splitlines()[-2:])
            raise RuntimeError(f"fi_pingpong -p '{provider}' failed (exit {p.returncode}): {tail}")
        ctx.fi_seen_provider = out[0].get("provider")
        return float(out[0]["lat_us"]) * 1e-6, int(out[0]["iters"])

    return run
