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

import contextlib
import ctypes
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import test_gpu
import varcomm
from test_gpu import GPU_REQ, FakeGpu
from varcomm.collectives import alltoall_device as D
from varcomm.testing import seeded, world

BOUND = 16 * 1024
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> str:
    """The CPU stand-in driver with the kernel bodies, built as test_gpu.py builds it."""
    why = _C_reason()
    if why:
        pytest.skip(why)
    return str(test_gpu.fake_cuda.__wrapped__(tmp_path_factory))


def _C_reason() -> str | None:
    """Skip reason when this build has no device all-to-all (no nvcc: no kernels in it)."""
    from varcomm import _C

    if not _C.build_info.get("device_a2a"):
        return "varcomm was built without nvcc (or without the device all-to-all): no kernels"
    return None


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


@pytest.mark.parametrize("delay_us", [0, 500])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_fake_vdev_matches_reference(fake_cuda, n, delay_us):
    """all_to_all_v with device splits, through the public entry point:
    out and the device counts/offsets equal a single-process reference, for
    random, skewed, zero-row and all-to-one routing, float32 and bfloat16,
    int32 and int64 splits. Every other call is checked only at the end, so
    calls run back to back on the stream (the next call's sends race the
    peers' receives of the last: credits and the epoch must hold them);
    FAKE_CUDA_DELAY_US delays every stream operation."""

    @world(n, timeout=180)
    def body():
        seed = seeded()
        os.environ["FAKE_CUDA_DELAY_US"] = str(delay_us)
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r = comm.rank
        s = gpu.stream()
        W = 8
        later = []

        def check(it, kind, dtype, splits, xs, out, got_so):
            want_rows = splits[:, r]
            oso = _host(got_so)
            assert oso[0].tolist() == want_rows.tolist(), (seed, it, kind, oso)
            assert oso[1].tolist() == np.concatenate([[0], np.cumsum(want_rows)[:-1]]).tolist()
            total = int(want_rows.sum())
            want = _expect(xs, splits, r)
            assert np.array_equal(out.host[:total], want), f"seed {seed} iteration {it} ({kind}, {dtype})"
            assert (out.host[total:].view(np.uint8) == 0xAB).all(), "written past the received rows"

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
                args = (it, kind, dtype, splits, xs, out, got_so)
                if it % 2:
                    later.append((args, x, sp))  # inputs stay alive until the stream ran
                    continue
                D.synchronize(comm, s)
                check(*args)
            D.synchronize(comm, s)
            for args, _x_keep, _sp_keep in later:
                check(*args)
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
def test_fake_vdev_calls_on_alternating_streams_are_ordered(fake_cuda):
    """Back-to-back calls of one communicator on two streams, never
    synchronized in between: each call's number is read on the device from
    the epoch the last call's receive advances, so a call on another stream
    must not start before the last one ended (it read the same number, and
    its sends overwrote slots the peers were still reading). varcomm orders
    them (the new stream waits for the old one's last call), as NCCL
    serializes a communicator's kernels; FAKE_CUDA_DELAY_US widens the race."""
    seed = seeded()
    os.environ["FAKE_CUDA_DELAY_US"] = "2000"
    try:
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, n, W = comm.rank, 2, 4
        streams = [gpu.stream(), gpu.stream()]
        with comm:
            kept = []
            for it in range(8):
                g = np.random.default_rng([seed, it])
                splits = g.integers(0, 9, (n, n))
                xs = [_x(seed, it, q, int(splits[q].sum()), W, "float32") for q in range(n)]
                s = streams[it % 2]
                x = FakeArray(gpu, xs[r].shape, "float32", s)
                x.host[...] = xs[r]
                sp = FakeArray(gpu, (n,), "int64", s)
                sp.host[...] = splits[r]
                out = FakeArray(gpu, (n * 64, W), "float32", s)
                D.all_to_all_vdev(comm, x, sp, out=out, timeout=20.0)
                kept.append((splits, xs, x, sp, out))
            for s in streams:
                D.synchronize(comm, s)
            for it, (splits, xs, _x_keep, _sp_keep, out) in enumerate(kept):
                total = int(splits[:, r].sum())
                assert np.array_equal(out.host[:total], _expect(xs, splits, r)), f"seed {seed} iteration {it}"
            comm.barrier()
    finally:
        os.environ.pop("FAKE_CUDA_DELAY_US", None)


@world(2, timeout=120)
def test_fake_arrays_of_an_explicit_stream_live_until_it_ran(fake_cuda):
    """Torch tensors in memory the GPU addresses (here: any host memory, for
    the stand-in), with an explicit stream=: nothing kept them alive. A
    temporary send_splits tensor was freed when the call returned and its
    memory reused before the delayed kernel read it: garbage splits
    ("send_splits ... give rows [0, 139727403844520)"), or another call's
    routing. Now the handle keeps them until their stream ran the call, and
    lets them go then (nothing piles up)."""
    os.environ["FAKE_CUDA_DELAY_US"] = "2000"
    try:
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, n = comm.rank, comm.world_size
        with comm:
            h = D._handle(comm)
            s = gpu.stream()
            for it in range(3):
                x = torch.full((2 * n, 4), float(10 * it + r))
                out, oso = D.all_to_all_vdev(comm, x, torch.tensor([2] * n), stream=s)  # a temporary splits tensor
                assert h.kept >= 1, "nothing kept alive while the stream had not run the call"
                junk = [torch.full((n,), 123456789, dtype=torch.int64) for _ in range(50)]  # reuses freed memory
                D.synchronize(comm, s)
                del junk
                assert _host(oso)[0].tolist() == [2] * n, f"call {it}: counts from a reused splits tensor"
                assert _host(out)[:2 * n, 0].tolist() == [float(10 * it + q) for q in range(n) for _ in range(2)]
                assert h.kept == 0, f"{h.kept} objects still kept after the stream ran"
            comm.barrier()
    finally:
        os.environ.pop("FAKE_CUDA_DELAY_US", None)


