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


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fake_vdev_2d_dispatch_and_combine(fake_cuda, n):
    """The MoE layouts: dispatch (all_to_all_vdev_2d) lands expert-major with
    per-(expert, source) counts and offsets on the device; combine
    (all_to_all_vdev_2d_offset, fed dispatch's out_splits_offsets) brings every
    row back to its sender in its original order."""

    @world(n, timeout=180)
    def body():
        seed = seeded()
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, s, W, E = comm.rank, gpu.stream(), 4, 3
        with comm:
            for it in range(8):
                g = np.random.default_rng([seed, it])
                splits = g.integers(0, 6, (n, n * E))  # splits[q][d * E + e]
                if it % 4 == 3:
                    z = it % n
                    splits[:, z * E:(z + 1) * E] = 0  # nothing for rank z's experts
                xs = [_x(seed, it, q, int(splits[q].sum()), W, "float32") for q in range(n)]
                x = FakeArray(gpu, xs[r].shape, "float32", s)
                x.host[...] = xs[r]
                sp = FakeArray(gpu, (n * E,), "int64", s)
                sp.host[...] = splits[r]
                out, oso = D.all_to_all_vdev_2d(comm, x, sp, E)
                D.synchronize(comm, s)
                so = _host(oso)
                want, cnt, off, at = [], [], [], 0
                for e in range(E):
                    for q in range(n):
                        first = int(splits[q][:r * E + e].sum())
                        c = int(splits[q][r * E + e])
                        want.append(xs[q][first:first + c])
                        cnt.append(c)
                        off.append(at)
                        at += c
                assert so[0].tolist() == cnt and so[1].tolist() == off, (seed, it, so)
                assert np.array_equal(_host(out)[:at], np.concatenate(want)), f"seed {seed} it {it}: dispatch"
                # Combine: experts "compute" 2 * row + expert id, rows go back rank-major.
                h = _host(out)
                for e in range(E):
                    rows = slice(off[e * n], off[e * n] + sum(cnt[e * n:(e + 1) * n]))
                    h[rows] = 2 * h[rows] + e
                back, bso = D.all_to_all_vdev_2d_offset(comm, out, oso, E, out_rows=xs[r].shape[0])
                D.synchronize(comm, s)
                expect_e = np.repeat(np.tile(np.arange(E), n), splits[r]).astype(np.float32)
                assert np.array_equal(_host(back), 2 * xs[r] + expect_e[:, None]), f"seed {seed} it {it}: combine"
                assert _host(bso)[0].tolist() == splits[r].tolist()
            comm.barrier()

    body()


@world(2, timeout=120)
def test_fake_errors_are_reported_and_the_path_stays_usable(fake_cuda):
    """A chunk over the slot, rows of another dtype, an out too small and
    splits past x: each raised at synchronize on the ranks concerned (named),
    nothing written past out, 0 rows from that source; the next call works."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W = comm.rank, gpu.stream(), 8
    cap_rows = BOUND // (W * 4)

    def call(rows_to, dtype="float32", out_rows=2 * cap_rows, x_rows=None):
        x = FakeArray(gpu, (x_rows if x_rows is not None else sum(rows_to), W), dtype, s)
        x.host[...] = np.arange(x.host.size).reshape(x.host.shape) % 97 + 100 * r
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = rows_to
        out = FakeArray(gpu, (out_rows, W), dtype, s)
        out.host.view(np.uint8)[...] = 0xAB
        got, oso = comm.all_to_all_v(x, sp, out=out)
        return x, out, oso

    def clean_call():
        x, out, oso = call([3, 4])
        D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == [3 if r == 0 else 4] * 2 or _host(oso)[0].tolist() == [[3, 4][r]] * 2

    with comm:
        # 1. rank 0's chunk for rank 1 is over the slot (the bound)
        x, out, oso = call([1, cap_rows + 1] if r == 0 else [1, 1])
        if r == 0:
            with pytest.raises(varcomm.MessageTooLarge, match="chunk for rank 1 has .* over the device slot"):
                D.synchronize(comm, s)
        else:
            with pytest.raises(varcomm.VarcommError, match="rank 0's chunk for rank 1 had .*received 0 rows"):
                D.synchronize(comm, s)
            assert _host(oso)[0].tolist() == [0, 1]
            assert (out.host[1:].view(np.uint8) == 0xAB).all()
        clean_call()
        # 2. rank 1 passes int32 rows of the same size: both sides refuse the other's
        x, out, oso = call([2, 2], dtype="int32" if r == 1 else "float32")
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {1 - r} sent rows of"):
            D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == ([2, 0] if r == 0 else [0, 2])
        clean_call()
        # 3. out too small on rank 1 for rank 1's own rows after rank 0's
        x, out, oso = call([5, 5], out_rows=7 if r == 1 else 20)
        if r == 1:
            with pytest.raises(varcomm.MessageTooLarge, match="rank 1's 5 rows do not fit out after 5 rows of 7"):
                D.synchronize(comm, s)
            assert _host(oso)[0].tolist() == [5, 0]
            assert (out.host[5:].view(np.uint8) == 0xAB).all()
        else:
            D.synchronize(comm, s)
        clean_call()
        # 4. splits past x on rank 0
        x, out, oso = call([3, 9] if r == 0 else [1, 1], x_rows=10 if r == 0 else None)
        if r == 0:
            with pytest.raises(varcomm.InvalidArgument, match="send_splits for rank 1 give rows \\[3, 12\\) of an input of 10"):
                D.synchronize(comm, s)
        else:
            with pytest.raises(varcomm.VarcommError, match="rank 0 passed send_splits outside its input"):
                D.synchronize(comm, s)
        clean_call()
        comm.barrier()


@world(2, timeout=120)
def test_fake_timeout_and_dead_peer(fake_cuda):
    """Rank 1 never calls: rank 0's kernel gives up after its timeout
    (TimeoutError naming rank 1) and the device path stays failed; nothing
    hangs."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        x = FakeArray(gpu, (4, 4), "float32", s)
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (64, 4), "float32", s)
        D.all_to_all_vdev(comm, x, sp, out=out, timeout=0.1)  # sets up (both ranks), then only rank 0 is left
        D.synchronize(comm, s) if r == 1 else None
        comm.barrier()
        if r == 0:
            D.all_to_all_vdev(comm, x, sp, out=out, timeout=1.0)
            with pytest.raises(varcomm.TimeoutError, match="timed out waiting for rank 1"):
                D.synchronize(comm, s)
            with pytest.raises(varcomm.TimeoutError):  # stays failed
                D.all_to_all_vdev(comm, x, sp, out=out)
        comm.barrier()


