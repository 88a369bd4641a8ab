"""varcomm-bench rdma_device: GPU messages over rdma on the CPU stand-in driver.

    python -m varcomm_bench.rdma_device [--delays 0,1000] [--chunks 256K,1M,4M] [--size 4M] [--iters 40]

Builds transport/nvlink/fake_libcuda.cc (g++) and runs 2 ranks on this host
with the route forced to rdma (libfabric tcp;ofi_rxm on loopback), so GPU
messages take the rdma-gpu path: staging copies, flags and stream waits on the
fake driver's stream threads. Two measurements, each in its own 2-rank run:

  enqueue    host time of each call that enqueues a device send (isend) and a
             device receive (recv_into, its message already landed), 16 KiB
             messages, with every fake stream operation delayed by
             FAKE_CUDA_DELAY_US (--delays): the host time must not grow with
             the delay (the target: <= 20 us per call whatever the delay).
             `stream busy` says the calls returned before their streams ran;
             the last column is the same receive of host memory, same run.
  bandwidth  one-way stream of --iters messages of --size bytes, device memory
             (rdma-gpu, each --chunks value) against host memory (numpy, the
             host rdma path) in the same run, interleaved, best of 3; the
             target: device >= 0.8 x host (pipelining hides the staging copies).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NOT_READY = 600


class _Fake:
    """The fake driver's device memory and streams, through ctypes."""

    def __init__(self, path: str):
        self.lib = lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        ctx = ctypes.c_void_p()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert lib.cuCtxSetCurrent(ctx) == 0

    def alloc(self, n: int) -> int:
        p = ctypes.c_ulonglong()
        assert self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(max(n, 1))) == 0
        return p.value

    def stream(self) -> int:
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        return int(s.value or 0)

    def sync(self, s: int) -> None:
        assert self.lib.cuStreamSynchronize(ctypes.c_void_p(s)) == 0

    def busy(self, s: int) -> bool:
        return int(self.lib.cuStreamQuery(ctypes.c_void_p(s))) == NOT_READY

    def put(self, ptr: int, data: bytes) -> None:
        assert self.lib.cuMemcpyHtoD_v2(ctypes.c_ulonglong(ptr), data, ctypes.c_size_t(len(data))) == 0


def _u8() -> int:
    from varcomm import dtypes

    return dtypes.word(dtypes.UINT, 8)


def _enqueue(comm: Any, gpu: _Fake, n: int = 64, size: int = 16384) -> dict[str, Any]:
    c, u8, s = comm._c, _u8(), gpu.stream()
    us: list[float] = []
    if comm.rank == 0:
        src = gpu.alloc(size)
        ids = []
        for _ in range(n):
            t = time.perf_counter_ns()
            ids.append(c.isend(1, 0, src, size, u8, (size,), s))
            us.append((time.perf_counter_ns() - t) / 1e3)
        busy = gpu.busy(s)
        for w in ids:
            c.wait(w, 60.0)
        gpu.sync(s)
        while c.unflushed():  # every chunk posted
            time.sleep(0.001)
        comm.barrier()
    else:
        outs = [gpu.alloc(size) for _ in range(n)]
        comm.barrier()  # every header and chunk has been written
        # Land them first (tcp copies incoming data off the socket in whoever
        # progresses): what is timed below is the enqueue, not the wire.
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            c.progress()
        for o in outs:
            t = time.perf_counter_ns()
            c.recv_into(0, 0, o, size, u8, 60.0, s)
            us.append((time.perf_counter_ns() - t) / 1e3)
        busy = gpu.busy(s)
    gpu.sync(s)
    comm.barrier()
    # The baseline, in the same run: the same receive of host memory (numpy), landed first too.
    import numpy as np

    host_us: list[float] = []
    buf = np.zeros(size, dtype=np.uint8)
    if comm.rank == 0:
        for _ in range(n):
            comm.send(buf, 1, 1, timeout=60.0)
        while c.unflushed():
            time.sleep(0.001)
        comm.barrier()
    else:
        comm.barrier()
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            c.progress()
        for _ in range(n):
            t = time.perf_counter_ns()
            comm.recv(0, 1, out=buf, timeout=60.0)
            host_us.append((time.perf_counter_ns() - t) / 1e3)
    comm.barrier()
    return {"median_us": statistics.median(us), "max_us": max(us), "stream_busy": busy,
            "host_median_us": statistics.median(host_us) if host_us else 0.0}