@world(2, timeout=120)
def test_fake_a_device_array_used_on_another_stream_lives_until_that_stream_ran(fake_cuda):
    """A DeviceArray (an output varcomm allocated, freed in its own stream's
    order) passed to a call on another explicit stream and dropped: it was
    freed once its own stream was idle, while the other stream's kernel had
    yet to read it. Now the handle keeps it until that stream ran the call."""
    import gc
    import weakref

    os.environ["FAKE_CUDA_DELAY_US"] = "20000"
    try:
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, n, W = comm.rank, comm.world_size, 4
        with comm:
            s1, s2 = gpu.stream(), gpu.stream()
            x = FakeArray(gpu, (2 * n, W), "float32", s1)
            x.host[...] = r
            sp = FakeArray(gpu, (n,), "int64", s1)
            sp.host[...] = 2
            out, oso = D.all_to_all_vdev(comm, x, sp, stream=s1)  # out: a DeviceArray ordered on s1
            D.synchronize(comm, s1)
            assert isinstance(out, D.DeviceArray)
            sp2 = FakeArray(gpu, (n,), "int64", s2)
            sp2.host[...] = [1] * n
            alive = weakref.ref(out)
            got, oso2 = D.all_to_all_vdev(comm, out, sp2, stream=s2)  # reads out on s2, 20 ms per operation
            del out
            gc.collect()
            assert alive() is not None, "freed while a kernel on another stream had yet to read it"
            D.synchronize(comm, s2)
            gc.collect()
            assert alive() is None, "still kept after its stream ran the call"
            assert _host(oso2)[0].tolist() == [1] * n
            assert _host(got)[:n, 0].tolist() == [float(r // 2)] * n  # row r of out (from rank r // 2) from each
            comm.barrier()
    finally:
        os.environ.pop("FAKE_CUDA_DELAY_US", None)


@world(2, timeout=120)
def test_fake_a_call_that_raises_an_earlier_error_keeps_its_arrays_too(fake_cuda):
    """A call raises the error of an earlier call once its own kernels are
    enqueued: its arrays were not kept (nor record_stream'ed) then, so its
    temporary splits tensor could be reused before the kernel read it
    ("send_splits ... give rows [0, 94872619954267)" on the next look)."""
    os.environ["FAKE_CUDA_DELAY_US"] = "20000"
    try:
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, n = comm.rank, comm.world_size
        with comm:
            h, s = D._handle(comm), gpu.stream()
            x = torch.full((2 * n, 4), float(r))
            D.all_to_all_vdev(comm, x, torch.tensor([2] * n), out=torch.empty((3 if r == 1 else 8, 4)), stream=s)
            if r == 0:
                D.synchronize(comm, s)
            else:
                time.sleep(0.5)  # its "out too small" is recorded, not raised yet
            x2 = torch.full((2 * n, 4), 10.0 + r)
            if r == 1:
                with pytest.raises(varcomm.MessageTooLarge):  # the earlier call's error, this call enqueued
                    D.all_to_all_vdev(comm, x2, torch.tensor([2] * n), stream=s)  # a temporary splits tensor
                assert h.kept >= 1, "the enqueued call's arrays were not kept"
                junk = [torch.full((n,), 123456789, dtype=torch.int64) for _ in range(200)]  # reuses freed memory
                D.synchronize(comm, s)  # the call itself was right
                del junk
            else:
                out, oso = D.all_to_all_vdev(comm, x2, torch.tensor([2] * n), stream=s)
                D.synchronize(comm, s)
                assert _host(oso)[0].tolist() == [2] * n
            comm.barrier()
    finally:
        os.environ.pop("FAKE_CUDA_DELAY_US", None)


@world(2, timeout=120)
def test_fake_synchronize_without_a_stream_waits_for_every_stream(fake_cuda):
    """The README's `D.synchronize(comm)`, no stream named: it waits for the
    calls on every stream they ran on (it took torch's current stream, which
    raised AssertionError without CUDA torch, and missed calls on other
    streams), then raises what the kernels recorded."""
    seed = seeded()
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, n, W = comm.rank, 2, 4
    with comm:
        kept = []
        for it, s in enumerate([gpu.stream(), gpu.stream()]):
            splits = np.random.default_rng([seed, it]).integers(0, 9, (n, n))
            xs = [_x(seed, it, q, int(splits[q].sum()), W, "float32") for q in range(n)]
            x = FakeArray(gpu, xs[r].shape, "float32", s)
            x.host[...] = xs[r]
            sp = FakeArray(gpu, (n,), "int64", s)
            sp.host[...] = splits[r]
            out, oso = D.all_to_all_vdev(comm, x, sp)
            kept.append((splits, xs, x, sp, out, oso))
        D.synchronize(comm)
        for it, (splits, xs, _xk, _sp, out, oso) in enumerate(kept):
            assert _host(oso)[0].tolist() == splits[:, r].tolist(), (seed, it)
            total = int(splits[:, r].sum())
            assert np.array_equal(_host(out)[:total], _expect(xs, splits, r)), f"seed {seed} call {it}"
        comm.barrier()


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
            with pytest.raises(varcomm.MessageTooLarge, match="rank 0's chunk for rank 1 had .*received 0 rows"):
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
            with pytest.raises(varcomm.InvalidArgument, match=r"for rank 1 give rows \[3, 12\) of an input of 10"):
                D.synchronize(comm, s)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="rank 0 passed send_splits outside its input"):
                D.synchronize(comm, s)
        clean_call()
        comm.barrier()


@world(2, timeout=120)
def test_fake_a_call_one_rank_refuses_or_raises_early_keeps_the_ranks_in_step(fake_cuda):
    """Device all-to-alls that fail on one rank's host leave every rank in
    step. (1) rank 1's out has another dtype: rank 1 raised InvalidArgument
    and launched nothing, so rank 0's call waited for a chunk that never came
    (its kernels timed out, and the device path failed for good). Now rank 1
    launches the call empty: rank 0 gets MessageMismatch naming it, 0 rows
    from it. (2) out too small on rank 1 only: its error was raised by its
    next call before that call was launched, so rank 0's next call paired with
    rank 1's one after. Now the next call is launched first, then raises the
    earlier call's error. In both, the call after pairs up."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W = comm.rank, gpu.stream(), 8

    def call(step, out_dtype="float32", out_rows=8):
        x = FakeArray(gpu, (4, W), "float32", s)
        x.host[...] = 100 * step + r
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (out_rows, W), out_dtype, s)
        _, oso = comm.all_to_all_v(x, sp, out=out)
        return x, sp, out, oso

    def paired(step):
        keep = call(step)
        D.synchronize(comm, s)
        assert _host(keep[3])[0].tolist() == [2, 2]
        assert keep[2].host[:4, 0].tolist() == [100 * step, 100 * step, 100 * step + 1, 100 * step + 1]

    with comm:
        paired(0)  # sets up
        if r == 1:
            with pytest.raises(varcomm.InvalidArgument, match="must agree in dtype"):
                call(1, out_dtype="int32")
        else:
            keep = call(1)
            with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused its part of this call"):
                D.synchronize(comm, s)
            assert _host(keep[3])[0].tolist() == [2, 0]
        paired(2)
        keep = call(3, out_rows=3 if r == 1 else 8)  # rank 1: rank 1's own 2 rows do not fit after rank 0's
        D.synchronize(comm, s) if r == 0 else time.sleep(0.5)  # rank 1: its error is recorded, not raised
        if r == 1:
            with pytest.raises(varcomm.MessageTooLarge, match=r"do not fit out .*call 4\)"):
                keep = call(4)
        else:
            keep = call(4)
        D.synchronize(comm, s)
        paired(5)


@world(2, timeout=120)
def test_fake_ranks_out_of_step_are_told_not_fed_each_others_rows(fake_cuda):
    """Rank 0 runs a MoE dispatch (all_to_all_vdev_2d) where rank 1 runs a
    combine (all_to_all_vdev_2d_offset), as after an error one rank skipped a
    call: the rows were of the same dtype and width, so each took the other's
    chunk as its own call's (silently wrong tokens). Now both raise
    MessageMismatch naming the peer and both calls, 0 rows from it; the next
    matching calls pair up."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W, E = comm.rank, gpu.stream(), 4, 2
    with comm:
        x = FakeArray(gpu, (8, W), "float32", s)
        x.host[...] = 10 * r + 1
        sp = FakeArray(gpu, (2 * E,), "int64", s)
        sp.host[...] = [1, 1, 1, 1]  # 4 rows: one per (rank, expert)
        so = FakeArray(gpu, (2, 2 * E), "int64", s)
        so.host[...] = [[1, 1, 1, 1], [0, 2, 1, 3]]  # (what a dispatch of the same rows returns: counts, offsets)
        if r == 0:
            out, oso = D.all_to_all_vdev_2d(comm, x, sp, E)
        else:
            out, oso = D.all_to_all_vdev_2d_offset(comm, x, so, E, out_rows=8)
        theirs = "all_to_all_vdev_2d_offset" if r == 0 else "all_to_all_vdev_2d"
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {1 - r} ran {theirs} .*out of step"):
            D.synchronize(comm, s)
        assert int(_host(oso)[0].sum()) == 2  # its own rows only
        out, oso = D.all_to_all_vdev_2d(comm, x, sp, E)
        D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == [1, 1, 1, 1]
        comm.barrier()


@world(2, timeout=120)
def test_fake_a_backward_met_by_a_forward_is_out_of_step(fake_cuda):
    """Rank 1 skipped its backward and went on: its next step's MoE dispatch
    (all_to_all_vdev_2d) met rank 0's combine backward, which is a dispatch
    of the gradients (the same call, the same row shape): each took the
    other's rows as its own, silently (rank 0's token gradients were rank
    1's next tokens). Device chunks now carry whether their call is an
    autograd backward's, so both raise MessageMismatch "out of step", naming
    both calls, and the next matching calls pair up."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W, E = comm.rank, gpu.stream(), 4, 2
    with comm:
        x = torch.full((4, W), 10.0 * r + 1)
        sp = torch.tensor([1, 1, 1, 1])
        out, oso = torch.zeros(16, W), torch.zeros(2, 2 * E, dtype=torch.int64)
        D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso, stream=s, _backward=(r == 0))
        mine = "an autograd backward's " if r == 0 else ""
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {1 - r} ran {'' if r == 0 else 'an autograd '}.*"
                                                          f"where rank {r} ran {mine}all_to_all_vdev_2d.*out of step"):
            D.synchronize(comm, s)
        assert oso[0].tolist() == ([1, 0, 1, 0] if r == 0 else [0, 1, 0, 1])  # its own rows only
        D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso, stream=s, _backward=True)
        D.synchronize(comm, s)
        assert oso[0].tolist() == [1, 1, 1, 1]
        assert sorted(out[:4, 0].tolist()) == sorted([1.0, 1.0, 11.0, 11.0])
        comm.barrier()


@world(2, timeout=120)
def test_fake_moe_argument_errors_on_one_rank_are_refused_to_the_other(fake_cuda):
    """moe_device.dispatch with float topk_ids, and moe.combine with integer
    expert outputs, on rank 1 only: rank 0's same call fails with
    MessageMismatch naming rank 1 (its kernels waited for rank 1's chunk until
    the timeout, and the device path failed for good), and the next dispatch
    and combine pair up."""
    from varcomm.collectives import moe, moe_device

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        ids = torch.full((3, 1), 1 - r)
        tok = torch.full((3, 4), float(r))
        if r == 1:
            with pytest.raises(varcomm.InvalidArgument, match="integer"):
                moe_device.dispatch(comm, tok, ids.double() + 0.7, torch.ones(3, 1), 2, stream=s)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused its part"):
                moe_device.dispatch(comm, tok, ids, torch.ones(3, 1), 2, stream=s)
        et, tpe, h = moe_device.dispatch(comm, tok, ids, torch.ones(3, 1), 2, stream=s)
        assert int(tpe.sum()) == 3 and torch.equal(et[:3], torch.full((3, 4), float(1 - r)))
        if r == 1:
            with pytest.raises(varcomm.InvalidArgument, match="floating-point expert outputs"):
                moe.combine(comm, et.long(), h)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused its part"):
                moe.combine(comm, et, h)
        assert torch.equal(moe.combine(comm, et, h), tok)
        comm.barrier()


@world(2, timeout=120)
def test_fake_receiver_does_not_trust_the_senders_header(fake_cuda):
    """Rank 1 plays a buggy peer: instead of calling, it writes rank 0's slot
    for it through its IPC mapping, first with rows over the slot (out has
    room for them), then with 3 rows whose count says 1000 (past out). Rank 0
    raises the error naming rank 1 (it read the slot past its end, then wrote
    1000 rows into an out of 8), receives 0 rows from it and writes nothing
    past its own 2 rows; after each, rank 1 catches up and the next call works."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W = comm.rank, gpu.stream(), 8
    cap_rows = BOUND // (W * 4)
    slot_of = gpu.lib.fake_cuda_a2a_slot
    slot_of.restype, slot_of.argtypes = ctypes.c_ulonglong, [ctypes.c_uint, ctypes.c_uint]

    def call(out_rows):
        x = FakeArray(gpu, (4, W), "float32", s)
        x.host[...] = r + 1
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (out_rows, W), "float32", s)
        out.host.view(np.uint8)[...] = 0xAB
        _, oso = comm.all_to_all_v(x, sp, out=out)
        return out, oso

    cases = [(4 * cap_rows, 4 * cap_rows, 4 * cap_rows + 8, "rank 1's chunk for rank 0 had .*received 0 rows"),
             (3, 1000, 8, "rank 1's chunk for rank 0 says 3 rows but its per-expert counts add up to 1000")]
    with comm:
        call(8)
        D.synchronize(comm, s)  # both set up; rank 1's honest header (dtype, row bytes) stays in the slot
        comm.barrier()  # rank 0 has read that slot: rank 1 may write it
        for call_no, (rows, count, out_rows, msg) in enumerate(cases, start=2):
            if r == 1:
                words = np.frombuffer((ctypes.c_char * 72).from_address(slot_of(0, 1)), dtype=np.uint64)
                words[1], words[4], words[8] = rows, 0, count  # rows, status ok, counts[0]
                words[0] = call_no  # the flag, last
            comm.barrier()
            if r == 0:
                out, oso = call(out_rows)
                with pytest.raises(varcomm.VarcommError, match=msg):
                    D.synchronize(comm, s)
                assert _host(oso)[0].tolist() == [2, 0]
                assert (out.host[:2] == 1).all()
                assert (out.host[2:].view(np.uint8) == 0xAB).all(), "written past the rows it took"
            comm.barrier()  # rank 0 read the planted slot: rank 1's own send may overwrite it
            if r == 1:
                call(8)  # its own call of that number: takes rank 0's chunk, gives its credit
                D.synchronize(comm, s)
            comm.barrier()
        out, oso = call(8)
        D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == [2, 2]
        assert (out.host[:2] == 1).all() and (out.host[2:4] == 2).all()
        comm.barrier()