def _begin(gpu, s):
    assert gpu.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(s), 0) == 0


def _end(gpu, s) -> ctypes.c_void_p:
    g, ex = ctypes.c_void_p(), ctypes.c_void_p()
    assert gpu.lib.cuStreamEndCapture(ctypes.c_void_p(s), ctypes.byref(g)) == 0
    assert gpu.lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(0)) == 0
    return ex


@pytest.mark.parametrize("n", [2, 3])
def test_fake_graph_capture_replays_with_new_routing(fake_cuda, n):
    """Dispatch + combine captured once in a CUDA graph (on the fake: the
    stream records its operations), replayed with new routing written into
    the same splits buffer each time: every replay is right, so flags,
    credits and the epoch really advance on the device. Point-to-point
    sends under capture are still refused."""

    @world(n, timeout=180)
    def body():
        seed = seeded()
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, s, W, E = comm.rank, gpu.stream(), 4, 2
        rows = 40
        with comm:
            x = FakeArray(gpu, (rows, W), "float32", s)
            sp = FakeArray(gpu, (n * E,), "int32", s)
            out = FakeArray(gpu, (n * rows, W), "float32", s)
            oso = FakeArray(gpu, (2, n * E), "int64", s)
            back = FakeArray(gpu, (rows, W), "float32", s)
            bso = FakeArray(gpu, (2, n * E), "int64", s)
            sp.host[...] = 0
            sp.host[0] = rows
            for _ in range(2):  # warm-up: sets up the workspaces
                D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso)
                D.all_to_all_vdev_2d_offset(comm, out, oso, E, out=back, out_splits_offsets=bso)
            D.synchronize(comm, s)
            comm.barrier()
            _begin(gpu, s)
            D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso)
            D.all_to_all_vdev_2d_offset(comm, out, oso, E, out=back, out_splits_offsets=bso)
            with pytest.raises(varcomm.InvalidArgument, match="cannot be captured in a CUDA graph"):
                comm._c.send(1 - r if n == 2 else (r + 1) % n, 0, x.ptr, 16, dtypes_u8(), (16,), 5.0, s)
            graph = _end(gpu, s)
            for rep in range(6):
                g = np.random.default_rng([seed, rep])
                splits = np.stack([g.multinomial(rows, np.ones(n * E) / (n * E)) for _ in range(n)])
                if rep == 3:
                    splits[:] = 0
                    splits[:, 0] = rows  # all to one rank's first expert
                xs = [_x(seed, rep, q, rows, W, "float32") for q in range(n)]
                x.host[...] = xs[r]
                sp.host[...] = splits[r]
                back.host[...] = 0
                assert gpu.lib.cuGraphLaunch(graph, ctypes.c_void_p(s)) == 0
                D.synchronize(comm, s)
                cnt = [int(splits[q][r * E + e]) for e in range(E) for q in range(n)]
                assert oso.host[0].tolist() == cnt, (seed, rep)
                assert np.array_equal(back.host, xs[r]), f"seed {seed} replay {rep}"
            comm.barrier()

    body()


def dtypes_u8() -> int:
    from varcomm import dtypes

    return dtypes.word(dtypes.UINT, 8)
