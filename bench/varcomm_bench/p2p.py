"""varcomm-bench p2p: ranks 0 and 1 (others idle).

  latency  ping-pong; time = half the round trip; algbw = busbw = size / time
  unibw    rank 0 posts a window of W isends, rank 1 receives them and sends one
           ack; time = window time / W; algbw = busbw = size / time
  bibw     both ranks post W isends to each other and receive W at once;
           time = window time / W; algbw = size / time (one direction),
           busbw = 2 x algbw (both directions)

varcomm: ``comm.send(x, peer)`` / ``comm.recv(peer, out=buf)`` with torch tensors of
--dtype, ``buf`` bound-sized and preallocated (the receiver does not pass the size);
varcomm-fresh: ``comm.recv(peer)``, a new tensor per message; varcomm-empty:
``recv(peer, out=buf)`` with ``buf = comm.empty(...)`` (the landing area: a large
message is written there by its sender); mpi4py-fresh: Probe, a new buffer, Recv;
mpi4py-torch: mpi4py's Send/Recv on the torch column's tensors (through DLPack).
"""
from __future__ import annotations

import math
import time
from typing import Any

from .core import (
    Ctx,
    EmptyEP,
    FreshEP,
    Method,
    MpiEP,
    MpiFreshEP,
    MpiTorchEP,
    NumpyEP,
    Test,
    TorchEP,
    ZeroCopyEP,
    agree,
    d2d_method,
    fi_binary,
    fi_provider,
    fi_runner,
    init_comms,
    memcpy_method,
    run_test,
    sweep,
)

TESTS = ("latency", "unibw", "bibw")
SHORT_TITLES = {"latency": "p2p latency (half round trip)", "unibw": "p2p unidirectional bandwidth",
                "bibw": "p2p bidirectional bandwidth"}
TITLES = {"latency": "p2p latency: ping-pong, time = half round trip",
          "unibw": "p2p unidirectional bandwidth: window of W isends, then one ack",
          "bibw": "p2p bidirectional bandwidth: both ranks stream W messages at once"}


def _latency(ctx: Ctx, ep: Any, nbytes: int, n: int, w: int) -> tuple[float, int, int]:
    r = ctx.rank
    if r > 1:
        return math.nan, 0, 0
    chk = ctx.a.check
    src, out = ep.msg(nbytes), ep.out()
    send, recv = ep.send, ep.recv
    wrong = 0
    if r == 0:
        for _ in range(w):
            send(src, 1)
            if chk:
                ep.clear(nbytes)
            x = recv(1, out)
            if chk:
                wrong += ep.bad(x, nbytes)
            del x
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            send(src, 1)
            recv(1, out)
        ctx.sync()
        return time.perf_counter() - t0, 2 * n, wrong
    for i in range(w + n):
        if chk and i < w:
            ep.clear(nbytes)
            x = recv(0, out)
            wrong += ep.bad(x, nbytes)  # a corrupted message travels back: rank 0 sees it too
        else:
            x = recv(0, out)
        send(x, 0)
        del x
    return math.nan, 0, wrong


def _unibw(ctx: Ctx, ep: Any, nbytes: int, n: int, w: int) -> tuple[float, int, int]:
    r, W = ctx.rank, ctx.a.window
    if r > 1:
        return math.nan, 0, 0
    chk = ctx.a.check
    src, out = ep.msg(nbytes), ep.out()
    wrong = 0
    if r == 0:
        t0 = 0.0
        for i in range(w + n):
            if i == w:
                ctx.sync()
                t0 = time.perf_counter()
            ep.wait([ep.isend(src, 1) for _ in range(W)])
            ep.wait_ack(1)
        ctx.sync()
        return time.perf_counter() - t0, n * W, 0
    for i in range(w + n):
        c = chk and i < w
        for _ in range(W):
            if c:
                ep.clear(nbytes)
            x = ep.recv(0, out)
            if c:
                wrong += ep.bad(x, nbytes)
        del x
        ep.ack(0)
    return math.nan, 0, wrong


def _bibw(ctx: Ctx, ep: Any, nbytes: int, n: int, w: int) -> tuple[float, int, int]:
    r, W = ctx.rank, ctx.a.window
    if r > 1:
        return math.nan, 0, 0
    peer = 1 - r
    chk = ctx.a.check
    src, out = ep.msg(nbytes), ep.out()
    wrong = 0
    t0 = 0.0
    for i in range(w + n):
        if i == w:
            ctx.sync()
            t0 = time.perf_counter()
        c = chk and i < w
        hs = [ep.isend(src, peer) for _ in range(W)]
        for _ in range(W):
            if c:
                ep.clear(nbytes)  # the outgoing src is another buffer: safe to clear
            x = ep.recv(peer, out)
            if c:
                wrong += ep.bad(x, nbytes)
        del x
        ep.wait(hs)
    ctx.sync()
    return time.perf_counter() - t0, n * W, wrong