@world(2, timeout=120)
def test_fake_huge_splits_do_not_wrap_the_prefix_sum(fake_cuda):
    """Rank 0's first three splits are huge and sum, mod 2**64, to 1: block 1
    must refuse its chunk for rank 1 (it once summed them, signed overflow,
    and sent rows [1, 2) as if the splits were fine), so rank 1 gets 0 rows
    from rank 0 and an error; the next call works."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W, E = comm.rank, gpu.stream(), 4, 3
    X = 0x5555555555555555  # 3 * X + 2 == 2**64 + 1

    def call(splits):
        x = FakeArray(gpu, (4, W), "float32", s)
        x.host[...] = r + 1
        sp = FakeArray(gpu, (2 * E,), "int64", s)
        sp.host[...] = np.array(splits, dtype=np.uint64).view(np.int64)
        out = FakeArray(gpu, (64, W), "float32", s)
        out.host.view(np.uint8)[...] = 0xAB
        _, oso = D.all_to_all_vdev_2d(comm, x, sp, E, out=out)
        return out, oso

    with comm:
        out, oso = call([X, X, X + 2, 1, 0, 0] if r == 0 else [1, 0, 0, 1, 0, 0])
        if r == 0:
            with pytest.raises(varcomm.InvalidArgument, match="send_splits for rank 0 give rows"):
                D.synchronize(comm, s)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="rank 0 passed send_splits outside its input"):
                D.synchronize(comm, s)
            assert _host(oso)[0].tolist() == [0, 1, 0, 0, 0, 0]
            assert (out.host[:1] == 2).all() and (out.host[1:].view(np.uint8) == 0xAB).all()
        out, oso = call([1, 0, 0, 1, 0, 0])
        D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == [1, 1, 0, 0, 0, 0]
        comm.barrier()


@pytest.mark.parametrize("bad_splits", [False, True], ids=["alone", "after_a_per_call_error"])
@world(2, timeout=120)
def test_fake_timeout_fails_the_path(fake_cuda, bad_splits):
    """Rank 1 never calls: rank 0's kernel gives up after its timeout
    (TimeoutError naming rank 1) and the device path stays failed; nothing
    hangs. With bad_splits, rank 0's splits are also bad for rank 1 (a per-call
    error, recorded first): it is raised first, then the timeout in the same
    call, which must still be recorded and keep the path failed (it was
    dropped, being the call's second error, and the kernel then handed out
    credits and a new epoch for a chunk it never received, so later calls
    paired up the wrong messages)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        x = FakeArray(gpu, (4, 4), "float32", s)
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (64, 4), "float32", s)
        D.all_to_all_vdev(comm, x, sp, out=out)  # sets up (both ranks), then only rank 0 calls
        D.synchronize(comm, s)
        comm.barrier()
        if r == 0:
            first = sp
            if bad_splits:
                first = FakeArray(gpu, (2,), "int64", s)
                first.host[...] = [2, 9]  # rows [2, 11) of 4
            D.all_to_all_vdev(comm, x, first, out=out, timeout=1.0)
            if bad_splits:  # raised first (errors come in call order, none hidden behind the hard one)
                with pytest.raises(varcomm.InvalidArgument, match=r"give rows \[2, 11\) .*call 2\)"):
                    D.synchronize(comm, s)
            with pytest.raises(varcomm.TimeoutError, match="timed out waiting for rank 1"):
                D.synchronize(comm, s)
            with pytest.raises(varcomm.TimeoutError):  # stays failed
                D.all_to_all_vdev(comm, x, sp, out=out)
        comm.barrier()


def _hold(gpu, s: int):
    """Stream s runs nothing enqueued after this until the returned release()
    (its next operation waits on a word of device memory)."""
    word = gpu.alloc(8)
    ctypes.c_uint64.from_address(word).value = 0
    assert gpu.lib.cuStreamWaitValue64_v2(ctypes.c_void_p(s), ctypes.c_ulonglong(word), ctypes.c_ulonglong(1),
                                          ctypes.c_uint(0)) == 0

    def release() -> None:
        ctypes.c_uint64.from_address(word).value = 1

    return release


def _rows_call(gpu, comm, s, rows_to, W=8, x_rows=None, out_rows=64):
    """all_to_all_v with device splits on stream s: rows_to[d] rows to rank d."""
    r = comm.rank
    x = FakeArray(gpu, (x_rows if x_rows is not None else sum(rows_to), W), "float32", s)
    x.host[...] = np.arange(x.host.size).reshape(x.host.shape) % 97 + 100 * r
    sp = FakeArray(gpu, (comm.world_size,), "int64", s)
    sp.host[...] = rows_to
    out = FakeArray(gpu, (out_rows, W), "float32", s)
    _, oso = comm.all_to_all_v(x, sp, out=out)
    return x, sp, out, oso


@world(2, timeout=120)
def test_fake_errors_of_calls_not_raised_yet_are_all_kept(fake_cuda):
    """Three calls enqueued before the stream ran any: call 2 with a chunk over
    the slot, call 3 with splits past x (both on rank 0), call 4 clean. Each
    call's error is raised once, in call order, by successive synchronize()s,
    on both ranks, then nothing. (One record that each error overwrote: call
    3's error replaced call 2's, which was never raised.)"""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    cap_rows = BOUND // (8 * 4)
    with comm:
        keep = [_rows_call(gpu, comm, s, [1, 1])]  # call 1 sets up
        D.synchronize(comm, s)
        release = _hold(gpu, s)
        keep.append(_rows_call(gpu, comm, s, [1, cap_rows + 1] if r == 0 else [1, 1]))
        keep.append(_rows_call(gpu, comm, s, [3, 9] if r == 0 else [1, 1], x_rows=10 if r == 0 else None))
        keep.append(_rows_call(gpu, comm, s, [1, 1]))
        release()
        if r == 0:
            with pytest.raises(varcomm.MessageTooLarge, match=r"chunk for rank 1 has .*call 2\)"):
                D.synchronize(comm, s)
            with pytest.raises(varcomm.InvalidArgument, match=r"give rows \[3, 12\) .*call 3\)"):
                D.synchronize(comm, s)
        else:
            with pytest.raises(varcomm.VarcommError, match=r"rank 0's chunk for rank 1 had .*call 2\)"):
                D.synchronize(comm, s)
            with pytest.raises(varcomm.VarcommError, match=r"rank 0 passed send_splits outside .*call 3\)"):
                D.synchronize(comm, s)
        D.synchronize(comm, s)  # both raised: nothing left
        assert _host(keep[-1][3])[0].tolist() == [1, 1]  # call 4 went through
        comm.barrier()


@world(2, timeout=120)
def test_fake_more_unraised_errors_than_the_ring_are_reported_lost(fake_cuda):
    """34 calls with bad splits on rank 0 before the host looks: the ring keeps
    the last 32; the first look says 2 earlier errors were lost (never
    silently), then the 32 kept are raised in call order."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        keep = [_rows_call(gpu, comm, s, [1, 1])]  # call 1 sets up
        D.synchronize(comm, s)
        release = _hold(gpu, s)
        for _ in range(34):  # calls 2 .. 35
            keep.append(_rows_call(gpu, comm, s, [3, 9] if r == 0 else [1, 1], x_rows=10 if r == 0 else None))
        release()
        gpu.sync(s)
        with pytest.raises(varcomm.InvalidArgument, match="2 errors of earlier calls were overwritten"):
            D.synchronize(comm, s)
        for call in range(4, 36):
            with pytest.raises(varcomm.VarcommError, match=rf"call {call}\)"):
                D.synchronize(comm, s)
        D.synchronize(comm, s)
        comm.barrier()


@pytest.mark.parametrize("after", [0, 1, 2, 3, 4])
@world(2, timeout=120)
def test_fake_a_header_rewritten_while_read_is_used_as_checked(fake_cuda, after):
    """Rank 1 plays a buggy peer that rewrites its header during rank 0's
    receive: rank 0's slot for it says 3 rows, counts [3], and the count word
    becomes 1000 after `after` reads. Each receive block reads it once and
    uses what it checked: rank 0 takes the 3 rows or refuses the chunk
    (naming the count), never writes past its 8-row out nor reads past the
    slot. (The count was read again after the check: 1000 rows copied.)"""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W = comm.rank, gpu.stream(), 8
    slot_of = gpu.lib.fake_cuda_a2a_slot
    slot_of.restype, slot_of.argtypes = ctypes.c_ulonglong, [ctypes.c_uint, ctypes.c_uint]
    tamper = gpu.lib.fake_cuda_a2a_tamper
    tamper.restype, tamper.argtypes = ctypes.c_long, [ctypes.c_ulonglong, ctypes.c_long, ctypes.c_ulonglong]

    def call(out):
        x = FakeArray(gpu, (4, W), "float32", s)
        x.host[...] = r + 1
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        _, oso = comm.all_to_all_v(x, sp, out=out)
        return x, sp, oso

    class View:  # the first 8 rows of a larger allocation: the rest is a guard
        def __init__(self, a, rows):
            self.__cuda_array_interface__ = dict(a.__cuda_array_interface__, shape=(rows, W))

    with comm:
        guard = FakeArray(gpu, (2048, W), "float32", s)
        keep = [call(FakeArray(gpu, (8, W), "float32", s))]
        D.synchronize(comm, s)  # both set up; rank 1's honest header (dtype, row bytes) stays in the slot
        comm.barrier()  # rank 0 has read that slot: rank 1 may write it
        if r == 1:
            words = np.frombuffer((ctypes.c_char * 72).from_address(slot_of(0, 1)), dtype=np.uint64)
            words[1], words[4], words[8] = 3, 0, 3  # rows, status ok, counts[0]
            words[0] = 2  # the flag (call 2), last
        comm.barrier()
        if r == 0:
            guard.host.view(np.uint8)[...] = 0xAB
            tamper(slot_of(0, 1) + 64, after, 1000)
            _, _, oso = keep_ = call(View(guard, 8))
            gpu.sync(s)
            reads = tamper(0, 0, 0)
            got = _host(oso)[0].tolist()
            assert got in ([2, 3], [2, 0]), got
            if got == [2, 0]:
                with pytest.raises(varcomm.VarcommError, match="says 3 rows but its per-expert counts add up to 1000"):
                    D.synchronize(comm, s)
            D.synchronize(comm, s)
            assert (guard.host[:2] == 1).all()
            assert (guard.host[2 + got[1]:].view(np.uint8) == 0xAB).all(), "written past the rows it took"
            assert _host(oso)[1].tolist() == [0, 2]
            assert reads == 2, f"the count was read {reads} times by 2 receive blocks"
            del keep_
        comm.barrier()  # rank 0 read the planted slot: rank 1's own call 2 may overwrite it
        if r == 1:
            keep.append(call(FakeArray(gpu, (8, W), "float32", s)))
            D.synchronize(comm, s)
        comm.barrier()
        _, _, oso = call(FakeArray(gpu, (8, W), "float32", s))
        D.synchronize(comm, s)
        assert _host(oso)[0].tolist() == [2, 2]
        comm.barrier()


@world(2, timeout=120)
def test_fake_a_destroyed_stream_is_never_used_again(fake_cuda):
    """A call on stream a, then a destroyed (CUDA allows it: what it has
    enqueued still runs), then calls on stream b, synchronize without a
    stream, close: nothing uses a again (the fake driver fails any use of a
    destroyed stream: the call on b raised cuStreamIsCapturing's error on a,
    and synchronize() cuStreamQuery's, for good)."""
    seed = seeded()
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, n, W = comm.rank, 2, 4
    with comm:
        kept = []
        a = gpu.stream()
        for it, s in enumerate([a, gpu.stream(), None]):
            s = s or kept[-1][0]
            splits = np.random.default_rng([seed, it]).integers(0, 9, (n, n))
            xs = [_x(seed, it, q, int(splits[q].sum()), W, "float32") for q in range(n)]
            x = FakeArray(gpu, xs[r].shape, "float32", s)
            x.host[...] = xs[r]
            sp = FakeArray(gpu, (n,), "int64", s)
            sp.host[...] = splits[r]
            out, oso = D.all_to_all_vdev(comm, x, sp)
            kept.append((s, splits, xs, x, sp, out, oso))
            if s == a:
                assert gpu.lib.cuStreamDestroy_v2(ctypes.c_void_p(a)) == 0
        D.synchronize(comm)
        for it, (_s, splits, xs, _x_keep, _sp, out, oso) in enumerate(kept):
            assert _host(oso)[0].tolist() == splits[:, r].tolist(), (seed, it)
            total = int(splits[:, r].sum())
            assert np.array_equal(_host(out)[:total], _expect(xs, splits, r)), f"seed {seed} call {it}"
        comm.barrier()


@world(2, timeout=120)
def test_fake_graph_replayed_on_another_stream_is_an_error(fake_cuda):
    """A call captured on stream s, its graph replayed on stream t while a
    call on s is still running (rank 1 has not joined it): the two calls
    read one call number, which would pair up the wrong chunks; the send
    kernel finds the overlap, and rank 0's device path fails with an error
    that says to replay on the capture stream (it timed out instead, or
    worse, with rank 1 in the calls, took the wrong data)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, t = comm.rank, gpu.stream(), gpu.stream()
    with comm:
        x = FakeArray(gpu, (4, 4), "float32", s)
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (64, 4), "float32", s)
        D.all_to_all_vdev(comm, x, sp, out=out)  # sets up
        D.synchronize(comm, s)
        _begin(gpu, s)
        # What the captured call writes (its counts and offsets) must outlive the
        # graph, as torch's graph pool keeps it: dropped, a replay wrote into
        # freed memory (the fake's stream thread crashed under load).
        captured = D.all_to_all_vdev(comm, x, sp, out=out, timeout=2.0)  # noqa: F841  (kept, see above)
        graph = _end(gpu, s)
        comm.barrier()
        if r == 0:
            assert gpu.lib.cuGraphLaunch(graph, ctypes.c_void_p(t)) == 0
            D.all_to_all_vdev(comm, x, sp, out=out, timeout=2.0)
            gpu.sync(t)
            with pytest.raises(varcomm.InvalidArgument, match="started before the previous call had ended.*"
                               "replayed on the stream it was captured on"):
                D.synchronize(comm, s)
            with pytest.raises(varcomm.InvalidArgument, match="started before"):  # the path stays failed
                D.all_to_all_vdev(comm, x, sp, out=out)
        comm.barrier()


@world(2, timeout=120)
def test_fake_progress_on_another_thread_leaves_a_capture_intact(fake_cuda):
    """PyTorch captures a graph in GLOBAL mode by default, where the driver
    refuses any thread's event query, stream query or free while it lasts
    (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates the capture.
    varcomm's progress on another thread (here synchronize: a stream query,
    event queries, deferred frees) runs in THREAD_LOCAL mode: the capture
    ends intact, and the other thread's call succeeds (it had failed with
    that error, and an output freed on such an answer was freed while in use)."""
    import threading

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    s, t = gpu.stream(), gpu.stream()
    with comm:
        x = FakeArray(gpu, (4, 4), "float32", t)
        sp = FakeArray(gpu, (2,), "int64", t)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (64, 4), "float32", t)
        D.all_to_all_vdev(comm, x, sp, out=out)
        errors: list[BaseException] = []

        def progress() -> None:
            try:
                D.synchronize(comm, t)
                D.synchronize(comm)
            except BaseException as e:  # (reported below)
                errors.append(e)

        _begin(gpu, s)
        th = threading.Thread(target=progress)
        th.start()
        th.join(60)
        _end(gpu, s)  # asserts the capture was not invalidated
        assert not errors, errors
        comm.barrier()


def _begin(gpu, s):
    assert gpu.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(s), 0) == 0


def _end(gpu, s) -> ctypes.c_void_p:
    g, ex = ctypes.c_void_p(), ctypes.c_void_p()
    assert gpu.lib.cuStreamEndCapture(ctypes.c_void_p(s), ctypes.byref(g)) == 0
    assert gpu.lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, ctypes.c_ulonglong(0)) == 0
    return ex


@world(2, timeout=120)
def test_fake_a_first_call_under_capture_says_to_warm_up(fake_cuda):
    """The first device call sets the path up (GPU memory, a collective),
    which a capture refuses: it said "cannot allocate its N bytes ... lower
    the bound", sending the user the wrong way (helper-57). Now it says to
    make one call before capturing, and one made after that sets it up."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    s = gpu.stream()
    with comm:
        x = FakeArray(gpu, (4, 4), "float32", s)
        sp = FakeArray(gpu, (2,), "int64", s)
        sp.host[...] = [2, 2]
        out = FakeArray(gpu, (64, 4), "float32", s)
        _begin(gpu, s)
        said = "its first call on a communicator sets it up .* which a CUDA graph capture refuses .* make one call"
        with pytest.raises(varcomm.InvalidArgument, match=said):
            D.all_to_all_vdev(comm, x, sp, out=out)
        gpu.lib.cuStreamEndCapture(ctypes.c_void_p(s), ctypes.byref(ctypes.c_void_p()))  # (invalidated: an error)
        comm.barrier()
        oso = FakeArray(gpu, (2, 2), "int64", s)
        D.all_to_all_vdev(comm, x, sp, out=out, out_splits_offsets=oso)
        D.synchronize(comm, s)
        assert oso.host.tolist() == [[2, 2], [0, 2]]
        comm.barrier()


