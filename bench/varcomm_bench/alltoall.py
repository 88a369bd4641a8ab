"""varcomm-bench alltoall: all-to-all-v of [T, hidden] token rows on every rank.

Per iteration each rank sends rows[r, d] rows to rank d; the receivers learn the
counts and the output is allocated once they are known, as a training framework
does. Routing (--routing, a comma list makes one table each):

  uniform     T/n rows to every rank
  zipf        each token goes to one of 4n experts drawn from a Zipf law (a = 1.2),
              experts sharded contiguously: rank 0 gets most of the traffic
  all-to-one  every rank sends all its rows to rank 0

Methods:
  varcomm    varcomm.collectives.alltoall.all_to_all_v: one message per pair, the row count in
             its header, no count exchange
  two-phase  the same transport running the conventional algorithm (a count message
             per pair, then the payload): what the count exchange costs
  fallback   all_to_all_v over varcomm's fallback transport (the same writes over gloo)
  mpi4py     comm.Alltoall of the counts, then comm.Alltoallv (bytes)
  memcpy     one single-thread copy of a rank's send buffer (the one-copy limit)
  d2d        --device cuda: one device-to-device copy of a rank's send buffer
  nccl       --device cuda: torch.distributed all_to_all_single on NCCL in the
             conventional two-phase form: an all-to-all of the counts, .tolist()
             (the device-to-host sync), allocate, the payload (NCCL needs a GPU
             per rank: skipped where ranks share one)

--device cuda: the tensors are CUDA tensors and varcomm's all_to_all_v runs
on the device path (nvlink between same-host ranks, ordered on the current
stream). Besides time per op and algbw, a second table gives the host-blocked
time per op: how long the host spent inside the calls (varcomm's never waits
on the GPU; the two-phase NCCL form waits in .tolist()).

size = S, the mean bytes a rank sends (its whole buffer, own chunk included, as
nccl-tests count it); time = the slowest rank's time per all-to-all;
algbw = S / time; busbw = algbw * (n-1)/n (nccl-tests' all-to-all convention).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .core import (
    BenchError,
    Ctx,
    Method,
    Test,
    agree,
    corrupting,
    d2d_method,
    init_comms,
    log,
    memcpy_method,
    run_test,
    sweep,
)

ROUTINGS = ("uniform", "zipf", "all-to-one")


def splits_matrix(routing: str, per_rank_bytes: int, n: int, row_bytes: int) -> np.ndarray:
    """rows[s, d]: token rows rank s sends rank d. The same on every rank."""
    tokens = max(per_rank_bytes // row_bytes, n)
    if routing == "uniform":
        return np.full((n, n), tokens // n, dtype=np.int64)
    if routing == "all-to-one":
        m = np.zeros((n, n), dtype=np.int64)
        m[:, 0] = tokens
        return m
    if routing == "zipf":
        m = np.zeros((n, n), dtype=np.int64)
        experts = 4 * n
        p = 1.0 / np.arange(1, experts + 1) ** 1.2
        for s in range(n):
            rng = np.random.default_rng([per_rank_bytes, s])
            e = rng.choice(experts, size=tokens, p=p / p.sum())
            m[s] = np.bincount(e // 4, minlength=n)
        return m
    raise BenchError(f"--routing {routing!r}: use {', '.join(ROUTINGS)}")


def make_mpi_op(comm: Any, x: np.ndarray, counts: np.ndarray, row_bytes: int) -> Any:
    """One conventional all-to-all-v: Alltoall of the row counts, allocate the output,
    Alltoallv of the rows (as bytes). Returns a callable -> [rows, row_bytes] uint8."""
    from mpi4py import MPI

    n = comm.size
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    sdispl = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) * row_bytes
    scounts = counts * row_bytes
    xb = x.reshape(-1).view(np.uint8)

    def once() -> np.ndarray:
        rc = np.empty(n, dtype=np.int64)
        comm.Alltoall(counts, rc)  # the count exchange
        out = np.empty((int(rc.sum()), row_bytes), dtype=np.uint8)
        rdispl = np.concatenate([[0], np.cumsum(rc)[:-1]]) * row_bytes
        comm.Alltoallv([xb, (scounts, sdispl), MPI.BYTE], [out, (rc * row_bytes, rdispl), MPI.BYTE])
        return out

    return once


def run(ctx: Ctx) -> list[dict[str, Any]]:
    from varcomm.collectives import alltoall as A

    a = ctx.a
    torch = ctx.torch
    n, r = ctx.world, ctx.rank
    hidden, isz = a.hidden, ctx.itemsize
    rb = hidden * isz
    routings = [x.strip() for x in a.routing.split(",") if x.strip()]
    sizes, seen = [], set()
    for s in sweep(a.minbytes, a.maxbytes, a.stepfactor):
        tokens = max(s // rb, n)  # sizes below n rows collapse onto n rows: keep one
        if tokens not in seen:
            seen.add(tokens)
            sizes.append(s)
    mats = {(rt, s): splits_matrix(rt, s, n, rb) for rt in routings for s in sizes}
    bound = max(max(int(m.max()) for m in mats.values()) * rb, 1 << 16)
    cap = max(int(m.sum(axis=1).max()) for m in mats.values()) * rb
    ctx.buffers(cap)
    vc, fb, fb_why = init_comms(ctx, bound=bound, slots=2)
    if ctx.device.type != "cpu":  # one all_to_all_v of CUDA tensors first: a failure skips the bench with its reason
        try:
            A.all_to_all_v(vc, torch.zeros((n, hidden), dtype=ctx.dtype, device=ctx.device), [1] * n)
        except Exception as e:
            if r == 0:
                log(f"alltoall skipped: all_to_all_v on {ctx.device}: {type(e).__name__}: {e}")
            ctx.sync_all()
            if fb is not None:
                fb.close()
            vc.close()
            return []
    xs: dict[tuple[str, int], Any] = {}

    def inputs(rt: str, s: int) -> tuple[Any, list[int], Any]:
        if (rt, s) not in xs:
            m = mats[(rt, s)]
            x = torch.full((int(m[r].sum()), hidden), r, dtype=ctx.dtype, device=ctx.device)
            want = torch.repeat_interleave(torch.arange(n), torch.from_numpy(m[:, r])).to(ctx.dtype)
            want = want.to(ctx.device)[:, None].expand(-1, hidden).contiguous()
            xs.clear()  # one point's buffers at a time
            xs[(rt, s)] = (x, m[r].tolist(), want)
        return xs[(rt, s)]

    def bad(name: str, got: Any, want: Any) -> int:
        if got.numel() and corrupting(name):
            got.reshape(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)
        return int(got.shape != want.shape or not torch.equal(got, want))

    def varcomm_kernel(name: str, comm: Any, algorithm: str) -> Any:
        def kernel(test: str, p: tuple[str, int], iters: int, w: int) -> tuple[float, int, int, float]:
            x, mine, want = inputs(*p)
            old = comm.options
            comm.options = old.override(a2a_algorithm=algorithm)
            try:
                wrong = 0
                for _ in range(w):
                    got, _splits = A.all_to_all_v(comm, x, mine)
                    if a.check:
                        wrong += bad(name, got, want)
                    del got
                ctx.sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    A.all_to_all_v(comm, x, mine)
                host = time.perf_counter() - t0
                ctx.sync()
                return time.perf_counter() - t0, iters, wrong, host
            finally:
                comm.options = old
        return kernel

    nccl_why = _nccl_reason(ctx)
    nccl: dict[str, Any] = {}

    def nccl_kernel(test: str, p: tuple[str, int], iters: int, w: int) -> tuple[float, int, int, float]:
        dist = nccl["dist"]
        x, mine, want = inputs(*p)
        counts = torch.tensor(mine, dtype=torch.int64, device=ctx.device)
        rc = torch.empty(n, dtype=torch.int64, device=ctx.device)

        def once() -> Any:
            dist.all_to_all_single(rc, counts)  # the count exchange
            got = rc.tolist()  # the device-to-host sync before the payload can be posted
            out = torch.empty((sum(got), hidden), dtype=ctx.dtype, device=ctx.device)
            dist.all_to_all_single(out, x, got, mine)
            return out

        wrong = 0
        for _ in range(w):
            got = once()
            if a.check:
                wrong += bad("nccl", got, want)
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        host = time.perf_counter() - t0
        ctx.sync()
        return time.perf_counter() - t0, iters, wrong, host

    def mpi_kernel(test: str, p: tuple[str, int], iters: int, w: int) -> tuple[float, int, int]:
        x, _mine, want = inputs(*p)
        m = mats[p]
        op = make_mpi_op(ctx.mpi.COMM_WORLD, x.view(torch.uint8).numpy(), m[r], rb)
        wrong = 0
        for _ in range(w):
            got = op()
            if a.check:
                # (a rank that receives no rows gets an empty array numpy may give stride 0: no view of it)
                g = (torch.from_numpy(got).view(ctx.dtype).view(-1, hidden) if got.size
                     else torch.empty(0, hidden, dtype=ctx.dtype))
                wrong += bad("mpi4py", g, want)
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        return time.perf_counter() - t0, iters, wrong

    two_why = None if "two-phase" in a.baselines else "not selected"
    methods = [Method("varcomm", kernel=varcomm_kernel("varcomm", vc, "auto")),
               Method("two-phase", reason=two_why, kernel=varcomm_kernel("two-phase", vc, "two-phase")),
               Method("fallback", reason=fb_why, kernel=varcomm_kernel("fallback", fb, "auto") if fb else None),
               Method("mpi4py", reason=ctx.mpi_reason, kernel=mpi_kernel),
               Method("libfabric", reason="fi_pingpong measures ping-pong only"
                      if "libfabric" in a.baselines else "not selected"),
               memcpy_method(ctx, lambda p: [int(mats[p].sum(axis=1)[0]) * rb]),
               d2d_method(ctx, lambda p: [int(mats[p].sum(axis=1)[0]) * rb]),
               Method("nccl", reason=nccl_why, kernel=nccl_kernel)]
    agree(ctx, methods)
    if methods[-1].agreed:  # every rank has NCCL: the group's creation is collective
        import torch.distributed as dist

        dist.init_process_group("nccl", store=dist.PrefixStore("varcomm-bench-nccl/", ctx.ctl._store),
                                rank=r, world_size=n, device_id=ctx.device)
        nccl["dist"] = dist
    if ctx.device.type == "cuda" and r == 0 and n > 1:
        log(f"alltoall --device cuda: CUDA tensors to rank 1 go by "
            f"{vc.device_transport_for(1) or 'host staging (no device route)'}")
    results = []
    for rt in routings:
        pts = [(rt, s) for s in sizes]
        t = Test("alltoall", rt, f"alltoall-v, {rt} routing, {n} ranks, [T, {hidden}] rows", pts,
                 size_of=lambda p: float(mats[p].sum()) * rb / n, busbw_factor=(n - 1) / n,
                 short=f"alltoall-v {rt}, {n} ranks",
                 notes=[f"size = S, mean bytes a rank sends; rows of {hidden} x {a.dtype}"],
                 extra=lambda p: {"rows_matrix": mats[p].tolist()})
        res = run_test(ctx, t, methods)
        if res is not None:
            results.append(res)
    ctx.sync_all()
    if "dist" in nccl:
        nccl["dist"].destroy_process_group()
    if fb is not None:
        fb.close()
    vc.close()
    return results


def _nccl_reason(ctx: Ctx) -> str | None:
    """Why the NCCL baseline cannot run here (None: it can)."""
    if "nccl" not in ctx.a.baselines:
        return "not selected"
    if ctx.device.type != "cuda":
        return "needs --device cuda"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch has no NCCL"
    gpus = ctx.torch.cuda.device_count()
    if gpus < ctx.local_world:
        return f"NCCL needs a GPU per rank: {ctx.local_world} ranks share {gpus} GPU(s) on this host"
    return None

