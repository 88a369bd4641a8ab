"""MoE dispatch + combine on GPUs: varcomm's device-split path against its
baselines, in one run (same ranks, same routing, same tensors).

    varcomm-bench moe [--nranks 2] [--tokens 4096] [--hidden 4096] [--topk 8] [--experts 64]
                      [--dtype bf16] [--routing uniform|zipf] [--iters 20] [--warmup 5] [--json FILE]
    python -m varcomm_bench.moe ...                     (the same)

Started outside a launcher it relaunches itself on --nranks local ranks
(python -m varcomm.run); each rank uses GPU LOCAL_RANK % device_count.
Needs CUDA torch; ``--help`` works anywhere.

Rows (one op = one dispatch plus one combine, identity experts):

  varcomm device   moe.dispatch / moe.combine with topk_ids on the GPU: the
                   routing and the counts stay on the device
                   (all_to_all_vdev_2d / _2d_offset kernels over CUDA IPC)
  nccl two-phase   the conventional path: counts per rank by all_to_all_single,
                   .tolist() (a host sync), then the payload all_to_all_single,
                   and the same back for combine (torch.distributed, NCCL)
  symm_mem vdev    torch.ops.symm_mem.all_to_all_vdev_2d / _2d_offset (NVSHMEM),
                   where this torch has them and NVSHMEM initialises; else
                   skipped with the reason
  d2d copy         one device-to-device copy of the dispatched bytes, twice
                   (dispatch + combine): the memory-bandwidth ceiling

Columns: time per op (median over iterations of the slowest rank, CUDA
events), algbw (bytes a rank dispatches and gets back, 2 x T x topk x H x
itemsize, per second), host-blocked time per op (wall time of the Python
calls with the GPU kept busy ahead of them by torch.cuda._sleep, so only
what blocks the host counts: ~0 for device splits, the full GPU backlog
for a path that syncs), and the ratio to nccl two-phase.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

_LAUNCH_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="varcomm-bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from .cli import _at_least  # (the main command's integer checks)

    p.add_argument("--nranks", type=_at_least(2), default=2, help="local ranks when not under a launcher (default 2)")
    p.add_argument("--tokens", type=_at_least(1), default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=_at_least(1), default=4096, help="elements per token (default 4096)")
    p.add_argument("--topk", type=_at_least(1), default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=_at_least(1), default=64,
                   help="experts in all, a multiple of the ranks (default 64)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="token dtype (default bf16)")
    p.add_argument("--routing", default="uniform", choices=("uniform", "zipf"), help="expert choice (default uniform)")
    p.add_argument("--iters", type=_at_least(1), default=20, help="timed iterations (default 20)")
    p.add_argument("--warmup", type=_at_least(0), default=5, help="untimed iterations first (default 5)")
    p.add_argument("--device", default="cuda", choices=("cuda",), help="only cuda: this bench is for GPUs")
    p.add_argument("--json", default=None, help="write the results here too (rank 0)")
    return p


def _in_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCH_VARS)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.experts % a.nranks and not _in_launcher():
        _parser().error(f"--experts {a.experts} is not a multiple of --nranks {a.nranks}")
    if a.topk > a.experts:
        _parser().error(f"--topk {a.topk} is more than --experts {a.experts}")
    if not _in_launcher():
        import torch

        if not torch.cuda.is_available():  # (said once, before any rank starts)
            _parser().error("this benchmark is for GPUs and torch sees no CUDA GPU here (torch.cuda.is_available() "
                            "is False); the CPU benchmarks are varcomm-bench p2p and alltoall")
        import subprocess

        cmd = [sys.executable, "-m", "varcomm.run", "-n", str(a.nranks), "--tag-output", "-m", "varcomm_bench.moe",
               *(sys.argv[1:] if argv is None else argv)]
        try:
            return subprocess.call(cmd)
        except KeyboardInterrupt:
            return 130
    return _run(a)


def _routing(torch: Any, a: argparse.Namespace, it: int, rank: int, dev: Any) -> Any:
    g = torch.Generator().manual_seed(1000 * it + rank)
    if a.routing == "uniform":
        scores = torch.rand(a.tokens, a.experts, generator=g)
    else:  # zipf-like popularity: expert e weighted 1 / (e + 1)
        w = 1.0 / torch.arange(1, a.experts + 1, dtype=torch.float32)
        scores = torch.rand(a.tokens, a.experts, generator=g) * w
    return scores.topk(a.topk, dim=1).indices.to(dev)


def _time(torch: Any, step: Callable[[int], Any], a: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Per iteration: GPU ms (events) and host-blocked ms (wall time of the calls behind a busy GPU)."""
    gpu_ms, host_ms = [], []
    for it in range(a.warmup + a.iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work ahead: a call that syncs waits it out
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        step(it)
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        if it >= a.warmup:
            gpu_ms.append(e0.elapsed_time(e1))
            host_ms.append((t1 - t0) * 1e3)
    return gpu_ms, host_ms


def _run(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import varcomm
    from varcomm.collectives import alltoall_device, moe

    if not torch.cuda.is_available():
        print("varcomm-bench moe: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    row = a.hidden * torch.finfo(dtype).bits // 8
    # A rank's whole dispatch fits one slot (all-to-one routing); 2 p2p slots
    # keep the nvlink transport's own slots (world x slots x bound) small.
    bound = max(1 << 20, (a.tokens * a.topk * row + 15) // 16 * 16)
    comm = varcomm.init(bound=bound, slots=2, timeout=120)
    r, n = comm.rank, comm.world_size
    E, T, K, H = a.experts, a.tokens, a.topk, a.hidden
    tokens = torch.randn(T, H, device=dev).to(dtype)
    weights = torch.full((T, K), 1.0 / K, device=dev)
    ids = [_routing(torch, a, it, r, dev) for it in range(a.warmup + a.iters)]
    moved = 2 * T * K * row  # per rank and op: dispatched, then combined back
    rows: dict[str, Any] = {}

    def varcomm_step(it: int) -> Any:
        et, tpe, h = moe.dispatch(comm, tokens, ids[it], weights, E)
        return moe.combine(comm, et, h)

    rows["varcomm device"] = _time(torch, varcomm_step, a)
    alltoall_device.synchronize(comm)

    # NCCL two-phase, on the same ranks (the launcher's env:// variables).
    # Its own port: varcomm's store holds MASTER_PORT.
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500")) + 1
    why_nccl = None
    try:
        dist.init_process_group("nccl", init_method=f"tcp://{addr}:{port}", rank=r, world_size=n, device_id=dev)
    except Exception as e:  # no NCCL in this torch, or it cannot start
        why_nccl = f"{type(e).__name__}: {e}"
    if why_nccl is None:
        per_rank = E // n

        def nccl_step(it: int) -> Any:
            flat = ids[it].reshape(-1)
            order = torch.sort(flat, stable=True).indices
            x = tokens.index_select(0, order // K)
            counts = torch.zeros(n, dtype=torch.int64, device=dev)
            counts.scatter_add_(0, flat // per_rank, torch.ones_like(flat))
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts)
            send_l, recv_l = counts.tolist(), got.tolist()  # the host sync of the two-phase path
            recv = x.new_empty((sum(recv_l), H))
            dist.all_to_all_single(recv, x, recv_l, send_l)
            back = torch.empty_like(x)
            dist.all_to_all_single(back, recv, send_l, recv_l)
            y = torch.empty_like(back)
            y[order] = back
            return y.reshape(T, K, H).sum(1)

        rows["nccl two-phase"] = _time(torch, nccl_step, a)
    # torch SymmMem (NVSHMEM), where present.
    why_symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if why_nccl is not None:
            raise RuntimeError("needs the NCCL process group, which did not start")
        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.all_to_all_vdev_2d")
        symm_mem.set_backend("NVSHMEM")
        group = dist.distributed_c10d._get_default_group()
        cap = 2 * T * K
        inp = symm_mem.empty((cap, H), dtype=dtype, device=dev)
        out = symm_mem.empty((cap * n, H), dtype=dtype, device=dev)
        back = symm_mem.empty((cap, H), dtype=dtype, device=dev)
        in_splits = symm_mem.empty(E, dtype=torch.int64, device=dev)
        oso = symm_mem.empty((2, E), dtype=torch.int64, device=dev)
        bso = symm_mem.empty((2, E), dtype=torch.int64, device=dev)
        for t in (inp, out, back, in_splits, oso, bso):
            symm_mem.rendezvous(t, group.group_name)

        def symm_step(it: int) -> Any:
            flat = ids[it].reshape(-1)
            order = torch.sort(flat, stable=True).indices
            inp[: T * K].copy_(tokens.index_select(0, order // K))
            in_splits.zero_().scatter_add_(0, flat, torch.ones_like(flat))
            torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, oso, group.group_name)
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, oso, bso, group.group_name)
            return back

        rows["symm_mem vdev"] = _time(torch, symm_step, a)
    except Exception as e:
        why_symm = f"{type(e).__name__}: {e}"

    src = tokens.repeat_interleave(K, dim=0)
    dst = torch.empty_like(src)

    def d2d_step(it: int) -> Any:
        dst.copy_(src)
        src.copy_(dst)

    rows["d2d copy"] = _time(torch, d2d_step, a)

    # The slowest rank's median per row, gathered on rank 0 over varcomm's host path.
    mine = {k: (statistics.median(g), statistics.median(h)) for k, (g, h) in rows.items()}
    payload = torch.tensor([v for k in sorted(mine) for v in mine[k]], dtype=torch.float64)
    gathered = comm.all_to_all(None, [payload] * n)
    worst = torch.stack([torch.as_tensor(g) for g in gathered]).max(dim=0).values.tolist()
    res: dict[str, Any] = {}
    for i, k in enumerate(sorted(mine)):
        res[k] = {"ms": worst[2 * i], "host_ms": worst[2 * i + 1], "algbw_GBps": moved / (worst[2 * i] * 1e-3) / 1e9}
    if r == 0:
        base = res.get("nccl two-phase", {}).get("ms")
        print(f"MoE dispatch+combine: {n} ranks, T={T} tokens/rank, H={H}, topk={K}, E={E}, {a.dtype}, "
              f"{a.routing} routing, {a.iters} iterations (median of the slowest rank)")
        print("| path | time/op (ms) | algbw (GB/s) | host-blocked/op (ms) | vs nccl two-phase |")
        print("|---|---:|---:|---:|---:|")
        for k in ("varcomm device", "nccl two-phase", "symm_mem vdev", "d2d copy"):
            if k not in res:
                continue
            v = res[k]
            ratio = f"{base / v['ms']:.2f}x" if base else "-"
            print(f"| {k} | {v['ms']:.3f} | {v['algbw_GBps']:.1f} | {v['host_ms']:.3f} | {ratio} |")
        if why_nccl:
            print(f"nccl two-phase skipped: {why_nccl}")
        if why_symm:
            print(f"symm_mem vdev skipped: {why_symm}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "results": res, "skipped": {"nccl": why_nccl, "symm_mem": why_symm}},
                          f, indent=1)
    if why_nccl is None:
        dist.destroy_process_group()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