@world(2, timeout=120)
def test_fake_graph_replays_write_the_dispatch_number_and_check_it(fake_cuda):
    """Two dispatches and a combine captured in one graph, rank 1's combine
    undoing the second dispatch where rank 0's undoes the first: each replay
    writes the dispatches' new call numbers into their device words (the
    kernels do, not the host at capture), and each raises MessageMismatch
    naming both on every rank."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W, E, n, rows = comm.rank, gpu.stream(), 4, 2, 2, 8
    with comm:
        x = FakeArray(gpu, (rows, W), "float32", s)
        sp = FakeArray(gpu, (n * E,), "int32", s)
        out = FakeArray(gpu, (n * rows, W), "float32", s)
        oso, oso2, bso = (FakeArray(gpu, (2, n * E), "int64", s) for _ in range(3))
        back = FakeArray(gpu, (rows, W), "float32", s)
        first, second = FakeArray(gpu, (1,), "int64", s), FakeArray(gpu, (1,), "int64", s)
        sp.host[...] = 0
        sp.host[0] = rows
        D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso)  # set-up outside the capture
        D.synchronize(comm, s)
        _begin(gpu, s)
        D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso, _dispatch=first)
        D.all_to_all_vdev_2d(comm, x, sp, E, out=out, out_splits_offsets=oso2, _dispatch=second)
        D.all_to_all_vdev_2d_offset(comm, out, oso, E, out=back, out_splits_offsets=bso,
                                    _dispatch=first if r == 0 else second)
        graph = _end(gpu, s)
        seen = []
        for _ in range(3):
            first.host[...] = second.host[...] = -1
            assert gpu.lib.cuGraphLaunch(graph, ctypes.c_void_p(s)) == 0
            with pytest.raises(varcomm.MessageMismatch, match=r"passed the handle of dispatch call \d+ to .* where "
                                                              r"rank \d passed the handle of dispatch call \d+"):
                D.synchronize(comm, s)
            seen.append((int(first.host[0]), int(second.host[0])))
        # calls 1 (outside), then 3 per replay: the dispatches are calls 2, 3; 5, 6; 8, 9
        assert seen == [(2, 3), (5, 6), (8, 9)], seen
        comm.barrier()


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


def _expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """Local expert e's function (global expert id e): differentiable and expert-specific."""
    return rows * (1.0 + 0.5 * e) + 0.25 * e