def _bandwidth(comm: Any, gpu: _Fake, size: int, iters: int) -> dict[str, float]:
    import numpy as np

    c, u8, s = comm._c, _u8(), gpu.stream()
    dsrc, dout = gpu.alloc(size), gpu.alloc(size)
    if comm.rank == 0:
        gpu.put(dsrc, os.urandom(size))
    hsrc, hout = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    best = {"device": float("inf"), "host": float("inf")}
    for _ in range(3):
        for kind in ("device", "host"):
            comm.barrier()
            t0 = time.perf_counter()
            if comm.rank == 0:
                for _ in range(iters):
                    if kind == "device":
                        c.send(1, 0, dsrc, size, u8, (size,), 60.0, s)
                    else:
                        comm.send(hsrc, 1, 0, timeout=60.0)
                comm.recv(1, 1, out=ack, timeout=60.0)
                best[kind] = min(best[kind], time.perf_counter() - t0)
            else:
                for _ in range(iters):
                    if kind == "device":
                        c.recv_into(0, 0, dout, size, u8, 60.0, s)
                    else:
                        comm.recv(0, 0, out=hout, timeout=60.0)
                gpu.sync(s)  # the device messages are in dout
                comm.send(ack, 0, 1, timeout=60.0)
    gpu.sync(s)
    return {k: size * iters / v / 1e9 for k, v in best.items()}


def _rank(mode: str, out: str, size: int, iters: int) -> None:
    gpu = _Fake(os.environ["VARCOMM_BENCH_FAKE"])
    os.environ.update(VARCOMM_NVLINK="1", VARCOMM_NVLINK_DEVICE="0")
    import varcomm

    bound = 65536 if mode == "enqueue" else size
    comm = varcomm.init(transport="rdma", bound=bound, slots=64 if mode == "enqueue" else 4, timeout=120)
    assert comm.device_transport_for(1 - comm.rank) == "rdma-gpu", comm.describe_transport(1 - comm.rank)
    try:
        res = _enqueue(comm, gpu) if mode == "enqueue" else _bandwidth(comm, gpu, size, iters)
        with open(f"{out}.{comm.rank}", "w") as f:
            json.dump(res, f)
    finally:
        comm.close()


def _launch(env: dict[str, str], mode: str, out: str, size: int, iters: int) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "varcomm.run", "-n", "2", "--timeout", "600", "--", sys.executable, "-m",
           "varcomm_bench.rdma_device", "--rank-mode", mode, "--rank-out", out, "--size", str(size),
           "--iters", str(iters)]
    subprocess.run(cmd, env={**os.environ, **env}, check=True)
    res = []
    for r in range(2):
        with open(f"{out}.{r}") as f:
            res.append(json.load(f))
    return res


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m varcomm_bench.rdma_device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delays", default="0,1000", help="FAKE_CUDA_DELAY_US values for the enqueue test")
    p.add_argument("--chunks", default="256K,1M,4M", help="VARCOMM_RDMA_CHUNK values for the bandwidth test")
    p.add_argument("--size", default="4M", help="message size of the bandwidth test (also the bound)")
    p.add_argument("--iters", type=int, default=40, help="messages per bandwidth stream")
    p.add_argument("--rank-mode", help=argparse.SUPPRESS)
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from varcomm.options import parse_bytes

    a = _parser().parse_args(argv)
    size = parse_bytes(str(a.size))
    if a.rank_mode:
        _rank(a.rank_mode, a.rank_out, size, a.iters)
        return 0
    tmp = tempfile.mkdtemp(prefix="varcomm-rdma-device-")
    fake = os.path.join(tmp, "libcuda.so.1")
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-shared", "-fPIC",
                    "-Wl,-soname,libcuda.so.1", "-o", fake, str(ROOT / "transport" / "nvlink" / "fake_libcuda.cc"),
                    "-lpthread"], check=True)
    base = {"VARCOMM_BENCH_FAKE": fake, "VARCOMM_FI_PROVIDER": "tcp;ofi_rxm", "OMP_NUM_THREADS": "1"}
    print("## enqueue: host time per call, 16 KiB device messages (64 in a row)\n")
    print("| FAKE_CUDA_DELAY_US | send median | send max | recv median | recv max | stream busy after (send, recv) "
          "| host-memory recv median (baseline) |")
    print("|---|---|---|---|---|---|---|")
    for d in a.delays.split(","):
        s, r = _launch({**base, "FAKE_CUDA_DELAY_US": d}, "enqueue", os.path.join(tmp, f"enq{d}"), size, a.iters)
        print(f"| {d} | {s['median_us']:.1f} us | {s['max_us']:.1f} us | {r['median_us']:.1f} us | "
              f"{r['max_us']:.1f} us | {s['stream_busy']}, {r['stream_busy']} | {r['host_median_us']:.1f} us |",
              flush=True)
    print(f"\n## bandwidth: one-way, {a.iters} x {a.size} messages, best of 3, GB/s\n")
    print("| VARCOMM_RDMA_CHUNK | device (rdma-gpu) | host (numpy, rdma) | device / host |")
    print("|---|---|---|---|")
    for ch in a.chunks.split(","):
        res = _launch({**base, "VARCOMM_RDMA_CHUNK": ch, "FAKE_CUDA_DELAY_US": "0"}, "bandwidth",
                      os.path.join(tmp, f"bw{ch}"), size, a.iters)[0]
        print(f"| {ch} | {res['device']:.2f} | {res['host']:.2f} | {res['device'] / res['host']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
