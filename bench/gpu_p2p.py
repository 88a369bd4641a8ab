#!/usr/bin/env python3
"""GPU point-to-point: varcomm's nvlink transport against a device-to-device
copy of the same size and against gloo through host memory, in one run.

    python bench/gpu_p2p.py [--sizes 8,4K,64K,1M,16M,64M] [--out DIR]    relaunches itself on 2 ranks
    varcomm-run -n 2 bench/gpu_p2p.py [...]                            or torchrun --nproc-per-node 2

Both ranks use GPU LOCAL_RANK % device_count (with one GPU, both share it:
CUDA IPC works within a device). Columns (GB/s = 1e9 B/s):

  nvlink pp      ping-pong of CUDA tensors, comm.send / comm.recv(out=...):
                 half round trip (latency) and size / half round trip
  nvlink stream  one-way: rank 0 sends `iters` messages back to back, rank 1
                 receives into a bound-sized CUDA buffer; size * iters / time
                 until rank 1's stream has finished (acknowledged back)
  d2d            `dst.copy_(src)` in one process on the same GPU (CUDA events)
  stream/d2d     the ratio the target is stated in (>= 0.8 at 16 MiB and up)
  gloo pp        ping-pong through varcomm's fallback (torch.distributed
                 gloo): x.cpu(), send, recv, .cuda()

A message costs two copies (sender: tensor -> receiver's slot; receiver:
slot -> out). On one GPU both share its memory bandwidth, so `nvlink stream`
is bounded by about half of `d2d` there (`stream/(d2d/2)` shows how close it
gets); between two GPUs the sender's copy crosses NVLink, the receiver's is local.

Small messages, copy engine vs kernel (--kernel-sizes, 8 B .. 64 KiB): the
same ping-pong and one-way stream on two more communicators, one with
VARCOMM_NVLINK_KERNEL_MAX=0 (cuMemcpyAsync + cuStreamWriteValue64 per
message) and one with the copy-and-flag kernel for every size measured (one
launch per message); the report suggests a VARCOMM_NVLINK_KERNEL_MAX.

Then the host-block check: 100 isends enqueued behind ~0.5 s of GPU work
(torch.cuda._sleep) must return in a small fraction of that time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))  # a source checkout runs without installing

_LAUNCH_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def parse_bytes(s: str) -> int:
    v = s.strip().upper().replace("IB", "").rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(v[:-1]) * mult[v[-1]]) if v and v[-1] in mult else int(v)


def fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _iters(size: int, budget_s: float, bw: float, lat: float, lo: int = 5, hi: int = 2000) -> int:
    """Iterations for about budget_s under a rough (latency, bandwidth) model."""
    return int(max(lo, min(hi, budget_s / (lat + size / bw))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,4K,64K,1M,16M,64M")
    ap.add_argument("--kernel-sizes", default="8,64,512,4K,8K,16K,64K",
                    help="sizes for copy engine vs kernel ('' to skip)")
    ap.add_argument("--gloo-max", type=parse_bytes, default=16 << 20, help="largest gloo size (slow; default 16M)")
    ap.add_argument("--budget", type=float, default=0.25, help="seconds per point and method (approx)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_p2p.json / gpu_p2p.md here")
    ap.add_argument("--timeout", type=float, default=240)
    a = ap.parse_args()
    if not any(os.environ.get(k) for k in _LAUNCH_VARS):
        from varcomm.tools import run

        pp = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = str(ROOT / "python") + (os.pathsep + pp if pp else "")
        return run.launch([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], 2, timeout=a.timeout)
    return ranks(a)


def ranks(a: argparse.Namespace) -> int:
    import torch

    import varcomm

    if not torch.cuda.is_available():
        print(f"gpu_p2p: torch {torch.__version__} sees no CUDA GPU", flush=True)
        return 2
    sizes = [parse_bytes(s) for s in a.sizes.split(",") if s.strip()]
    lr = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    torch.cuda.set_device(lr % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    bound = max(sizes)
    comm = varcomm.init(transport="shm", bound=bound, slots=4, timeout=120)
    r, peer = comm.rank, 1 - comm.rank
    if comm.device_transport_for(peer) != "nvlink":
        print(f"gpu_p2p: no nvlink route between the ranks: {comm.describe_transport(peer)}", flush=True)
        comm.close()
        return 3
    fb = varcomm.init(transport="fallback", bound=min(bound, a.gloo_max), slots=2, timeout=120)
    res: dict = {"points": {}, "host_block": None,
                 "machine": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                             "cuda": torch.version.cuda, "devices": torch.cuda.device_count(),
                             "host": platform.node(), "transport": comm.describe_transport(peer),
                             "same_gpu": torch.cuda.device_count() == 1}}
    out_buf = torch.empty(bound, dtype=torch.uint8, device=dev)

    def sync_all() -> None:
        torch.cuda.synchronize()
        comm.barrier()

    for size in sizes:
        x = (torch.arange(size, device=dev) % 251).to(torch.uint8)  # the same on both ranks
        pt: dict = {}
        # -- nvlink ping-pong: both hosts run ahead; the streams chain the copies
        n = _iters(size, a.budget, 1e11, 2e-5)
        for k in (3, n):
            sync_all()
            t0 = time.perf_counter()
            for _ in range(k):
                if r == 0:
                    comm.send(x, dst=1)
                    comm.recv(src=1, out=out_buf)
                else:
                    y = comm.recv(src=0, out=out_buf)
                    comm.send(y, dst=0)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        if r == 0:
            assert torch.equal(out_buf[:size], x), f"ping-pong payload differs at {size} bytes"
        pt["pp_lat_us"] = dt / n / 2 * 1e6
        pt["pp_gbs"] = size / (dt / n / 2) / 1e9
        # -- nvlink one-way stream ---------------------------------------------
        n = _iters(size, a.budget, 2e11, 1e-5, lo=8)
        ack = torch.zeros(1)
        for k in (4, n):
            sync_all()
            t0 = time.perf_counter()
            if r == 0:
                for _ in range(k):
                    comm.send(x, dst=1)
                comm.recv(src=1, out=ack)  # a host tensor: rank 1's stream has finished
            else:
                for _ in range(k):
                    comm.recv(src=0, out=out_buf)
                torch.cuda.synchronize()
                comm.send(ack, dst=0)
            dt = time.perf_counter() - t0
        pt["stream_gbs"] = size * n / dt / 1e9
        if r == 1:
            assert torch.equal(out_buf[:size], x), f"streamed payload differs at {size} bytes"
        # -- d2d copy baseline (rank 0, same GPU) --------------------------------
        if r == 0:
            dst = torch.empty_like(x)
            n = _iters(size, a.budget / 2, 1.5e12, 3e-6, lo=10, hi=5000)
            for _ in range(3):
                dst.copy_(x)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                dst.copy_(x)
            e1.record()
            e1.synchronize()
            t = e0.elapsed_time(e1) / 1e3 / n
            pt["d2d_us"] = t * 1e6
            pt["d2d_gbs"] = size / t / 1e9
        # -- gloo through host memory ------------------------------------------
        if size <= a.gloo_max:
            n = _iters(size, a.budget, 1e9, 6e-4, lo=3, hi=200)
            for k in (2, n):
                sync_all()
                t0 = time.perf_counter()
                for _ in range(k):
                    if r == 0:
                        fb.send(x.cpu(), dst=1)
                        fb.recv(src=1).to(dev)
                    else:
                        y = fb.recv(src=0).to(dev)
                        fb.send(y.cpu(), dst=0)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            pt["gloo_lat_us"] = dt / n / 2 * 1e6
            pt["gloo_gbs"] = size / (dt / n / 2) / 1e9
        res["points"][size] = pt
        if r == 0:
            print(f"gpu_p2p: {fmt_bytes(size)} done", flush=True)

    # -- small messages: copy engine vs the copy-and-flag kernel -----------------
    ksizes = [parse_bytes(s) for s in a.kernel_sizes.split(",") if s.strip()]
    if ksizes:
        res["kernel"] = kernel_vs_copy_engine(varcomm, torch, dev, r, ksizes, a.budget, sync_all)

    # -- host-block check: 100 sends behind ~0.5 s of GPU work --------------------
    # Enough slots that every send is written at once (with fewer, later sends
    # wait on the host for credits, which come back from the receiver's stream).
    hb_size = 64 << 10
    hb = varcomm.init(transport="shm", bound=hb_size, slots=128, timeout=120)
    out_hb = torch.empty(hb_size, dtype=torch.uint8, device=dev)
    sync_all()
    if r == 0:
        xs = [torch.full((hb_size,), i % 251, dtype=torch.uint8, device=dev) for i in range(100)]
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        t0 = time.perf_counter()
        works = [hb.isend(xx, dst=1, tag=7) for xx in xs]
        t_enq = time.perf_counter() - t0
        for w in works:
            w.wait()
        t_wait = time.perf_counter() - t0
        torch.cuda.synchronize()
        t_gpu = time.perf_counter() - t0
        res["host_block"] = {"sends": 100, "bytes": hb_size, "host_enqueue_ms": t_enq * 1e3,
                             "host_wait_ms": t_wait * 1e3, "gpu_ms": t_gpu * 1e3}
    else:
        for _ in range(100):
            got = hb.recv(src=0, tag=7, out=out_hb)
        torch.cuda.synchronize()
        assert bool((got == 99).all()), "host-block check: last message differs"
    comm.barrier()
    hb.close()

    if r == 0:
        text = report(res)
        print(text, flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "gpu_p2p.md").write_text(text + "\n")
            (Path(a.out) / "gpu_p2p.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    fb.close()
    comm.close()
    return 0


def _pingpong(comm, x, out, r: int, iters: int) -> float:
    """Seconds per half round trip (both hosts run ahead; the streams chain)."""
    import torch

    for k in (3, iters):
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            if r == 0:
                comm.send(x, dst=1)
                comm.recv(src=1, out=out)
            else:
                comm.send(comm.recv(src=0, out=out), dst=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    if r == 0:
        assert torch.equal(out[:x.numel()], x), f"ping-pong payload differs at {x.numel()} bytes"
    return dt / iters / 2


def _oneway(comm, x, out, r: int, iters: int) -> float:
    """Seconds per message, rank 0 -> rank 1 back to back, until rank 1's
    stream has finished."""
    import torch

    ack = torch.zeros(1)
    for k in (4, iters):
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        if r == 0:
            for _ in range(k):
                comm.send(x, dst=1)
            comm.recv(src=1, out=ack)
        else:
            for _ in range(k):
                comm.recv(src=0, out=out)
            torch.cuda.synchronize()
            comm.send(ack, dst=0)
        dt = time.perf_counter() - t0
    if r == 1:
        assert torch.equal(out[:x.numel()], x), f"streamed payload differs at {x.numel()} bytes"
    return dt / iters


def kernel_vs_copy_engine(varcomm, torch, dev, r: int, sizes: list[int], budget: float, sync_all) -> dict:
    """Ping-pong and one-way stream at small sizes on two communicators:
    VARCOMM_NVLINK_KERNEL_MAX=0 (copy engine) and = the largest size (kernel)."""
    bound, peer = max(sizes), 1 - r
    comms = {}
    old = os.environ.get("VARCOMM_NVLINK_KERNEL_MAX")
    try:
        for mode, kmax in (("ce", 0), ("kernel", bound)):
            os.environ["VARCOMM_NVLINK_KERNEL_MAX"] = str(kmax)  # read when the transport is created
            comms[mode] = varcomm.init(transport="shm", bound=bound, slots=4, timeout=120)
    finally:
        if old is None:
            os.environ.pop("VARCOMM_NVLINK_KERNEL_MAX", None)
        else:
            os.environ["VARCOMM_NVLINK_KERNEL_MAX"] = old
    desc = comms["kernel"].describe_transport(peer)
    out: dict = {"transport": desc, "points": {}}
    ok = torch.tensor([int("copy-and-flag kernel" in desc and "unavailable" not in desc)])
    c = comms["ce"]  # both ranks must agree to measure
    if r == 0:
        c.send(ok, dst=1)
        both = int(c.recv(src=1)[0]) and int(ok[0])
    else:
        both = int(c.recv(src=0)[0]) and int(ok[0])
        c.send(ok, dst=0)
    if not both:
        from varcomm import _C

        out["unavailable"] = _C.nvlink_info()
        if r == 0:
            print(f"gpu_p2p: no kernel rows (kernel unavailable on a rank): {desc}", flush=True)
        for c in comms.values():
            c.close()
        return out
    out_buf = torch.empty(bound, dtype=torch.uint8, device=dev)
    for size in sizes:
        x = (torch.arange(size, device=dev) % 251).to(torch.uint8)
        pt = {}
        for mode, c in comms.items():
            sync_all()
            pt[f"{mode}_pp_us"] = _pingpong(c, x, out_buf, r, _iters(size, budget, 1e11, 2e-5)) * 1e6
            sync_all()
            pt[f"{mode}_oneway_us"] = _oneway(c, x, out_buf, r, _iters(size, budget, 2e11, 1e-5, lo=8)) * 1e6
        out["points"][size] = pt
    for c in comms.values():
        c.close()
    if r == 0:
        print("gpu_p2p: copy engine vs kernel done", flush=True)
    return out


def kernel_report(k: dict) -> list[str]:
    lines = ["", "Small messages: copy engine (cuMemcpyAsync + cuStreamWriteValue64) vs one copy-and-flag "
             "kernel launch", f"kernel communicator: {k['transport']}"]
    if k.get("unavailable"):
        return lines + ["kernel unavailable, no rows:", k["unavailable"]]
    lines += ["", "| size | CE pp lat | kernel pp lat | kernel/CE | CE one-way us/msg | kernel one-way us/msg "
              "| kernel/CE |", "|---|---|---|---|---|---|---|"]
    wins = []
    for size, p in k["points"].items():
        pp = p["kernel_pp_us"] / p["ce_pp_us"]
        ow = p["kernel_oneway_us"] / p["ce_oneway_us"]
        lines.append(f"| {fmt_bytes(int(size))} | {p['ce_pp_us']:.1f} us | {p['kernel_pp_us']:.1f} us | {pp:.2f} | "
                     f"{p['ce_oneway_us']:.2f} | {p['kernel_oneway_us']:.2f} | {ow:.2f} |")
        wins.append((int(size), pp < 0.97 and ow < 1.03))
    best = 0
    for size, win in sorted(wins):  # the largest size up to which the kernel wins throughout
        if not win:
            break
        best = size
    lines.append(f"suggested VARCOMM_NVLINK_KERNEL_MAX={best}"
                 + (" (the kernel does not win at the smallest size: keep it off)" if not best else
                    " (kernel: >= 3% lower ping-pong latency, one-way no worse, at every size up to it)"))
    return lines


def report(res: dict) -> str:
    m = res["machine"]
    lines = [f"GPU p2p, {m['gpu']} x{m['devices']} "
             f"({'both ranks on one GPU' if m['same_gpu'] else 'one GPU per rank'}), "
             f"torch {m['torch']} CUDA {m['cuda']}",
             f"transport: {m['transport']}", "",
             "| size | nvlink pp lat | nvlink pp GB/s | nvlink stream GB/s | d2d GB/s | stream/d2d | stream/(d2d/2) "
             "| gloo pp lat | gloo pp GB/s | gloo lat / nvlink lat |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    targets = []
    for size, p in res["points"].items():
        d2d = p.get("d2d_gbs")
        ratio = p["stream_gbs"] / d2d if d2d else None
        half = p["stream_gbs"] / (d2d / 2) if d2d else None
        speed = p["gloo_lat_us"] / p["pp_lat_us"] if p.get("gloo_lat_us") else None
        lines.append(f"| {fmt_bytes(int(size))} | {f(p['pp_lat_us'], '.1f')} us | {f(p['pp_gbs'], '.2f')} | "
                     f"{f(p['stream_gbs'], '.1f')} | {f(d2d, '.1f')} | {f(ratio, '.2f')} | {f(half, '.2f')} | "
                     f"{f(p.get('gloo_lat_us'), '.0f')} us | {f(p.get('gloo_gbs'), '.2f')} | {f(speed, '.0f')}x |")
        if int(size) >= 16 << 20 and ratio is not None:
            targets.append(f"{fmt_bytes(int(size))}: stream/d2d = {ratio:.2f} (target >= 0.8"
                           + ("; one GPU: two copies share its bandwidth, bound ~0.5)" if m["same_gpu"] else ")"))
    hb = res["host_block"]
    lines.append("")
    if hb:
        ok = hb["host_enqueue_ms"] < hb["gpu_ms"] / 10
        lines.append(f"host block: {hb['sends']} isends of {fmt_bytes(hb['bytes'])} behind ~0.5 s of GPU work: "
                     f"enqueue {hb['host_enqueue_ms']:.2f} ms, all waits {hb['host_wait_ms']:.1f} ms, "
                     f"GPU done at {hb['gpu_ms']:.0f} ms -> {'OK' if ok else 'BLOCKS'}")
    lines += [f"target: {t}" for t in targets]
    if res.get("kernel"):
        lines += kernel_report(res["kernel"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