@pytest.mark.parametrize("n", [2, 3])
def test_fake_moe_dispatch_combine_autograd(fake_cuda, n):
    """moe_device.dispatch/combine (routing on the device, all_to_all_vdev_2d
    underneath) on torch tensors with an explicit stream: y and the gradients
    of tokens, expert computation and topk_weights equal one process's; in
    the second step about a third of the (token, k) pairs are masked (-1,
    DeepEP's dropped pair): not sent, adding 0 to y and taking no gradient."""

    @world(n, timeout=180)
    def body():
        from varcomm.collectives import moe_device

        seed = seeded()
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, s = comm.rank, gpu.stream()
        T, H, K, E = 12, 6, 2, 2 * n
        with comm:
            for it in range(3):
                g = torch.Generator().manual_seed(seed * 10 + it)
                toks = [torch.randn(T, H, generator=g) for _ in range(n)]
                ids = [torch.randint(0, E, (T, K), generator=g) for _ in range(n)]
                if it == 1:
                    ids = [torch.where(torch.rand(T, K, generator=g) < 0.35, -1, i) for i in ids]
                if it == 2:
                    ids = [torch.zeros(T, K, dtype=torch.int64) for _ in range(n)]  # all to expert 0 (rank 0)
                ws = [torch.rand(T, K, generator=g) for _ in range(n)]
                tok = toks[r].clone().requires_grad_(True)
                w = ws[r].clone().requires_grad_(True)
                et, tpe, h = moe_device.dispatch(comm, tok, ids[r], w, E, stream=s)
                assert isinstance(h, moe_device.DeviceMoEHandle)
                off = torch.cumsum(tpe, 0) - tpe
                outs = torch.zeros_like(et)
                pieces = []
                for e in range(E // n):
                    a, b = int(off[e]), int(off[e] + tpe[e])
                    pieces.append((a, b, _expert(r * (E // n) + e, et[a:b])))
                for a, b, v in pieces:
                    outs = outs.index_copy(0, torch.arange(a, b), v)
                y = moe_device.combine(comm, outs, h)
                (y * (1 + torch.arange(H))).sum().backward()
                # one process
                tok_ref = toks[r].clone().requires_grad_(True)
                w_ref = ws[r].clone().requires_grad_(True)
                per = torch.stack([torch.stack([_expert(int(ids[r][t, k]), tok_ref[t]) if ids[r][t, k] >= 0
                                                else torch.zeros(H) for k in range(K)]) for t in range(T)])
                y_ref = (per * w_ref[..., None]).sum(1)
                (y_ref * (1 + torch.arange(H))).sum().backward()
                assert torch.allclose(y, y_ref, atol=1e-5), (seed, it)
                assert torch.allclose(tok.grad, tok_ref.grad, atol=1e-5), (seed, it, "tokens' gradient")
                assert torch.allclose(w.grad, w_ref.grad, atol=1e-5), (seed, it, "weights' gradient")
                want = sum(int((ids[q] // (E // n) == r).sum()) for q in range(n))
                assert int(tpe.sum()) == want
            comm.barrier()

    body()


def _grad_weight(d: int, rows: int, W: int) -> torch.Tensor:
    """Rank d's weight of each element of its out in the loss (known on every rank)."""
    return 1 + d + 0.01 * torch.arange(rows)[:, None] + 0.1 * torch.arange(W)[None, :]


@pytest.mark.parametrize("ne", [1, 2])
@pytest.mark.parametrize("n", [2, 3])
def test_fake_vdev_autograd(fake_cuda, n, ne):
    """all_to_all_vdev (ne=1) and all_to_all_vdev_2d (ne=2) of a torch tensor
    that requires grad: the result carries the graph, and x.grad equals the
    single-process reference (each row's gradient from where its receiver
    put it; rows past the sent ones 0). Before, the gradient silently stopped
    at the exchange (x.grad stayed None). Random and zero-row routing, with
    FAKE_CUDA_DELAY_US; the calls after stay in step."""

    @world(n, timeout=180)
    def body():
        seed = seeded()
        os.environ["FAKE_CUDA_DELAY_US"] = "200"
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
        r, s, W, G = comm.rank, gpu.stream(), 4, n * ne
        with comm:
            for it in range(4):
                g = np.random.default_rng([seed, it])
                splits = g.integers(0, 6, (n, G))  # splits[q][d * ne + e]: rows rank q sends to expert e of d
                if it == 1:
                    splits[g.random((n, G)) < 0.5] = 0
                spare = 2  # rows of x past the sent ones: no gradient
                x = torch.tensor(_x(seed, it, r, int(splits[r].sum()) + spare, W, "float32"), requires_grad=True)
                sp = torch.tensor(splits[r], dtype=torch.int64)
                if ne == 1:
                    out, oso = D.all_to_all_vdev(comm, x, sp, stream=s)
                else:
                    out, oso = D.all_to_all_vdev_2d(comm, x, sp, ne, stream=s)
                assert out.requires_grad and not oso.requires_grad
                total = int(oso[0].sum())
                assert total == int(splits[:, r * ne:(r + 1) * ne].sum()), (seed, it)
                (out[:total] * _grad_weight(r, total, W)).sum().backward()
                # Reference: where row j of x landed on its receiver d (expert-major: for each expert e,
                # the rows from source 0, 1, ...).
                want = torch.zeros_like(x)
                j = 0
                for d in range(n):
                    wd = _grad_weight(d, n * BOUND, W)
                    for e in range(ne):
                        before = int(splits[:, d * ne:d * ne + e].sum()) + int(splits[:r, d * ne + e].sum())
                        k = int(splits[r, d * ne + e])
                        want[j:j + k] = wd[before:before + k]
                        j += k
                assert x.grad is not None, (seed, it, "the gradient stopped at the exchange")
                assert torch.equal(x.grad, want), (seed, it, x.grad, want)
            comm.barrier()

    body()


@world(2, timeout=120)
def test_fake_vdev_autograd_edges(fake_cuda):
    """Review findings on the differentiable device-split call: (1) the
    returned out_splits_offsets modified in place before backward: torch
    raised on that rank only, and its peer's backward waited for its timeout
    (the device path failed); now backward keeps a copy of its own and both
    gradients are right. (2) create_graph=True raised an error naming
    all_to_all_vdev_2d_offset, a call the user never made; now the first-order
    gradient is right and only a second-order backward raises (torch's
    once_differentiable error, on every rank: the ranks stay in step). (3) a
    call's timeout= longer than the communicator's: the host wait after a
    call on CPU tensors used the communicator's and gave up (PeerFailure)."""
    from test_gpu import FakeGpu

    gpu = FakeGpu(fake_cuda)
    os.environ["VARCOMM_NVLINK"] = "1"
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    comm = varcomm.init(transport="shm", timeout=2, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    sp = torch.tensor([2, 2])
    with comm:
        x = torch.full((4, 2), 1.0 + r, requires_grad=True)
        out, oso = D.all_to_all_vdev(comm, x, sp, stream=s)
        oso.zero_()  # (1): the caller reuses it
        (out[:4] * torch.arange(1.0, 5.0)[:, None]).sum().backward()
        assert x.grad[:, 0].tolist() == ([1, 2, 1, 2] if r == 0 else [3, 4, 3, 4])
        x = torch.full((4, 2), 1.0 + r, requires_grad=True)
        out, oso = D.all_to_all_vdev(comm, x, sp, stream=s)
        (gx,) = torch.autograd.grad((out[:4] ** 2).sum(), x, create_graph=True)  # (2)
        assert gx[:, 0].tolist() == [2.0 * (1 + r)] * 4
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gx.sum().backward()
        comm.barrier(timeout=20)
        if r == 1:
            time.sleep(4)  # (3): past the communicator's 2 s, within the call's 8 s
        x = torch.full((4, 2), 1.0 + r, requires_grad=True)
        out, oso = D.all_to_all_vdev(comm, x, sp, stream=s, timeout=8)
        out[:4].sum().backward()
        assert out[:4, 0].tolist() == [1, 1, 2, 2] and x.grad[:, 0].tolist() == [1.0] * 4
        comm.barrier(timeout=20)


@world(2, timeout=120)
def test_fake_synchronize_past_its_timeout_is_a_timeout_not_a_peer_failure(fake_cuda):
    """Rank 0 synchronizes with timeout=1 on a call rank 1 never makes: the
    host wait gives up and aborts the kernels. That was reported as
    PeerFailure "a peer failed or the communicator closed", though no peer
    did; now it is TimeoutError naming the wait (and rank 1)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        x, sp, out = torch.ones(4, 2), torch.tensor([2, 2]), torch.zeros(8, 2)
        D.all_to_all_vdev(comm, x, sp, out=out, stream=s)  # set up
        D.synchronize(comm, s)
        if r == 0:
            D.all_to_all_vdev(comm, x, sp, out=out, stream=s)
            with pytest.raises(varcomm.TimeoutError, match=r"within the 1 s the host waited .*waiting for rank 1"):
                D.synchronize(comm, s, timeout=1)
        comm.barrier(timeout=30)


@world(2, timeout=120)
def test_fake_vdev_with_grad_and_out_is_refused_to_the_peer(fake_cuda):
    """x requires grad with out= (the result cannot carry the graph), and
    all_to_all_vdev_2d_offset with x requiring grad (not differentiable): the
    rank raises InvalidArgument naming what to do, its peer's call gets
    MessageMismatch naming it (the call is launched empty), and the next
    call pairs up. Before, the gradient silently stopped there."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s, W = comm.rank, gpu.stream(), 4
    keep: list = []
    with comm:
        def call(grad: bool, step: int):
            x = torch.full((4, W), 10.0 * step + r, requires_grad=grad)
            out, sp = torch.zeros(8, W), torch.tensor([2, 2])
            keep.append((x, sp))  # (CPU tensors: alive until the stream ran the call)
            return D.all_to_all_vdev(comm, x, sp, out=out, stream=s)

        for step, offset in enumerate([False, True]):
            if r == 0:
                with pytest.raises(varcomm.InvalidArgument, match="requires grad.*x.detach()"):
                    if offset:
                        D.all_to_all_vdev_2d_offset(comm, torch.ones(4, W, requires_grad=True),
                                                    torch.tensor([[2, 2], [0, 2]]), 1, stream=s)
                    else:
                        call(True, step)
            else:
                got = call(False, step)
                with pytest.raises(varcomm.MessageMismatch, match="rank 0 refused its part of this call"):
                    D.synchronize(comm, s)
                assert _host(got[1])[0].tolist() == [0, 2]
            with torch.no_grad():
                out, oso = call(True, 5)  # under no_grad: the plain call
            D.synchronize(comm, s)
            assert _host(oso)[0].tolist() == [2, 2] and out[:4, 0].tolist() == [50, 50, 51, 51]
        comm.barrier()


@world(2, timeout=120)
def test_fake_moe_combine_over_the_wrong_communicator_is_refused_where_the_peer_waits(fake_cuda):
    """Rank 0 passes another communicator to moe.combine with a device
    handle: InvalidArgument, and the refusal (an empty launch) goes to the
    handle's communicator, where rank 1's combine waits, which raises naming
    rank 0; both communicators stay in step (it was refused on the one passed
    by mistake)."""
    from varcomm.collectives import alltoall as A
    from varcomm.collectives import moe, moe_device

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    other = varcomm.init(transport="shm", timeout=30, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    E = 2
    with comm, other:
        tok = torch.full((3, 4), float(r + 1))
        ids = torch.full((3, 1), 1 - r)
        w = torch.ones(3, 1)
        et, _, h = moe_device.dispatch(comm, tok, ids, w, E, stream=s)
        if r == 0:
            with pytest.raises(varcomm.InvalidArgument, match="another communicator"):
                moe.combine(other, et, h)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="rank 0"):
                moe.combine(comm, et, h)
                D.synchronize(comm, s)
        et, _, h = moe_device.dispatch(comm, tok, ids, w, E, stream=s)  # in step again
        assert torch.equal(moe.combine(comm, et, h), tok)
        got, _ = A.all_to_all_v(other, torch.arange(2) + 10 * r, [1, 1])
        assert got.tolist() == [r, 10 + r]
        comm.barrier()


@world(2, timeout=120)
def test_fake_moe_a_handle_of_an_earlier_dispatch_is_told_even_where_the_row_counts_agree(fake_cuda):
    """Rank 0 combines (and, through autograd, runs backward) with the handle
    of the dispatch before, whose row counts equal this one's: the chunks
    passed every check, rank 0 got rank 1's rows of the other dispatch back
    and rank 1 went on, with no error. Now the dispatch's kernel writes its
    call number into the handle, and the combine's and backward's chunks carry
    it: both ranks raise MessageMismatch naming both dispatch calls, and the
    next calls pair up."""
    from varcomm.collectives import moe_device

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    E, T = 2, 4
    told = r"passed the handle of dispatch call (\d+) to .* where rank \d passed the handle of dispatch call " \
           r"(?!\1)\d+ \(device all-to-all call \d+\): a rank combined with the handle of another dispatch"
    with comm:
        ids = torch.tensor([[0], [1], [0], [1]])
        tok = torch.arange(T * 3, dtype=torch.float32).reshape(T, 3) + 100 * r
        w = torch.ones(T, 1)
        et, _, old = moe_device.dispatch(comm, tok, ids, w, E, stream=s)
        assert torch.equal(moe_device.combine(comm, et, old), tok)
        et, _, new = moe_device.dispatch(comm, tok.flip(0), ids, w, E, stream=s)  # the same counts, other rows
        with pytest.raises(varcomm.MessageMismatch, match=told):
            moe_device.combine(comm, et, old if r == 0 else new)
        # dispatch's backward (a combine of the gradients) with the stale handle
        t = tok.clone().requires_grad_(True)
        et, _, h1 = moe_device.dispatch(comm, t, ids, w, E, stream=s)
        et2, _, h2 = moe_device.dispatch(comm, t, ids, w, E, stream=s)
        y = moe_device.combine(comm, et2 * 2, h2)
        assert torch.equal(y, 2 * tok)
        stale = moe_device.combine(comm, et * 3, h1)  # h1's combine, fine on both ranks
        assert torch.equal(stale, 3 * tok)
        with pytest.raises(varcomm.MessageMismatch, match=told):
            (y if r == 0 else stale).sum().backward()  # combine's backwards: rank 0 h2's, rank 1 h1's
        # dispatch's backward alone (a combine of the gradients), rank 0 through h2, rank 1 through h1
        et1, _, h1 = moe_device.dispatch(comm, t, ids, w, E, stream=s)
        et2, _, h2 = moe_device.dispatch(comm, t, ids, w, E, stream=s)
        with pytest.raises(varcomm.MessageMismatch, match=told):
            (et2 if r == 0 else et1).sum().backward()
        et, _, h = moe_device.dispatch(comm, tok, ids, w, E, stream=s)  # in step again
        assert torch.equal(moe_device.combine(comm, et, h), tok)
        comm.barrier()


@world(2, timeout=120)
def test_fake_moe_topk_ids_out_of_range_are_named_and_nothing_is_sent(fake_cuda):
    """topk_ids outside [-1, E) on rank 1 (not read on the host): rank 1's
    dispatch raises InvalidArgument counting them, rank 0's MessageMismatch
    naming rank 1, nothing of rank 1's reaches rank 0 (before, the routing's
    scatter indexed out of range: a device-side assert on a GPU, which ends the
    CUDA context), and the next dispatch pairs up."""
    from varcomm.collectives import moe_device

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    E = 4
    with comm:
        tok = torch.full((3, 4), float(r + 1))
        good = torch.tensor([[0, 3], [2, -1], [1, 2]])
        ids = torch.tensor([[0, 4], [2, -2], [1, 2]]) if r == 1 else good
        w = torch.ones(3, 2)
        if r == 1:
            with pytest.raises(varcomm.InvalidArgument, match=r"on rank 1: 2 topk_ids lie outside \[0, num_experts\)"):
                moe_device.dispatch(comm, tok, ids, w, E, stream=s)
        else:
            with pytest.raises(varcomm.MessageMismatch, match=r"rank 1 passed send_splits .*topk_ids"):
                et, tpe, h = moe_device.dispatch(comm, tok, ids, w, E, stream=s)
        w[1, 1] = float("nan")  # a masked pair's weight is not read
        et, tpe, h = moe_device.dispatch(comm, tok, good, w, E, stream=s)
        # rank r owns experts 2r, 2r + 1: each rank routes experts 0, 1 once and 2 twice, 3 once (rank 0's own row)
        assert tpe.tolist() == ([2, 2] if r == 0 else [4, 2]), tpe.tolist()
        y = moe_device.combine(comm, et, h)
        assert torch.equal(y, tok * torch.tensor([[2.0], [1.0], [2.0]]))  # a masked pair adds 0
        comm.barrier()


@world(2, timeout=120, expect_exit={1: None})
def test_fake_dead_peer_aborts_the_kernels(fake_cuda):
    """Rank 1 dies after set-up; rank 0's kernels (no timeout of their own)
    spin on its flag until synchronize notices the death and aborts them:
    PeerFailure within seconds, the path stays failed, close does not hang."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    x = FakeArray(gpu, (4, 4), "float32", s)
    sp = FakeArray(gpu, (2,), "int64", s)
    sp.host[...] = [2, 2]
    out = FakeArray(gpu, (64, 4), "float32", s)
    D.all_to_all_vdev(comm, x, sp, out=out)
    D.synchronize(comm, s)
    comm.barrier()
    if r == 1:
        os._exit(3)
    D.all_to_all_vdev(comm, x, sp, out=out)  # the kernels would wait 30 s (the timeout): the abort comes first
    # PeerFailure ("aborted"), not TimeoutError: the abort, not the kernels' timeout, ended the wait.
    with pytest.raises(varcomm.PeerFailure, match=r"aborted .*rank 1 .*\(the kernel was waiting for rank 1\)"):
        D.synchronize(comm, s)
    with pytest.raises(varcomm.PeerFailure):
        D.all_to_all_vdev(comm, x, sp, out=out)
    comm.close()


@world(2, timeout=120, expect_exit={1: None})
def test_fake_dead_peer_aborts_the_kernels_without_synchronize(fake_cuda):
    """Rank 1 dies after set-up; rank 0 waits on its stream through the
    driver (as torch.cuda.synchronize would), never through varcomm: the
    kernels' spin on the dead peer still ends in an abort (PeerFailure), not
    at the kernels' 30 s timeout (TimeoutError, as before: nothing aborted
    them unless varcomm's synchronize was the one waiting)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    x = FakeArray(gpu, (4, 4), "float32", s)
    sp = FakeArray(gpu, (2,), "int64", s)
    sp.host[...] = [2, 2]
    out = FakeArray(gpu, (64, 4), "float32", s)
    D.all_to_all_vdev(comm, x, sp, out=out)
    D.synchronize(comm, s)
    comm.barrier()
    if r == 1:
        os._exit(3)
    D.all_to_all_vdev(comm, x, sp, out=out)
    gpu.sync(s)
    with pytest.raises(varcomm.PeerFailure, match=r"aborted .*rank 1 .*\(the kernel was waiting for rank 1\)"):
        D.synchronize(comm, s)
    comm.close()


@world(3, timeout=120, expect_exit={2: None})
def test_fake_dead_peer_is_the_one_named_not_the_live_one_waited_for(fake_cuda):
    """Rank 2 dies; rank 1 joins the next call a second late, so rank 0's
    kernel is waiting for live rank 1 when the abort comes: the error named
    rank 1 ("aborted while waiting for rank 1"), the rank that was fine. Now
    it names rank 2, what happened to it, and carries it as the peer."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, n, s = comm.rank, comm.world_size, gpu.stream()
    x = FakeArray(gpu, (2 * n, 4), "float32", s)
    sp = FakeArray(gpu, (n,), "int64", s)
    sp.host[...] = [2] * n
    out = FakeArray(gpu, (64, 4), "float32", s)
    D.all_to_all_vdev(comm, x, sp, out=out)
    D.synchronize(comm, s)
    comm.barrier()
    if r == 2:
        os._exit(3)
    if r == 1:
        time.sleep(1)
    D.all_to_all_vdev(comm, x, sp, out=out)
    with pytest.raises(varcomm.PeerFailure, match=r"aborted .*: .*rank 2 .*exited" if r == 0 else "aborted") as e:
        D.synchronize(comm, s)
    if r == 0:  # (rank 1 may find rank 0 closed first)
        assert e.value.peer == 2, e.value.peer
    comm.close()


# ---------------------------------------------------------------------------
# torch CUDA tensors on a real GPU


def _gpu_comm(**kw):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return varcomm.init(transport="shm", timeout=60, **kw)


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_vdev_matches_reference_without_host_sync():
    """CUDA splits: all_to_all_v returns the bound-sized out and the device
    counts/offsets; torch's sync debug mode (error) proves nothing in the
    call synchronizes the host."""
    seed = seeded()
    with _gpu_comm(bound=BOUND) as comm:
        r, n, W = comm.rank, comm.world_size, 8
        for it, kind in enumerate(["random", "skewed", "zero", "all-to-one"] * 2):
            g = np.random.default_rng([seed, it])
            splits = _routing(g, n, kind, it)
            dt = torch.bfloat16 if it % 2 else torch.float32
            xs = [torch.from_numpy(_x(seed, it, q, int(splits[q].sum()), W, "float32")).to(dt) for q in range(n)]
            x = xs[r].cuda()
            sp = torch.tensor(splits[r], device="cuda", dtype=torch.int64 if it % 3 else torch.int32)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out, oso = comm.all_to_all_v(x, sp)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            D.synchronize(comm)
            want_rows = splits[:, r]
            assert oso.cpu()[0].tolist() == want_rows.tolist(), (seed, it)
            total = int(want_rows.sum())
            want = torch.cat([xs[q][int(splits[q][:r].sum()):int(splits[q][:r + 1].sum())] for q in range(n)])
            assert torch.equal(out[:total].cpu(), want), f"seed {seed} iteration {it} ({kind}, {dt})"
            # Differentiable, with no host sync in forward or backward: x.grad is what its receivers weighed.
            xg = xs[r].float().cuda().requires_grad_(True)
            weight = _grad_weight(r, n * D.capacity_rows(comm, 4 * W), W).cuda()  # (a blocking copy: before)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out, oso = comm.all_to_all_v(xg, sp)
                (out * weight).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            D.synchronize(comm)
            want_g, j = torch.zeros(xg.shape), 0
            for d in range(n):
                before, k = int(splits[:r, d].sum()), int(splits[r, d])
                want_g[j:j + k] = _grad_weight(d, n * BOUND, W)[before:before + k]
                j += k
            assert torch.equal(xg.grad.cpu(), want_g), (seed, it, "gradient")
        comm.barrier()


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_moe_device_autograd_and_graph_replay():
    """moe.dispatch/combine with CUDA topk_ids take the device path: y and
    every gradient equal one process's; then the forward is captured in a
    CUDA graph once and replayed with new routing copied into its input."""
    from varcomm import moe
    from varcomm.collectives import moe_device

    seed = seeded()
    with _gpu_comm(bound=1 << 20) as comm:
        r, n = comm.rank, comm.world_size
        T, H, K, E = 64, 32, 2, 4
        g = torch.Generator().manual_seed(seed)
        toks = [torch.randn(T, H, generator=g) for _ in range(n)]
        ids = [torch.randint(0, E, (T, K), generator=g) for _ in range(n)]
        ws = [torch.rand(T, K, generator=g) for _ in range(n)]
        tok = toks[r].cuda().requires_grad_(True)
        w = ws[r].cuda().requires_grad_(True)
        et, tpe, h = moe.dispatch(comm, tok, ids[r].cuda(), w, E)
        assert isinstance(h, moe_device.DeviceMoEHandle) and tpe.is_cuda
        off = (torch.cumsum(tpe, 0) - tpe).tolist()
        outs = torch.zeros_like(et)
        for e, (a, c) in enumerate(zip(off, tpe.tolist())):
            outs = outs.index_copy(0, torch.arange(a, a + c, device="cuda"), _expert(r * (E // n) + e, et[a:a + c]))
        y = moe.combine(comm, outs, h)
        (y * (1 + torch.arange(H, device="cuda"))).sum().backward()
        tok_ref = toks[r].clone().requires_grad_(True)
        w_ref = ws[r].clone().requires_grad_(True)
        per = torch.stack([torch.stack([_expert(int(ids[r][t, k]), tok_ref[t]) for k in range(K)]) for t in range(T)])
        y_ref = (per * w_ref[..., None]).sum(1)
        (y_ref * (1 + torch.arange(H))).sum().backward()
        assert torch.allclose(y.cpu(), y_ref, atol=1e-4), seed
        assert torch.allclose(tok.grad.cpu(), tok_ref.grad, atol=1e-4), seed
        assert torch.allclose(w.grad.cpu(), w_ref.grad, atol=1e-4), seed
        # graph: dispatch + identity experts + combine, replayed with new routing
        static_ids = ids[r].cuda()
        static_tok = toks[r].cuda()
        static_w = torch.ones(T, K, device="cuda") / K
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up outside the capture
                et, tpe, h = moe.dispatch(comm, static_tok, static_ids, static_w, E)
                moe.combine(comm, et, h)
        torch.cuda.current_stream().wait_stream(s)
        D.synchronize(comm)
        comm.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            et, tpe, h = moe.dispatch(comm, static_tok, static_ids, static_w, E)
            y_static = moe.combine(comm, et, h)
        for rep in range(5):
            gg = torch.Generator().manual_seed(seed * 100 + rep)
            new_ids = torch.randint(0, E, (n, T, K), generator=gg)[r]
            static_ids.copy_(new_ids)
            static_tok.copy_(torch.randn(n, T, H, generator=gg)[r])
            graph.replay()
            D.synchronize(comm)
            assert torch.allclose(y_static, static_tok, atol=1e-5), (seed, rep)  # identity experts, weights sum to 1
        comm.barrier()


def test_moe_bench_is_there_without_a_gpu():
    """`varcomm-bench moe --help` works on a CPU-only machine (the bench itself needs CUDA)."""
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT / "bench"),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "varcomm_bench", "moe", "--help"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "nccl two-phase" in r.stdout and "host-blocked" in r.stdout, r.stdout


P2P_W = 4


def _p2p_pair(fake_cuda, extra: int, fill: float | None = None):
    """send_rows / recv_rows set up on the stand-in driver (setup_p2p made),
    and what the point-to-point tests share: (gpu, comm, stream, cap: the rows
    of P2P_W float32 one message may have, x: cap + extra rows to send from,
    rows: send_rows' count, out: cap rows to receive into, got: recv_rows'
    count). Enter the comm."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    s, cap = gpu.stream(), BOUND // (P2P_W * 4)
    D.setup_p2p(comm)
    x = FakeArray(gpu, (cap + extra, P2P_W), "float32", s)
    if fill is not None:
        x.host[...] = fill
    return (gpu, comm, s, cap, x, FakeArray(gpu, (1,), "int64", s), FakeArray(gpu, (cap, P2P_W), "float32", s),
            FakeArray(gpu, (1,), "int64", s))


@world(2, timeout=120)
def test_fake_p2p_device_size_and_graph_replay(fake_cuda):
    """send_rows / recv_rows: the row count lives on the device on both
    sides; eager messages (0 rows, a self-send, one over the bound: refused
    and reported on both sides), then a send and a receive captured once and
    replayed with new sizes and data (the pair's sequence numbers, flags and
    credits advance on the device)."""
    seed = seeded()
    gpu, comm, s, cap, x, rows, out, got = _p2p_pair(fake_cuda, 5)
    r, W = comm.rank, P2P_W
    with comm:

        def data(i, n):
            return np.random.default_rng([seed, i]).standard_normal((n, W)).astype(np.float32)

        for i, n in enumerate([7, 0, cap, cap + 1, 3]):
            if r == 0:
                x.host[:n] = data(i, n)
                rows.host[0] = n
                D.send_rows(comm, x, rows, 1)
                if n > cap:
                    with pytest.raises(varcomm.MessageTooLarge, match="over the device slot capacity"):
                        D.synchronize(comm, s)
                D.synchronize(comm, s)
            else:
                out.host.view(np.uint8)[...] = 0xAB
                D.recv_rows(comm, out, got, 0)
                if n > cap:
                    with pytest.raises(varcomm.VarcommError, match="received 0 rows"):
                        D.synchronize(comm, s)
                    assert got.host[0] == 0 and (out.host.view(np.uint8) == 0xAB).all()
                    continue
                D.synchronize(comm, s)
                assert got.host[0] == n and np.array_equal(out.host[:n], data(i, n)), (seed, i, n)
                assert (out.host[n:].view(np.uint8) == 0xAB).all()
        # self-send
        x.host[:2] = data(50, 2)
        rows.host[0] = 2
        D.send_rows(comm, x, rows, r)
        D.recv_rows(comm, out, got, r)
        D.synchronize(comm, s)
        assert got.host[0] == 2 and np.array_equal(out.host[:2], data(50, 2))
        comm.barrier()
        # captured once, replayed with new sizes
        _begin(gpu, s)
        if r == 0:
            D.send_rows(comm, x, rows, 1)
        else:
            D.recv_rows(comm, out, got, 0)
        graph = _end(gpu, s)
        for rep in range(6):
            n = int(np.random.default_rng([seed, 100 + rep]).integers(0, cap + 1))
            if r == 0:
                x.host[:n] = data(100 + rep, n)
                rows.host[0] = n
            assert gpu.lib.cuGraphLaunch(graph, ctypes.c_void_p(s)) == 0
            D.synchronize(comm, s)
            if r == 1:
                assert got.host[0] == n and np.array_equal(out.host[:n], data(100 + rep, n)), (seed, rep, n)
        comm.barrier()


@world(2, timeout=120)
def test_fake_p2p_send_after_an_unraised_error_is_still_sent(fake_cuda):
    """send_rows over the slot (recorded, not raised: no synchronize), then a
    good send_rows: it raised the earlier error before it was launched, so the
    receiver's recv_rows waited for a message never sent (its kernel timed
    out, the path failed for good). Now it is sent, then raises the error."""
    gpu, comm, s, cap, x, rows, out, got = _p2p_pair(fake_cuda, 1, fill=5.0)
    r = comm.rank
    with comm:
        if r == 0:
            rows.host[0] = cap + 1
            D.send_rows(comm, x, rows, 1)
            time.sleep(0.5)  # its error is recorded
            three = FakeArray(gpu, (1,), "int64", s)
            three.host[0] = 3
            with pytest.raises(varcomm.MessageTooLarge, match="over the device slot capacity"):
                D.send_rows(comm, x, three, 1)
            D.synchronize(comm, s)
        else:
            D.recv_rows(comm, out, got, 0)
            with pytest.raises(varcomm.VarcommError, match="received 0 rows"):
                D.synchronize(comm, s)
            D.recv_rows(comm, out, got, 0)
            D.synchronize(comm, s)
            assert got.host[0] == 3 and (out.host[:3] == 5.0).all()
        comm.barrier()


@world(2, timeout=120)
def test_fake_p2p_errors_speak_of_messages_and_row_counts(fake_cuda):
    """Each way a send_rows/recv_rows pair can go wrong, raised on both ranks
    in the words of point-to-point (a message, a row count, recv_rows' out),
    not the all-to-all's chunks and splits; the pair keeps working after each.
    Catches: the all-to-all's wording (helper-62), a wrong rank or call number."""
    gpu, comm, s, cap, x, rows, out, got = _p2p_pair(fake_cuda, 1, fill=2.0)
    r, W = comm.rank, P2P_W
    with comm:
        small = FakeArray(gpu, (3, W), "float32", s)
        ints = FakeArray(gpu, (cap, W), "int32", s)
        call = " \\(device point-to-point call {}\\)"
        # (rows sent, receiver's out, sender's error, receiver's error); calls 1, 3, 5, 7 (each case's
        # good message after it is the next)
        cases = [
            (cap + 1, out, (varcomm.MessageTooLarge, f"rank 0's message for rank 1 has {cap + 1} rows .*" +
                            call.format(1) + ": nothing of it was sent"),
             (varcomm.MessageTooLarge, f"rank 0's message for rank 1 had {cap + 1} rows .*" + call.format(1) +
              ": it received 0 rows")),
            (5, small, None, (varcomm.MessageTooLarge, "rank 0's 5 rows do not fit out's 3 rows" + call.format(3) +
                              ": dropped .*pass a larger out")),
            (-1, out, (varcomm.InvalidArgument, f"rank 0's row count for rank 1 is -1, for an input of {cap + 1} "
                       "rows" + call.format(5)),
             (varcomm.MessageMismatch, "rank 0's row count was negative or past its input" + call.format(5))),
            (4, ints, None, (varcomm.MessageMismatch, "rank 0 sent rows of float32, 16 bytes each, but rank 1 "
                             "receives int32, 16 bytes each" + call.format(7) + ": its message was dropped .*"
                             "recv_rows' out must have the sender's dtype")),
        ]
        for n, dst, sent, received in cases:
            want = sent if r == 0 else received
            if r == 0:
                rows.host[0] = n
                D.send_rows(comm, x, rows, 1)
            else:
                D.recv_rows(comm, dst, got, 0)
            if want is None:
                D.synchronize(comm, s)
            else:
                with pytest.raises(want[0], match=want[1]) as e:
                    D.synchronize(comm, s)
                assert "all-to-all" not in str(e.value) and "chunk" not in str(e.value), e.value
            if r == 1:
                assert got.host[0] == 0
            # the pair still works
            if r == 0:
                rows.host[0] = 2
                D.send_rows(comm, x, rows, 1)
            else:
                D.recv_rows(comm, out, got, 0)
            D.synchronize(comm, s)
            if r == 1:
                assert got.host[0] == 2 and (out.host[:2] == 2.0).all()
        comm.barrier()


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_p2p_device_size_graph_replay():
    """send_rows / recv_rows captured in a CUDA graph on both ranks, replayed
    with new row counts written on the device."""
    seed = seeded()
    with _gpu_comm(bound=BOUND) as comm:
        r, W = comm.rank, 16
        cap = BOUND // (W * 4)
        D.setup_p2p(comm)
        x = torch.zeros(cap, W, device="cuda")
        rows = torch.zeros(1, dtype=torch.int64, device="cuda")
        out = torch.zeros(cap, W, device="cuda")
        got = torch.zeros(1, dtype=torch.int64, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture
            D.send_rows(comm, x, rows, 1 - r)
            D.recv_rows(comm, out, got, 1 - r)
        torch.cuda.current_stream().wait_stream(s)
        D.synchronize(comm)
        comm.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            D.send_rows(comm, x, rows, 1 - r)
            D.recv_rows(comm, out, got, 1 - r)
        for rep in range(8):
            g = torch.Generator().manual_seed(seed * 10 + rep)
            n = [int(v) for v in torch.randint(0, cap + 1, (2,), generator=g)]
            data = torch.randn(2, cap, W, generator=g)
            x.copy_(data[r])
            rows.fill_(n[r])
            graph.replay()
            D.synchronize(comm)
            assert int(got.item()) == n[1 - r], (seed, rep)
            assert torch.equal(out[:n[1 - r]].cpu(), data[1 - r][:n[1 - r]]), (seed, rep)
        comm.barrier()


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on cuda:<_device>, recording record_stream
    calls: how the device checks and the caching allocator's bookkeeping are
    reached without a GPU (the kernels never run on it here)."""

    _device = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._device)

    def record_stream(self, s) -> None:  # type: ignore[override]
        _CudaLike.recorded.append((self.data_ptr(), s))

    recorded: list = []


def _cuda_like(shape, dtype=torch.float32, device=0) -> _CudaLike:
    t = torch.zeros(shape, dtype=dtype).as_subclass(_CudaLike)
    t._device = device
    return t


class _StubHandle:
    def __init__(self) -> None:
        self.launches = 0
        self.refused: list[int] = []  # the streams of calls refused (launched empty)

    def launch(self, *args) -> None:
        self.launches += 1

    def refuse(self, stream, timeout) -> None:
        self.refused.append(stream)
        self.launches += 1


def _stub_comm(device: int = 0):
    from types import SimpleNamespace

    return SimpleNamespace(world_size=2, _cuda_device=device, _timeout=5.0, _device_a2a=_StubHandle(),
                           options=SimpleNamespace(bound=BOUND))


@pytest.fixture
def fake_torch_streams(monkeypatch) -> None:
    """torch.cuda's stream calls without CUDA: current_stream is handle 7, ExternalStream a tuple."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: type("S", (), {"cuda_stream": 7})())
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda s, device=None: ("stream", s, str(device)))


@pytest.mark.parametrize("which", ["x", "splits", "out", "out_splits_offsets"])
def test_torch_tensor_on_another_gpu_is_refused(which, fake_torch_streams):
    """A torch CUDA tensor on another GPU than the communicator's is refused
    before its data is launched, naming the tensor, both devices and what to
    do (the kernels would address it through the wrong device); the call is
    launched empty on its stream, so the peers stay in step. Verified on the
    CPU stand-in only (tensors that say they are on cuda:1)."""
    comm = _stub_comm(device=0)
    args = {"x": _cuda_like((4, 2)), "splits": _cuda_like((2,), torch.int64),
            "out": _cuda_like((8, 2)), "out_splits_offsets": _cuda_like((2, 2), torch.int64)}
    args[which] = _cuda_like(tuple(args[which].shape), args[which].dtype, device=1)
    with pytest.raises(varcomm.InvalidArgument, match=rf"{which} is on cuda:1 but .* runs on cuda:0: move it there"):
        D.all_to_all_vdev(comm, args["x"], args["splits"], out=args["out"],
                          out_splits_offsets=args["out_splits_offsets"], stream=5)
    assert comm._device_a2a.refused == [5] and comm._device_a2a.launches == 1


def test_explicit_stream_records_torch_tensors(fake_torch_streams):
    """With stream=, every torch CUDA tensor the kernels use (x, splits, out,
    out_splits_offsets) is record_stream'ed for that stream, so the caching
    allocator does not reuse it while they run; on torch's current stream
    nothing needs it. Verified on the CPU stand-in only."""
    comm = _stub_comm()
    ts = [_cuda_like((4, 2)), _cuda_like((2,), torch.int64), _cuda_like((8, 2)), _cuda_like((2, 2), torch.int64)]
    _CudaLike.recorded.clear()
    D.all_to_all_vdev(comm, ts[0], ts[1], out=ts[2], out_splits_offsets=ts[3], stream=5)
    assert sorted(_CudaLike.recorded) == sorted((t.data_ptr(), ("stream", 5, "cuda:0")) for t in ts)
    _CudaLike.recorded.clear()
    D.all_to_all_vdev(comm, ts[0], ts[1], out=ts[2], out_splits_offsets=ts[3])
    assert _CudaLike.recorded == []
    assert comm._device_a2a.launches == 2


def test_moe_device_with_an_explicit_stream_runs_torchs_ops_on_it(fake_torch_streams, monkeypatch):
    """moe_device.dispatch/combine (and the differentiable all_to_all_vdev) of
    CUDA tensors with stream=: the routing,
    the gathers and the weighted sum ran on torch's current stream while the
    kernels ran on the given one, unordered: a kernel could read rows not
    gathered yet. Now torch's ops of the call run on the given stream (so
    does their backward: autograd uses the forward's stream). Verified on the
    CPU stand-in only (tensors that say they are on cuda:0; a stub launch)."""
    from varcomm.collectives import moe_device

    inside: list = []
    launched_inside: list = []

    @contextlib.contextmanager
    def on(stream):
        inside.append(stream)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    for name in ("zeros", "empty", "ones"):  # (tensors made on "cuda:0": CPU ones here)
        made = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, device=None, _made=made, **k: _made(*a, **k).as_subclass(_CudaLike))
    comm = _stub_comm()
    comm._device_p2p = None
    launch = comm._device_a2a.launch
    comm._device_a2a.launch = lambda *a: (launched_inside.append(list(inside)), launch(*a))
    alloc = lambda shape, dtype: _cuda_like(shape, dtype)  # noqa: E731
    T, H, K, E = 4, 2, 2, 4
    tokens = _cuda_like((T, H))
    ids = _cuda_like((T, K), torch.int64)
    w = _cuda_like((T, K))
    et, _, h = moe_device.dispatch(comm, tokens, ids, w, E, stream=5, alloc=alloc)
    moe_device.combine(comm, _cuda_like(tuple(et.shape)), h)
    want = [("stream", 5, "cuda:0")]
    assert launched_inside == [want, want], launched_inside
    launched_inside.clear()
    et, _, h = moe_device.dispatch(comm, tokens, ids, w, E, alloc=alloc)  # no stream=: torch's current one
    assert launched_inside == [[]]
    # The differentiable device-split call: its out and its saved copy of out_splits_offsets were made on the
    # current stream while the kernel wrote them on the given one.
    launched_inside.clear()
    x = _cuda_like((4, H)).requires_grad_(True)
    out, oso = D.all_to_all_vdev(comm, x, _cuda_like((2,), torch.int64), stream=5)
    assert out.requires_grad and launched_inside == [want], launched_inside


@world(2, timeout=120)
def test_fake_moe_float_topk_ids_are_refused(fake_cuda):
    """moe_device.dispatch (the route moe.dispatch takes for CUDA topk_ids)
    refuses float topk_ids as moe.dispatch does on the host route: 1.7 was
    truncated to expert 1 and the tokens went on to it. Every rank refuses
    before a kernel runs, so the next call pairs up."""
    from varcomm.collectives import moe_device

    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    r, s = comm.rank, gpu.stream()
    with comm:
        ids = torch.full((3, 1), 1 - r)
        tok = torch.full((3, 4), float(r))
        with pytest.raises(varcomm.InvalidArgument, match="integer"):
            moe_device.dispatch(comm, tok, ids.double() + 0.7, torch.ones(3, 1), 2, stream=s)
        et, tpe, h = moe_device.dispatch(comm, tok, ids, torch.ones(3, 1), 2, stream=s)
        assert int(tpe.sum()) == 3 and torch.equal(et[:3], torch.full((3, 4), float(1 - r)))
        comm.barrier()


class _CloseTimed:
    """A device all-to-all handle that notes when close() (which frees its workspace) returned."""

    def __init__(self, h):
        self.h, self.closed_at = h, None

    def __getattr__(self, k):
        return getattr(self.h, k)

    def close(self):
        self.h.close()
        self.closed_at = time.monotonic()


@world(2, timeout=120)
def test_fake_close_frees_the_workspace_after_the_peers_kernels(fake_cuda, tmp_path_factory):
    """A peer's receive kernel writes this rank's credit into this rank's
    workspace (through its CUDA IPC mapping) at the end of every call. Rank 1
    runs its kernels late (FAKE_CUDA_DELAY_US on rank 1 only); rank 0's call
    ends once rank 1's send ran, and rank 0 closes at once. Its workspace must
    be freed only after rank 1's kernels ran (close waits for its peers, as
    nvlink's slots do). Catches: the workspace freed first (a late peer wrote
    freed device memory)."""
    if os.environ["RANK"] == "1":
        os.environ["FAKE_CUDA_DELAY_US"] = "200000"
    try:
        gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    finally:
        os.environ.pop("FAKE_CUDA_DELAY_US", None)
    r, s = comm.rank, gpu.stream()
    x = FakeArray(gpu, (4, 4), "float32", s)
    sp = FakeArray(gpu, (2,), "int64", s)
    sp.host[...] = [2, 2]
    out = FakeArray(gpu, (64, 4), "float32", s)
    path = str(tmp_path_factory.mktemp("close")) if r == 0 else ""
    if r == 0:
        comm.send(np.frombuffer(path.encode(), dtype=np.uint8), 1)
    else:
        path = comm.recv(0).tobytes().decode()
    D.all_to_all_vdev(comm, x, sp, out=out)
    comm._device_a2a = timed = _CloseTimed(comm._device_a2a)
    D.synchronize(comm, s)
    done = time.monotonic()  # this rank's kernels (and so its writes into the peer's workspace) ran
    comm.close()
    Path(path, f"{r}.tmp").write_text(f"{done!r} {timed.closed_at!r}")
    os.rename(Path(path, f"{r}.tmp"), Path(path, str(r)))
    if r == 0:
        t0 = time.monotonic()
        while not Path(path, "1").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        peer_done = float(Path(path, "1").read_text().split()[0])
        assert timed.closed_at >= peer_done, \
            f"rank 0 freed its workspace {peer_done - timed.closed_at:.3f} s before rank 1's kernels ran"


@world(2, timeout=120)
def test_fake_p2p_and_a2a_tensor_on_another_gpu_is_refused(fake_cuda, monkeypatch):
    """send/isend/recv/irecv/batch_isend_irecv, and the all-to-alls with
    host-known splits, of a CUDA tensor on another GPU than the one the
    communicator's GPU transport runs on went through unchecked (the copy is
    enqueued in that transport's device context, on another device's
    stream). Now each is InvalidArgument naming the tensor and both devices,
    before anything is posted, and the channel stays usable. Verified on the
    CPU stand-in only (tensors that say they are on cuda:1)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: type("S", (), {"cuda_stream": gpu.stream()})())
    r, peer = comm.rank, 1 - comm.rank
    with comm:
        assert comm._cuda_device == 0
        x = _cuda_like((4, 2), device=1)
        told = r"is on cuda:1 but this communicator's GPU transport runs on cuda:0: move it there"
        for call in (lambda: comm.send(x, dst=peer), lambda: comm.isend(x, dst=peer),
                     lambda: comm.recv(src=peer, out=x), lambda: comm.irecv(src=peer, out=x),
                     lambda: comm.batch_isend_irecv([varcomm.P2POp(comm.irecv, x, peer)]),
                     lambda: comm.batch_isend_irecv([varcomm.P2POp(comm.isend, x, peer)])):
            with pytest.raises(varcomm.InvalidArgument, match=told):
                call()
        w = comm.isend(torch.arange(3) + 10 * r, dst=peer)
        got = comm.recv(src=peer)
        w.wait()
        assert got.tolist() == [10 * peer, 10 * peer + 1, 10 * peer + 2]
        told = r"data is on cuda:1 but this communicator's GPU transport runs on cuda:0: move it there"
        y = _cuda_like((4, 2), device=1)
        for call in (lambda: comm.all_to_all_v(x, [2, 2]), lambda: comm.all_to_all_single(y, x),
                     lambda: comm.all_to_all([_cuda_like((2, 2), device=1) for _ in range(2)],
                                             [_cuda_like((2, 2), device=1) for _ in range(2)])):
            with pytest.raises(varcomm.InvalidArgument, match=told):
                call()
        got, rows = comm.all_to_all_v(torch.arange(2) + 10 * r, [1, 1])  # in step
        assert rows == [1, 1] and got.tolist() == [r, 10 + r]
