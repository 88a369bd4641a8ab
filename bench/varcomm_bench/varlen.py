"""varcomm-bench varlen: a pipeline-like stream of variable-size messages.

Ranks form a chain 0 -> 1 -> ... -> N-1 (pipeline stages): rank 0 sends one
message per micro-batch, middle ranks receive and forward it, the last rank
receives it. Message sizes vary per micro-batch; they are drawn (seeded, the
same on every rank and for every method) from --dist:

  uniform      sizes uniform in [1, 2m) elements, mean m = the point's size
  lognormal    lognormal with mean m and --sigma (default 0.8): a long tail
  file:PATH    the sizes in PATH (bytes, one per line, K/M suffixes allowed);
               one point at their mean, -b/-e ignored

The receiver does not know the sizes:
  varcomm   ``x = comm.recv(src)`` (size, dtype and shape in the message header)
  fallback  the same call on varcomm's fallback transport (the same writes over gloo)
  mpi4py    ``Probe`` + ``Get_count``, allocate, ``Recv`` (the MPI way)
  memcpy    one single-thread copy of each message (the one-copy limit)

A sample streams ``iters`` messages (a multiple of the --messages pool), then the
last stage sends rank 0 a one-byte ack; time = per message (the slowest rank),
algbw = busbw = mean message bytes / time.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from .core import (
    BenchError,
    Ctx,
    Method,
    MpiEP,
    Test,
    TorchEP,
    agree,
    d2d_method,
    init_comms,
    memcpy_method,
    parse_bytes,
    run_test,
    sweep,
)


def read_sizes(path: str) -> list[int]:
    """The sizes in a --dist file; ValueError saying what is wrong with it."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"file:{path}: no such file")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            v = parse_bytes(line)
        except ValueError:
            raise ValueError(f"file:{path}, line {i}: not a size: {line!r}") from None
        if v < 0:
            raise ValueError(f"file:{path}, line {i}: negative size")
        out.append(v)
    if not out:
        raise ValueError(f"file:{path}: no sizes in it")
    return out


def pool(dist: str, mean: int, k: int, itemsize: int, sigma: float = 0.8, seed: int = 0) -> list[int]:
    """k message sizes in bytes (multiples of itemsize, >= itemsize) with the given mean."""
    if dist.startswith("file:"):
        raw = read_sizes(dist[5:])
        return [max(itemsize, s - s % itemsize) for s in raw]
    rng = np.random.default_rng([seed, mean, k])
    m = max(1, mean // itemsize)  # elements
    if dist == "uniform":
        el = rng.integers(1, 2 * m, size=k) if m > 1 else np.ones(k, dtype=np.int64)
    elif dist == "lognormal":
        el = np.maximum(1, np.round(rng.lognormal(math.log(m) - sigma ** 2 / 2, sigma, size=k))).astype(np.int64)
    else:
        raise BenchError(f"--dist {dist!r}: use uniform, lognormal or file:PATH")
    return [int(e) * itemsize for e in el]


def run(ctx: Ctx) -> list[dict[str, Any]]:
    a = ctx.a
    if ctx.world < 2:
        raise SystemExit("varcomm-bench: varlen needs at least 2 ranks")
    isz = ctx.itemsize
    if a.dist.startswith("file:"):
        points = [pool(a.dist, 0, 0, isz)]
    else:
        points = [pool(a.dist, m, a.messages, isz, a.sigma) for m in sweep(a.minbytes, a.maxbytes, a.stepfactor)]
    cap = max(max(p) for p in points)
    ctx.buffers(cap)
    vc, fb, fb_why = init_comms(ctx, bound=cap, slots=a.slots)
    eps: dict[str, Any] = {"varcomm": TorchEP(ctx, vc, "varcomm")}
    if fb is not None:
        eps["fallback"] = TorchEP(ctx, fb, "fallback")
    if ctx.mpi is not None:
        eps["mpi4py"] = MpiEP(ctx)
    r, n_ranks = ctx.rank, ctx.world
    prev = r - 1 if r > 0 else None
    nxt = r + 1 if r < n_ranks - 1 else None

    def stream(ep: Any, sizes: list[int], n: int, w: int) -> tuple[float, int, int]:
        k = len(sizes)
        n = max(k, -(-n // k) * k)  # whole passes over the pool: every method sees the same sizes
        chk = a.check
        if chk:
            w = max(w, k)  # -c verifies one whole pass over the pool, untimed
        wrong = 0
        msgs = [ep.msg(s) for s in sizes] if prev is None else None
        t0 = 0.0
        for i in range(w + n):
            if i == w:
                ctx.sync()
                t0 = time.perf_counter()
            if prev is None:
                ep.send(msgs[i % k], nxt)  # type: ignore[index]  # made when prev is None
                continue
            x = ep.recv_new(prev)
            if chk and i < w:
                wrong += ep.bad(x, sizes[i % k])
            if nxt is not None:
                ep.send(x, nxt)
            del x
        # The last stage acks the whole stream to rank 0, so every method ends with the
        # same handshake (and a sender whose library only progresses inside its own
        # calls, MPI, keeps progressing until the last message is in).
        if nxt is None:
            ep.ack(0)
        elif prev is None:
            ep.wait_ack(n_ranks - 1)
        ctx.sync()
        return time.perf_counter() - t0, n, wrong

    def ep_method(name: str, reason: str | None) -> Method:
        def kernel(test: str, sizes: list[int], n: int, w: int) -> tuple[float, int, int]:
            return stream(eps[name], sizes, n, w)
        return Method(name, reason=reason, kernel=kernel)

    methods = [ep_method("varcomm", None), ep_method("fallback", fb_why), ep_method("mpi4py", ctx.mpi_reason),
               Method("libfabric", reason="fi_pingpong measures fixed-size ping-pong only"
                      if "libfabric" in a.baselines else "not selected"),
               memcpy_method(ctx, lambda sizes: sizes), d2d_method(ctx, lambda sizes: sizes)]
    agree(ctx, methods)
    dist = a.dist if not a.dist.startswith("lognormal") else f"lognormal(sigma={a.sigma:g})"
    notes = [f"{n_ranks}-stage chain, sizes from {dist}, a pool of {len(points[0])} sizes per point; "
             "size = mean message bytes; the receiver learns each size from the message"]
    t = Test("varlen", a.dist.split(":")[0] if a.dist.startswith("file:") else a.dist,
             f"varlen: variable-size stream through a {n_ranks}-stage pipeline ({dist})", points,
             size_of=lambda p: float(np.mean(p)), busbw_factor=1.0, notes=notes,
             short=f"varlen {n_ranks}-stage stream, {dist}",
             count_of=lambda p: float(np.mean(p)) / isz,
             extra=lambda p: {"min_size": int(min(p)), "max_size": int(max(p)), "pool": len(p)})
    res = run_test(ctx, t, methods)
    ctx.sync_all()
    if fb is not None:
        fb.close()
    vc.close()
    return [res] if res is not None else []