KERNELS = {"latency": _latency, "unibw": _unibw, "bibw": _bibw}


def run(ctx: Ctx) -> list[dict[str, Any]]:
    a = ctx.a
    if ctx.world < 2:
        raise SystemExit("varcomm-bench: p2p needs at least 2 ranks")
    sizes = _sizes(ctx, a)
    tests = [t for t in a.tests if t in TESTS]
    cap = max(sizes)
    ctx.buffers(cap)
    vc, fb, fb_why = init_comms(ctx, bound=cap, slots=max(2, a.window))
    eps: dict[str, Any] = {"varcomm": TorchEP(ctx, vc, "varcomm")}
    host = ctx.device.type == "cpu"
    if host:  # the same communicator through numpy buffers, and with zero-copy receives
        eps["varcomm-numpy"] = NumpyEP(ctx, vc, "varcomm-numpy")
        eps["varcomm-zerocopy"] = ZeroCopyEP(ctx, vc, "varcomm-zerocopy")
        eps["varcomm-fresh"] = FreshEP(ctx, vc, "varcomm-fresh")
        eps["varcomm-empty"] = EmptyEP(ctx, vc, "varcomm-empty")
    if fb is not None:
        eps["fallback"] = TorchEP(ctx, fb, "fallback")
    if ctx.mpi is not None:
        eps["mpi4py"] = MpiEP(ctx)
        eps["mpi4py-fresh"] = MpiFreshEP(ctx)
        if host:
            eps["mpi4py-torch"] = MpiTorchEP(ctx)

    def ep_method(name: str, reason: str | None) -> Method:
        def kernel(test: str, nbytes: int, n: int, w: int) -> tuple[float, int, int]:
            return KERNELS[test](ctx, eps[name], nbytes, n, w)

        na = None
        if name == "fallback":
            def na(test: str, nbytes: int) -> str | None:
                return f"sizes over --fallback-maxbytes {a.fallback_maxbytes}" if nbytes > a.fallback_maxbytes \
                    else None
        return Method(name, reason=reason, kernel=kernel, na=na)

    methods = [ep_method("varcomm", None),
               ep_method("varcomm-numpy", None if host else "host memory only"),
               ep_method("varcomm-zerocopy", None if host else "host memory only"),
               ep_method("varcomm-fresh", None if host else "host memory only"),
               ep_method("varcomm-empty", None if host else "host memory only"),
               ep_method("fallback", fb_why), ep_method("mpi4py", ctx.mpi_reason),
               ep_method("mpi4py-fresh", ctx.mpi_reason),
               ep_method("mpi4py-torch", ctx.mpi_reason or (None if host else "host memory only"))]
    fi = Method("libfabric", where="root", na=lambda test, s: None if test == "latency" else
                "fi_pingpong measures ping-pong latency only", checks=False)
    ext = {}
    if "libfabric" not in a.baselines:
        fi.reason = "not selected"
    elif ctx.device.type != "cpu":
        fi.reason = "host memory only"
    elif ctx.local_world < ctx.world:
        fi.reason = "ranks span hosts; fi_pingpong's forked mode runs on one host"
    elif ctx.rank == 0:
        exe, why = fi_binary(ctx)
        if why:
            fi.reason = why
        else:
            prov = fi_provider(ctx, vc)
            fi.note = f"provider {prov}; payloads not verified by fi_pingpong"
            ctx.fi_provider_used = prov
            ext["libfabric"] = fi_runner(ctx, exe, prov)  # type: ignore[arg-type]  # no why: a path
    methods += [fi, memcpy_method(ctx, lambda s: [s]), d2d_method(ctx, lambda s: [s])]
    agree(ctx, methods)
    results = []
    for test in tests:
        t = Test("p2p", test, TITLES[test], sizes, size_of=lambda s: s, short=SHORT_TITLES[test],
                 busbw_factor=2.0 if test == "bibw" else 1.0,
                 notes=[f"window W = {a.window}"] if test != "latency" else [])
        res = run_test(ctx, t, methods, ext)
        if res is not None:
            results.append(res)
    ctx.sync_all()
    if fb is not None:
        fb.close()
    vc.close()
    return results


def _sizes(ctx: Ctx, a: Any) -> list[int]:
    isz = ctx.itemsize
    out = []
    for s in sweep(a.minbytes, a.maxbytes, a.stepfactor):
        s = max(isz, s - s % isz)
        if s not in out:
            out.append(s)
    return out
