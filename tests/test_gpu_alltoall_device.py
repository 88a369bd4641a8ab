"""All-to-all with device-side splits (collectives/alltoall_device.py,
transport/nvlink/a2a_device.cpp, kernels in transport/nvlink/a2a_kernels.cuh).

* `test_fake_*`: the real kernel bodies, compiled as host C++ into the CPU
  stand-in driver (transport/nvlink/fake_libcuda.cc), run for cuLaunchKernel
  on the stream's thread; arrays are `__cuda_array_interface__` objects over
  the fake driver's device memory (what cupy hands in), or torch tensors over
  that memory with an explicit stream. Checked against a single-process
  reference: random, skewed, zero-row and all-to-one routing, 2-4 ranks,
  float32 and bfloat16, the MoE layouts, errors, graph capture and replay.
* `test_gpu_*`: torch CUDA tensors on a real GPU (`requires=("gpu",)`).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

import varcomm
from test_gpu import GPU_REQ, FakeGpu, fake_cuda, nvlink_built  # noqa: F401  (fake_cuda: a fixture)
from varcomm.collectives import alltoall_device as D
from varcomm.testing import seeded, world

BOUND = 16 * 1024


class FakeArray:
    """A C-contiguous array in the fake driver's device memory, seen by
    varcomm through __cuda_array_interface__; `host` is a numpy view of the
    same bytes (the fake's device memory is mapped in this process)."""

    def __init__(self, gpu: FakeGpu, shape: tuple[int, ...], dtype: str, stream: int):
        self.shape, self.stream = shape, stream
        self.bf16 = dtype == "bfloat16"
        self.dtype = np.dtype(np.uint16 if self.bf16 else dtype)
        n = int(np.prod(shape)) * self.dtype.itemsize
        self.ptr = gpu.alloc(n)
        buf = (ctypes.c_char * max(n, 1)).from_address(self.ptr)
        self.host = np.frombuffer(buf, dtype=self.dtype, count=int(np.prod(shape))).reshape(shape)

    @property
    def __cuda_array_interface__(self) -> dict:
        d = {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
             "strides": None, "stream": self.stream}
        if self.bf16:
            d["varcomm_dtype"] = "bfloat16"
        return d


def _host(a) -> np.ndarray:
    """A numpy view of a __cuda_array_interface__ array in the fake's device memory."""
    cai = a.__cuda_array_interface__
    dt = np.dtype(np.uint16) if cai.get("varcomm_dtype") == "bfloat16" else np.dtype(cai["typestr"])
    n = int(np.prod(cai["shape"]))
    buf = (ctypes.c_char * max(n * dt.itemsize, 1)).from_address(cai["data"][0])
    return np.frombuffer(buf, dtype=dt, count=n).reshape(cai["shape"])


def _fake_comm(path: str, **kw):
    gpu = FakeGpu(path)
    os.environ["VARCOMM_NVLINK"] = "1"
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    comm = varcomm.init(transport="shm", timeout=30, **kw)
    return gpu, comm


def _x(seed, it, src, rows, width, dtype):
    g = np.random.default_rng([seed, it, src, 7])
    if dtype == "bfloat16":
        return g.integers(0, 1 << 16, (rows, width), dtype=np.uint16)
    return g.standard_normal((rows, width)).astype(dtype)


def _routing(g, n, kind, it):
    """splits[s][d]: rows rank s sends to d."""
    if kind == "random":
        return g.integers(0, 20, (n, n))
    if kind == "skewed":
        w = np.array([0.7] + [0.3 / (n - 1)] * (n - 1))
        return np.stack([g.multinomial(int(g.integers(0, 60)), np.roll(w, it % n)) for _ in range(n)])
    if kind == "zero":
        s = g.integers(0, 9, (n, n))
        s[g.random((n, n)) < 0.5] = 0
        s[it % n, :] = 0  # one rank sends nothing at all
        return s
    s = np.zeros((n, n), dtype=np.int64)  # all to one
    s[:, it % n] = g.integers(0, 30, n)
    return s


def _expect(xs, splits, r):
    parts = []
    for s, x in enumerate(xs):
        off = int(splits[s][:r].sum())
        parts.append(x[off:off + int(splits[s][r])])
    return np.concatenate(parts)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fake_vdev_matches_reference(fake_cuda, n):
    """all_to_all_v with device splits, through the public entry point:
    out and the device counts/offsets equal a single-process reference, for
    random, skewed, zero-row and all-to-one routing, float32 and bfloat16,
    int32 and int64 splits; under FAKE_CUDA_DELAY_US, every other call."""

    @world(n, timeout=180)
    def body():
        seed = seeded()
        if seed % 2:
            os.environ["FAKE_CUDA_DELAY_US"] = "300"
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r = comm.rank
        s = gpu.stream()
        W = 8
        with comm:
            for it, kind in enumerate(["random", "skewed", "zero", "all-to-one"] * 3):
                g = np.random.default_rng([seed, it])
                splits = _routing(g, n, kind, it)
                dtype = "bfloat16" if it % 3 == 2 else "float32"
                xs = [_x(seed, it, q, int(splits[q].sum()), W, dtype) for q in range(n)]
                x = FakeArray(gpu, xs[r].shape, dtype, s)
                x.host[...] = xs[r]
                sp = FakeArray(gpu, (n,), "int32" if it % 2 else "int64", s)
                sp.host[...] = splits[r]
                out = FakeArray(gpu, (n * BOUND // (W * x.dtype.itemsize), W), dtype, s)
                out.host.view(np.uint8)[...] = 0xAB
                got, got_so = comm.all_to_all_v(x, sp, out=out)  # the hook: device splits
                assert got is out and isinstance(got_so, D.DeviceArray)
                D.synchronize(comm, s)
                want_rows = splits[:, r]
                oso = _host(got_so)
                assert oso[0].tolist() == want_rows.tolist(), (seed, it, kind, oso)
                assert oso[1].tolist() == np.concatenate([[0], np.cumsum(want_rows)[:-1]]).tolist()
                total = int(want_rows.sum())
                want = _expect(xs, splits, r)
                assert np.array_equal(out.host[:total], want), f"seed {seed} iteration {it} ({kind}, {dtype})"
                assert (out.host[total:].view(np.uint8) == 0xAB).all(), "written past the received rows"
            comm.barrier()

    body()
