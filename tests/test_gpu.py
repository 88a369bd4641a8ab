"""GPU tensors between same-host ranks over the nvlink transport (transport/nvlink).

Two groups:

* `test_fake_*`: the nvlink transport's protocol (device slots, data flags,
  GPU-written credits, the host slow paths) on a CPU stand-in for the NVIDIA
  driver (transport/nvlink/fake_libcuda.cc: "device memory" is shared host
  memory, streams are worker threads). Runs wherever g++ is, GPU or not.
* `test_gpu_*`: torch CUDA tensors on a real GPU (`requires=("gpu",)`): both
  ranks may share one GPU (CUDA IPC works within a device).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import varcomm
from conftest import dtype_cases, make_tensor, same_bytes
from varcomm import dtypes
from varcomm.testing import world

ROOT = Path(__file__).resolve().parents[1]
BOUND = 64 * 1024
U8 = dtypes.word(dtypes.UINT, 8)


def nvlink_built() -> str | None:
    """Skip reason when this build has no nvlink transport or bindings."""
    from varcomm import _C

    if "nvlink" not in _C.build_info["transports"]:
        return "varcomm was built without the nvlink transport"
    if not hasattr(_C.Comm, "device_transport_for"):
        return "this varcomm._C has no device routes (device_transport_for)"
    return None


# ---------------------------------------------------------------------------
# the protocol on a fake driver (CPU)


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> str:
    why = nvlink_built()
    if why:
        pytest.skip(why)
    cxx = os.environ.get("CXX", "g++")
    if not shutil.which(cxx):
        pytest.skip(f"{cxx} not found: cannot build the fake driver")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out),
                    str(ROOT / "transport" / "nvlink" / "fake_libcuda.cc"), "-lpthread"], check=True)
    return str(out)


class FakeGpu:
    """Device buffers and streams of the fake driver, through ctypes."""

    def __init__(self, path: str):
        # Loaded before varcomm's first driver call: its dlopen("libcuda.so.1")
        # then finds this library by soname.
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
        return s.value

    def sync(self, s: int) -> None:
        assert self.lib.cuStreamSynchronize(ctypes.c_void_p(s)) == 0

    def put(self, ptr: int, data: bytes) -> None:
        assert self.lib.cuMemcpyHtoD_v2(ctypes.c_ulonglong(ptr), data, ctypes.c_size_t(len(data))) == 0

    def memset_async(self, ptr: int, value: int, n: int, s: int) -> None:
        """Device bytes set on stream s, in its order (a kernel writing a buffer)."""
        assert self.lib.cuMemsetD8Async(ctypes.c_ulonglong(ptr), ctypes.c_ubyte(value), ctypes.c_size_t(n),
                                        ctypes.c_void_p(s)) == 0

    def get(self, ptr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(max(n, 1))
        assert self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_ulonglong(ptr), ctypes.c_size_t(n)) == 0
        return buf.raw[:n]

    def hold(self, s: int, seconds: float = 20) -> HeldStream:
        """Stream s waits (earlier GPU work still running) until release(), or
        `seconds` (so that a host wait on it, the bug under test, still ends)."""
        return HeldStream(self, s, seconds)


class HeldStream:
    def __init__(self, gpu: FakeGpu, s: int, seconds: float):
        self.word = gpu.alloc(8)
        ctypes.c_uint64.from_address(self.word).value = 0
        assert gpu.lib.cuStreamWaitValue64_v2(ctypes.c_void_p(s), ctypes.c_ulonglong(self.word),
                                              ctypes.c_ulonglong(1), ctypes.c_uint(0)) == 0
        self.timed_out = False
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.start()

    def _expire(self) -> None:
        self.timed_out = True
        ctypes.c_uint64.from_address(self.word).value = 1

    def release(self) -> None:
        self.timer.cancel()
        ctypes.c_uint64.from_address(self.word).value = 1


def _payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(params=["device", "host"])
def nvlink_flags(request, monkeypatch) -> str:
    """VARCOMM_NVLINK_FLAGS for every rank of the test (set before they fork):
    the data-ready flags in device memory (default) or in the host region."""
    monkeypatch.setenv("VARCOMM_NVLINK_FLAGS", request.param)
    return request.param


def _fake_comm(path: str, **kw):
    gpu = FakeGpu(path)
    # Device 0 of the fake driver, without asking torch.cuda (on a GPU machine
    # torch would find the fake driver too).
    os.environ["VARCOMM_NVLINK"] = "1"
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    comm = varcomm.init(transport="shm", timeout=30, **kw)
    assert all(comm.device_transport_for(r) == "nvlink" for r in range(comm.world_size)), \
        comm.describe_transport(1 - comm.rank)
    desc = comm.describe_transport(1 - comm.rank)
    flags = os.environ.get("VARCOMM_NVLINK_FLAGS") or "device"
    assert "nvlink" in desc and f"data flags in {flags} memory" in desc, desc  # the option was taken
    return gpu, comm


SIZES = [0, 1, 7, 255, 256, 4096, 40000, BOUND]


@world(2, timeout=120)
def test_fake_device_messages_recycle_slots(fake_cuda, nvlink_flags):
    """More messages than slots, device to device: credits come back from the
    receiver's stream; sizes from 0 to the bound; self-sends too."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    msgs = [SIZES[i % len(SIZES)] for i in range(20)]
    with comm:
        if r == 0:
            for i, n in enumerate(msgs):
                p = gpu.alloc(n)
                gpu.put(p, _payload(i, n))
                c.send(1, i % 2, p, n, U8, (n,), 30.0, s)  # returns once written (a slot was free)
            # self-send through our own device slots
            p = gpu.alloc(100)
            gpu.put(p, _payload(99, 100))
            c.send(0, 5, p, 100, U8, (100,), 30.0, s)
            out = gpu.alloc(BOUND)
            h = c.recv_into(0, 5, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert h.nbytes == 100 and gpu.get(out, 100) == _payload(99, 100)
        else:
            out = gpu.alloc(BOUND)
            for i, n in enumerate(msgs):
                h = c.recv_into(0, i % 2, out, BOUND, U8, 30.0, s)
                assert h.nbytes == n and h.shape == (n,), (i, h)
                gpu.sync(s)
                assert gpu.get(out, n) == _payload(i, n), f"message {i} ({n} bytes) differs"
        comm.barrier()


@world(2, timeout=120)
def test_fake_isend_irecv_and_slow_paths(fake_cuda, nvlink_flags):
    """irecv without out (flags say device), device -> host memory, host ->
    device memory, and a device message dropped unread."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=2)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            works = []
            for i, n in enumerate([300, 5000, 64]):
                p = gpu.alloc(n)
                gpu.put(p, _payload(i, n))
                works.append(c.isend(1, 0, p, n, U8, (n,), s))
            host = np.frombuffer(_payload(7, 1000), dtype=np.uint8).copy()
            assert comm._f.send(host, 1, 1, 30.0, 1)  # numpy (kind 1), host -> device memory
            for w in works:
                c.wait(w, 30.0)
            for i in range(6):  # after the dropped one: its slot must come back
                p = gpu.alloc(128)
                gpu.put(p, _payload(100 + i, 128))
                c.send(1, 2, p, 128, U8, (128,), 30.0, s)
        else:
            rid = c.irecv(0, 0, 0, 0, 0)
            c.wait(rid, 30.0)
            st = c.info(rid)
            n = st.nbytes
            assert (n, st.dtype, st.shape) == (300, U8, (300,)) and st.device
            out = gpu.alloc(n)
            c.copy_out(rid, out, s)
            gpu.sync(s)
            assert gpu.get(out, n) == _payload(0, 300)
            host = np.zeros(BOUND, dtype=np.uint8)  # device message into host memory
            v = comm._f.recv(0, 0, host, 30.0)  # 1-d message, 1-d out: out's front
            assert v.shape == (5000,) and v.tobytes() == _payload(1, 5000)
            rid = c.irecv(0, 0, 0, 0, 0)  # dropped unread
            c.wait(rid, 30.0)
            c.release(rid)
            dev = gpu.alloc(BOUND)  # host message into device memory
            h = c.recv_into(0, 1, dev, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert h.nbytes == 1000 and gpu.get(dev, 1000) == _payload(7, 1000)
            for i in range(6):
                h = c.recv_into(0, 2, dev, BOUND, U8, 30.0, s)
                gpu.sync(s)
                assert gpu.get(dev, 128) == _payload(100 + i, 128)
        comm.barrier()


@pytest.mark.parametrize("delay", ["0", "300"])
@world(2, timeout=120)
def test_fake_an_isend_past_a_full_ring_keeps_the_stream_order_of_its_source(fake_cuda, nvlink_flags, delay,
                                                                             monkeypatch):
    """isend of device buffers past the receiver's free slots, each buffer
    overwritten right after on the same stream (NCCL's contract: stream order
    protects the source). A send that waited for a slot was written later,
    its copy enqueued behind the overwrite: 7 of 8 messages arrived as the
    overwrite's bytes (helper-62). Now its bytes are copied at the isend, in
    stream order. Catches: any message not the bytes sent."""
    monkeypatch.setenv("FAKE_CUDA_DELAY_US", delay)
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=1)
    with comm:
        isends_reused_in_stream_order(gpu, comm, 4096, 8, BOUND)


def isends_reused_in_stream_order(gpu: FakeGpu, comm: varcomm.Communicator, n: int, count: int, bound: int) -> None:
    """Rank 0 isends `count` device buffers of n bytes to rank 1 (whose ring
    has fewer slots) and overwrites each on the same stream right after, then
    waits; rank 1 receives them in order. Every message must be the bytes
    sent (shared with test_rdma_gpu)."""
    c, r = comm._c, comm.rank
    s = gpu.stream()
    comm.barrier()
    if r == 0:
        works = []
        for i in range(count):
            p = gpu.alloc(n)
            gpu.put(p, _payload(i, n))
            works.append(c.isend(1, 1, p, n, U8, (n,), s))
            gpu.memset_async(p, 0x5A, n, s)  # the buffer's next use, in stream order
        for w in works:
            c.wait(w, 30.0)
        gpu.sync(s)
    else:
        out = gpu.alloc(bound)
        bad = []
        for i in range(count):
            c.recv_into(0, 1, out, bound, U8, 30.0, s)
            gpu.sync(s)
            if gpu.get(out, n) != _payload(i, n):
                bad.append(i)
        assert not bad, f"messages {bad} of {count} are not the bytes sent"
    comm.barrier()


@world(2, timeout=120)
def test_fake_copy_false_refuses_a_device_message_and_keeps_it(fake_cuda):
    """copy=False lends host slots only: a device message is refused with
    InvalidArgument (blocking recv and irecv alike) and stays for the next
    receive, which copies it.
    Catches: the refused message consumed or left claimed (the next receive
    would hang or get the message after it)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=2)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            p = gpu.alloc(300)
            gpu.put(p, _payload(3, 300))
            c.wait(c.isend(1, 0, p, 300, U8, (300,), s), 30.0)
            comm.send(np.arange(4), 1)
        else:
            for _ in range(3):
                with pytest.raises(varcomm.InvalidArgument, match="device"):
                    comm.recv(0, copy=False)
                with pytest.raises(varcomm.InvalidArgument, match="device"):
                    comm.irecv(0, copy=False).wait()
            out = gpu.alloc(BOUND)
            h = c.recv_into(0, 0, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert h.nbytes == 300 and gpu.get(out, 300) == _payload(3, 300)
            assert comm.recv(0).tolist() == [0, 1, 2, 3]
        comm.barrier()


@world(2, timeout=120)
def test_fake_close_waits_for_the_private_stream(fake_cuda, nvlink_flags):
    """An empty message's flag wait and credit run on the transport's private
    stream; closing right after must let them finish before the slots and
    mappings go (they used to be freed under them: a crash, seen as a flaky
    segfault in the fake driver's stream thread)."""
    os.environ["FAKE_CUDA_DELAY_US"] = "50000"  # the private stream is still busy at close
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            c.send(1, 0, gpu.alloc(1), 0, U8, (0,), 30.0, s)
            gpu.sync(s)
        else:
            assert c.recv_into(0, 0, gpu.alloc(16), 16, U8, 30.0, s).nbytes == 0
        comm.barrier()


@world(2, timeout=120)
def test_fake_close_waits_for_peers_that_write_its_gpu_slots(fake_cuda):
    """A peer's copies write this rank's device slots through its IPC mapping
    of them: close() waits for it to close too before the slots are freed
    (rank 1 does not host the store; it freed them at once, and a copy still
    queued on rank 0's stream wrote freed device memory)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    assert comm._c.close_waits_for_peers
    comm.barrier()
    t0 = time.monotonic()
    if comm.rank == 0:
        time.sleep(1.5)
    comm.close()
    if comm.rank == 1:
        assert time.monotonic() - t0 > 1.0, "closed before its peer"


@world(2, timeout=120, expect_exit={0: None})
def test_fake_a_dead_senders_receive_does_not_hang_the_stream(fake_cuda, nvlink_flags):
    """Rank 0's send waits behind earlier work on its stream (as a pipeline
    stage's send waits behind its forward pass) when rank 0 dies: its copy
    and data flag never run (a dead process's stream work is dropped). Rank
    1's receive, matched from the header and enqueued on its stream, waited
    for that flag forever: torch.cuda.synchronize would hang. Now its flag
    is let go within seconds of the death (the received bytes are then
    whatever the slot held) and rank 1's next call raises PeerFailure."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    if r == 0:
        gpu.hold(s, 60)  # never released: the process dies first
        c.send(1, 0, gpu.alloc(4096), 4096, U8, (4096,), 30.0, s)
        comm.recv(1)  # rank 1 has enqueued its receive
        os._exit(3)
    out = gpu.alloc(4096)
    assert c.recv_into(0, 0, out, 4096, U8, 30.0, s).nbytes == 4096
    comm.send(np.zeros(1), 0)
    done = threading.Event()
    threading.Thread(target=lambda: (gpu.sync(s), done.set()), daemon=True).start()
    t0 = time.monotonic()
    assert done.wait(20), "rank 1's stream still waits for the dead sender's data flag"
    assert time.monotonic() - t0 < 10
    with pytest.raises(varcomm.PeerFailure, match="rank 0"):
        c.recv_into(0, 0, out, 4096, U8, 10.0, s)
    t0 = time.monotonic()
    comm.close()
    assert time.monotonic() - t0 < 5  # close did not wait out a deadline either


@world(2, timeout=120)
def test_fake_close_finishes_the_messages_on_callers_streams(fake_cuda, nvlink_flags):
    """Both ranks close while their streams still hold a message's work: the
    sender's copy into the receiver's GPU slot and data flag, the receiver's
    wait, copy out and credit into the sender's host region. close used to
    unmap those at once (a crash when the stream ran: the fake driver's
    stream thread faults, a real GPU's context dies); now it lets them run
    first, and the message arrives whole."""
    os.environ["FAKE_CUDA_DELAY_US"] = "2000"
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    n = 40000
    if r == 0:
        p = gpu.alloc(n)
        gpu.put(p, _payload(5, n))
        held = gpu.hold(s)
        c.send(1, 0, p, n, U8, (n,), 30.0, s)
        comm.barrier()
        threading.Timer(0.5, held.release).start()
        comm.close()  # the copy and flag have not run yet
        assert not held.timed_out
    else:
        out = gpu.alloc(n)
        held = gpu.hold(s)
        assert c.recv_into(0, 0, out, n, U8, 30.0, s).nbytes == n
        comm.barrier()
        threading.Timer(1.0, held.release).start()
        comm.close()  # the wait, copy and credit have not run yet
        assert not held.timed_out
        gpu.sync(s)
        assert gpu.get(out, n) == _payload(5, n)


@world(2, timeout=120)
def test_fake_many_sends_while_this_thread_captures_another_stream(fake_cuda):
    """This thread captures a graph on one stream (GLOBAL mode, PyTorch's
    default) and sends 80 messages on another: the transport's bookkeeping
    of those messages (event queries once enough are outstanding) must not
    invalidate the capture (it did from the 64th message)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s, cap = gpu.stream(), gpu.stream()
    with comm:
        if r == 0:
            p = gpu.alloc(64)
            assert gpu.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(cap), 0) == 0
            for _ in range(80):
                c.send(1, 0, p, 64, U8, (64,), 30.0, s)
            g = ctypes.c_void_p()
            assert gpu.lib.cuStreamEndCapture(ctypes.c_void_p(cap), ctypes.byref(g)) == 0
        else:
            out = gpu.alloc(64)
            for _ in range(80):
                c.recv_into(0, 0, out, 64, U8, 30.0, s)
            gpu.sync(s)
        comm.barrier()


@world(2, timeout=120)
def test_fake_close_waits_for_sends_only_and_not_holding_the_engine(fake_cuda):
    """Both streams are held by other work when both ranks close: the
    sender's close waits for its message's copy (until its stream goes on,
    released here from another Python thread that calls into the
    communicator meanwhile: close must not hold the engine, and so the GIL,
    while it waits); the receiver's close does not wait for its receive
    (that work touches only memory kept until it ran), and destroying the
    communicator afterwards waits no second time."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    n = 4096
    held = gpu.hold(s, 60)
    if r == 0:
        c.send(1, 0, gpu.alloc(n), n, U8, (n,), 30.0, s)
        comm.barrier()
        ticks = []

        def poke() -> None:  # a call into the communicator while close waits
            time.sleep(0.3)
            try:
                comm.peer_bound(1)
            except varcomm.VarcommError:
                pass
            ticks.append(time.monotonic())
            held.release()

        th = threading.Thread(target=poke)
        th.start()
        t0 = time.monotonic()
        comm.close()
        took = time.monotonic() - t0
        th.join()
        assert ticks and ticks[0] - t0 < 3, "the other thread's call waited for close"
        assert took < 5, took
    else:
        out = gpu.alloc(n)
        assert c.recv_into(0, 0, out, n, U8, 30.0, s).nbytes == n
        comm.barrier()
        t0 = time.monotonic()
        comm.close()
        assert time.monotonic() - t0 < 3, "the receiver's close waited for its stream"
        held.release()
        gpu.sync(s)


@world(2, timeout=60)
def test_fake_flags_must_agree(fake_cuda):
    """VARCOMM_NVLINK_FLAGS set differently on the two ranks: no nvlink route
    for the pair (both sides agree), the reason in describe_transport, host
    tensors still flow over shm; a bad value is refused, naming the variable."""
    os.environ["VARCOMM_NVLINK_FLAGS"] = "bogus"
    FakeGpu(fake_cuda)
    os.environ.update(VARCOMM_NVLINK="1", VARCOMM_NVLINK_DEVICE="0")
    with pytest.raises(varcomm.InvalidArgument, match="VARCOMM_NVLINK_FLAGS='bogus': use device or host"):
        varcomm.init(transport="shm", timeout=30)
    os.environ["VARCOMM_NVLINK_FLAGS"] = "host" if varcomm.testing.rank() == 0 else "device"
    with varcomm.init(transport="shm", timeout=30) as comm:
        peer = 1 - comm.rank
        assert comm.device_transport_for(peer) is None
        assert "set VARCOMM_NVLINK_FLAGS alike on every rank" in comm.describe_transport(peer), \
            comm.describe_transport(peer)
        if comm.rank == 0:
            comm.send(torch.arange(5), dst=1)
        else:
            assert comm.recv(src=0).tolist() == list(range(5))
        comm.barrier()


def _has_fatbin() -> bool:
    from varcomm import _C

    return "copy-and-flag kernel: built for" in _C.nvlink_info()


@world(2, timeout=120)
@pytest.mark.parametrize("modules", ["ok", "refused"])
def test_fake_small_message_kernel(fake_cuda, modules, nvlink_flags):
    """VARCOMM_NVLINK_KERNEL_MAX: messages up to it go as one launch of the
    copy-and-flag kernel (the fake driver runs its effect: copy, then the
    flag), larger ones by the copy engine; odd sizes and offsets, self-sends.
    When the module cannot be loaded (or the build has no nvcc), every size
    takes the copy engine and the reason is in describe() and nvlink_info()."""
    os.environ["VARCOMM_NVLINK_KERNEL_MAX"] = "8K"
    if modules == "refused":
        os.environ["FAKE_CUDA_NO_MODULES"] = "1"
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=3)
    from varcomm import _C

    c, r = comm._c, comm.rank
    s = gpu.stream()
    launches = gpu.lib.fake_cuda_launches
    launches.restype = ctypes.c_ulonglong
    kernel = modules == "ok" and _has_fatbin()
    desc, info = comm.describe_transport(1 - r), _C.nvlink_info()
    if kernel:
        assert "up to 8192 bytes as one copy-and-flag kernel" in desc, desc
        assert "copy-and-flag kernel loaded" in info, info
    else:
        assert "copy-and-flag kernel unavailable" in desc, desc
        assert "copy-and-flag kernel not used" in info, info
    sizes = [1, 7, 8, 15, 16, 17, 255, 4095, 8191, 8192, 8193, 40000, 0, 3]
    with comm:
        if r == 0:
            before = launches()
            for i, n in enumerate(sizes):
                p = gpu.alloc(n + 32) + (i * 5) % 17  # unaligned sources too; copied later, on the stream
                gpu.put(p, _payload(i, n))
                c.send(1, 0, p, n, U8, (n,), 30.0, s)
            base = gpu.alloc(100)
            gpu.put(base, _payload(50, 100))  # self-send
            c.send(0, 1, base, 100, U8, (100,), 30.0, s)
            out = gpu.alloc(BOUND)
            c.recv_into(0, 1, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert gpu.get(out, 100) == _payload(50, 100)
            small = sum(1 for n in sizes if 0 < n <= 8192) + 1
            assert launches() - before == (small if kernel else 0), (launches() - before, small, kernel)
        else:
            out = gpu.alloc(BOUND + 64)
            for i, n in enumerate(sizes):
                dst = out + (i * 3) % 13  # unaligned destinations too
                h = c.recv_into(0, 0, dst, BOUND, U8, 30.0, s)
                assert h.nbytes == n, (i, h)
                gpu.sync(s)
                assert gpu.get(dst, n) == _payload(i, n), f"message {i} ({n} bytes) differs"
        comm.barrier()


# ---------------------------------------------------------------------------
# torch CUDA tensors on a real GPU


def _gpu_comm(**kw):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    comm = varcomm.init(transport="shm", timeout=60, **kw)
    peer = 1 - comm.rank
    assert comm.device_transport_for(peer) == "nvlink", comm.describe_transport(peer)
    return comm


GPU_REQ = ("gpu", nvlink_built)


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_every_dtype_and_size():
    with _gpu_comm(bound=BOUND, slots=4) as comm:
        cases = dtype_cases(BOUND)
        if comm.rank == 0:
            for i, (dt, shape) in enumerate(cases):
                comm.send(make_tensor(dt, shape, seed=i).cuda(), dst=1, tag=i % 3)
        else:
            for i, (dt, shape) in enumerate(cases):
                got = comm.recv(src=0, tag=i % 3)
                assert got.is_cuda and got.device.index == torch.cuda.current_device(), got.device
                assert got.dtype == dt and tuple(got.shape) == tuple(shape), (i, got.dtype, got.shape)
                assert same_bytes(got.cpu(), make_tensor(dt, shape, seed=i)), f"case {i}: {dt} {shape}"
        comm.barrier()


@world(2, timeout=120, requires=GPU_REQ)
def test_gpu_out_prefix_view_and_host_mixes():
    with _gpu_comm(bound=BOUND, slots=4) as comm:
        if comm.rank == 0:
            comm.send(torch.arange(10, dtype=torch.float32, device="cuda"), dst=1)
            comm.send(torch.arange(6, dtype=torch.int64, device="cuda").reshape(2, 3), dst=1)
            comm.send(torch.arange(5, dtype=torch.int16), dst=1)  # host -> GPU out
            comm.send(torch.arange(7, dtype=torch.int32, device="cuda"), dst=1)  # GPU -> host out
            comm.send(torch.arange(3, dtype=torch.uint8, device="cuda"), dst=1)  # GPU -> numpy out
        else:
            buf = torch.full((1000,), -1.0, device="cuda")
            a = comm.recv(src=0, out=buf)
            assert a.data_ptr() == buf.data_ptr() and a.tolist() == list(range(10)) and buf[10].item() == -1.0
            ibuf = torch.zeros(64, dtype=torch.int64, device="cuda")
            b = comm.irecv(src=0, out=ibuf).wait()
            assert b.shape == (2, 3) and b.data_ptr() == ibuf.data_ptr() and b.flatten().tolist() == list(range(6))
            hb = torch.zeros(64, dtype=torch.int16, device="cuda")
            assert comm.recv(src=0, out=hb).tolist() == list(range(5))
            cpu = torch.zeros(64, dtype=torch.int32)
            assert comm.recv(src=0, out=cpu).tolist() == list(range(7))
            n = comm.recv(src=0, out=np.zeros(16, dtype=np.uint8))
            assert n.tolist() == [0, 1, 2]
        comm.barrier()


@world(2, timeout=120, requires=GPU_REQ)
def test_gpu_batch_isend_irecv_and_stream_order():
    """Sends enqueued behind slow GPU work on the sender's stream arrive intact
    (stream order, no host sync), both directions at once, varying sizes."""
    with _gpu_comm(bound=1 << 20, slots=8) as comm:
        r, peer = comm.rank, 1 - comm.rank
        for step in range(20):
            n = 1 + (step * 7919) % (1 << 18)
            x = torch.empty(n, dtype=torch.float32, device="cuda")
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time ahead of the fill
            x.fill_(float(r * 1000 + step))
            ops = [varcomm.P2POp(comm.irecv, None, peer, tag=step), varcomm.P2POp(comm.isend, x, peer, tag=step)]
            works = comm.batch_isend_irecv(ops)
            got = works[0].wait()
            works[1].wait()
            assert got.is_cuda and got.shape == (n,)
            assert bool((got == float(peer * 1000 + step)).all()), f"step {step}: wrong data (ordering?)"
        comm.barrier()


@world(2, timeout=120, requires=GPU_REQ)
def test_gpu_sends_do_not_block_the_host():
    """100 sends enqueued behind ~0.5 s of GPU work return long before it ran."""
    with _gpu_comm(bound=64 * 1024, slots=128) as comm:
        if comm.rank == 0:
            xs = [torch.full((16 * 1024,), float(i), device="cuda") for i in range(100)]
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)
            t0 = time.perf_counter()
            works = [comm.isend(x, dst=1, tag=i) for i, x in enumerate(xs)]
            for w in works:
                w.wait()
            host = time.perf_counter() - t0
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            gpu_left = time.perf_counter() - t1
            assert gpu_left > 0.05 and host < gpu_left / 3, (host, gpu_left)
        else:
            for i in range(100):
                assert bool((comm.recv(src=0, tag=i) == float(i)).all())
        comm.barrier()


@world(2, timeout=120, requires=GPU_REQ)
def test_gpu_graph_capture_is_refused():
    """Sequence numbers and credits are host state: a captured send or recv
    would replay the captured message, so capture is refused with a clear
    error (replaying steady-state send/recv in a CUDA graph is not feasible)."""
    with _gpu_comm(bound=BOUND, slots=4) as comm:
        peer = 1 - comm.rank
        x = torch.ones(16, device="cuda")
        out = torch.empty(16, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            with pytest.raises(varcomm.InvalidArgument, match="CUDA graph"):
                with torch.cuda.graph(g, stream=s):
                    if comm.rank == 0:
                        comm.send(x, dst=peer)
                    else:
                        comm.recv(src=peer, out=out)
        comm.barrier()
        if comm.rank == 0:  # nothing was half-sent: the pair still works
            comm.send(x, dst=peer)
        else:
            assert comm.recv(src=peer, out=out).sum().item() == 16
        comm.barrier()


@world(2, timeout=120, requires=GPU_REQ)
def test_gpu_small_message_kernel():
    """VARCOMM_NVLINK_KERNEL_MAX=8K: small messages as one copy-and-flag kernel
    launch, larger ones by the copy engine, mixed, behind GPU work, from
    unaligned views; the data must arrive whole (the flag after the bytes)."""
    os.environ["VARCOMM_NVLINK_KERNEL_MAX"] = "8K"
    with _gpu_comm(bound=BOUND, slots=4) as comm:
        from varcomm import _C

        peer = 1 - comm.rank
        if _has_fatbin():
            assert "copy-and-flag kernel" in comm.describe_transport(peer), comm.describe_transport(peer)
            assert "unavailable" not in comm.describe_transport(peer), _C.nvlink_info()
        sizes = [1, 3, 8, 16, 17, 100, 1000, 4096, 8191, 8192, 8193, 40000, BOUND]
        base = torch.arange(BOUND + 64, dtype=torch.int64, device="cuda").to(torch.uint8)
        for rep in range(3):
            for i, n in enumerate(sizes):
                off = (i + rep) % 7
                if comm.rank == 0:
                    torch.cuda._sleep(100_000)  # the copy waits for earlier work on the stream
                    comm.send(base[off:off + n], dst=1, tag=i)
                else:
                    out = torch.full((BOUND + 16,), 255, dtype=torch.uint8, device="cuda")
                    got = comm.recv(src=0, tag=i, out=out[off % 3:])
                    assert got.shape == (n,) and torch.equal(got, base[off:off + n]), (rep, i, n)
        comm.barrier()


def cupy_missing() -> str | None:
    """Skip reason without cupy (found, not imported: the pytest process must not touch CUDA)."""
    import importlib.util

    return None if importlib.util.find_spec("cupy") else "cupy is not installed (pip install 'varcomm[cupy]')"


@world(2, timeout=120, requires=(*GPU_REQ, cupy_missing))
def test_gpu_cupy_in_and_out():
    import cupy

    with _gpu_comm(bound=BOUND, slots=4) as comm:
        if comm.rank == 0:
            comm.send(cupy.arange(10, dtype=cupy.float32), dst=1)  # enters through DLPack, goes GPU to GPU
            comm.send(cupy.arange(6, dtype=cupy.int64).reshape(2, 3), dst=1)
            comm.send(np.arange(5, dtype=np.int16), dst=1)
            comm.isend(cupy.arange(4, dtype=cupy.uint8), dst=1).wait()
            comm.send(cupy.arange(7, dtype=cupy.int32), dst=1)
        else:
            a = comm.recv(src=0)  # array="auto": the sender's kind, cupy
            assert isinstance(a, cupy.ndarray) and a.dtype == cupy.float32 and a.tolist() == list(range(10))
            assert a.device.id == torch.cuda.current_device()
            buf = cupy.full(64, -1, dtype=cupy.int64)
            b = comm.recv(src=0, out=buf)  # a cupy out: a cupy view of its front
            assert isinstance(b, cupy.ndarray) and b.shape == (2, 3) and b.data.ptr == buf.data.ptr
            assert b.ravel().tolist() == list(range(6)) and int(buf[6]) == -1
            c = comm.recv(src=0, array="cupy")  # host memory in, cupy out
            assert isinstance(c, cupy.ndarray) and c.dtype == cupy.int16 and c.tolist() == list(range(5))
            n = comm.recv(src=0, out=np.zeros(16, dtype=np.uint8))  # GPU in, numpy out
            assert n.tolist() == [0, 1, 2, 3]
            t = comm.irecv(src=0, array="torch").wait()  # the caller's kind wins
            assert isinstance(t, torch.Tensor) and t.is_cuda and t.tolist() == list(range(7))
        comm.barrier()


@world(2, timeout=120)
def test_fake_host_rendezvous_into_device_memory(fake_cuda):
    """A host message sent by rendezvous (shm with CMA, over eager_max) lands in
    device memory through its head's host slot; one over the bound is refused
    for a device out (MessageTooLarge, message kept: a size problem, it said
    InvalidArgument) and taken into host memory."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=2, eager_max=1024, cma="on")
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            a = np.frombuffer(_payload(1, 5000), dtype=np.uint8).copy()
            b = np.frombuffer(_payload(2, 2 * BOUND), dtype=np.uint8).copy()
            w1, w2 = comm.isend(a, 1), comm.isend(b, 1)
            w1.wait()
            w2.wait()
        else:
            cma = comm.route_info(0)["cma"] == "on"
            dev = gpu.alloc(2 * BOUND)
            if cma:
                h = c.recv_into(0, 0, dev, 2 * BOUND, U8, 30.0, s)
                gpu.sync(s)
                assert h.nbytes == 5000 and gpu.get(dev, 5000) == _payload(1, 5000)
            else:
                assert comm.recv(0).tobytes() == _payload(1, 5000)  # eager without CMA: the host path
            with pytest.raises(varcomm.MessageTooLarge, match="cannot land in GPU memory over this rank's bound"):
                c.recv_into(0, 0, dev, 2 * BOUND, U8, 30.0, s)
            host = np.zeros(2 * BOUND, dtype=np.uint8)
            got = comm.recv(0, out=host)
            assert got.nbytes == 2 * BOUND and host.tobytes() == _payload(2, 2 * BOUND)
        comm.barrier()


@pytest.mark.parametrize("n", [1000, 5000])  # eager; by rendezvous (CMA) into the head's slot
@world(2, timeout=120)
def test_fake_host_message_into_device_memory_does_not_wait_for_the_stream(fake_cuda, nvlink_flags, n):
    """A host message received into device memory on a held stream (earlier
    GPU work still running): the receive returns at once (it had waited for
    the stream under the engine's lock, stalling the rank's every thread),
    the data is there once the stream ran, and the slot comes back from the
    stream (slots=1: the next message arrives)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=1, eager_max=4096, cma="on")
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            for i in range(2):
                comm.send(np.frombuffer(_payload(i, n), dtype=np.uint8).copy(), 1)
        else:
            if n > 4096 and comm.route_info(0)["cma"] != "on":
                pytest.skip("no CMA here: a host rendezvous cannot land in device memory")
            dev = gpu.alloc(BOUND)
            held = gpu.hold(s)
            h = c.recv_into(0, 0, dev, BOUND, U8, 30.0, s)
            assert not held.timed_out, "the receive waited for the held stream"
            assert h.nbytes == n
            held.release()
            gpu.sync(s)
            assert gpu.get(dev, n) == _payload(0, n)
            h = c.recv_into(0, 0, dev, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert gpu.get(dev, n) == _payload(1, n)
        comm.barrier()


def refused_while_captured(gpu: FakeGpu, c, s: int, out: int, cap: int, tag: int = 0, posted: bool = True) -> None:
    """A receive from rank 0 into device `out` on stream `s` while `s` is
    being captured is refused (InvalidArgument), blocking and (`posted`) as an
    irecv matched at its wait; the capture ends after."""
    g = ctypes.c_void_p()
    assert gpu.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(s), 2) == 0  # RELAXED
    with pytest.raises(varcomm.InvalidArgument, match="captured"):
        c.recv_into(0, tag, out, cap, U8, 30.0, s)
    if posted:
        rid = c.irecv(0, tag, out, cap, U8, s)
        with pytest.raises(varcomm.InvalidArgument, match="captured"):
            c.wait(rid, 10.0)
    assert gpu.lib.cuStreamEndCapture(ctypes.c_void_p(s), ctypes.byref(g)) == 0


def received_in_order(gpu: FakeGpu, c, s: int, out: int, cap: int, n: int, seeds, tag: int = 0) -> None:
    """The next messages from rank 0 (tag) are _payload(i, n) for i in seeds, in order."""
    for i in seeds:
        h = c.recv_into(0, tag, out, cap, U8, 10.0, s)
        gpu.sync(s)
        assert h.nbytes == n and gpu.get(out, n) == _payload(i, n), f"message {i}"


@world(2, timeout=120)
def test_fake_captured_recv_is_refused_and_the_message_kept(fake_cuda, nvlink_flags):
    """A receive into device memory on a stream being captured, blocking or
    posted (irecv), is refused (InvalidArgument, as a captured send is) and
    the message stays for the next receive, which gets it; so do the ones
    after it. Catches: the refused message taken off the ready list before the
    transport refused the stream (lost, its slot never freed: the receiver
    then waited for a message that had come; a refused irecv also stayed
    posted and took the message after it)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=2)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            for i in range(4):
                p = gpu.alloc(300)
                gpu.put(p, _payload(i, 300))
                c.send(1, 0, p, 300, U8, (300,), 30.0, s)
            gpu.sync(s)
        else:
            out = gpu.alloc(BOUND)
            time.sleep(0.3)  # the first message is in
            for _ in range(3):
                refused_while_captured(gpu, c, s, out, BOUND)
            received_in_order(gpu, c, s, out, BOUND, 300, range(4))
        comm.barrier()


@world(2, timeout=120)
def test_fake_captured_recv_of_a_rendezvous_message_keeps_it(fake_cuda, nvlink_flags):
    """A host message sent by rendezvous (shm with CMA, over eager_max)
    received into device memory on a stream being captured, blocking or
    posted (irecv), is refused (InvalidArgument) before anything is claimed:
    the message, and its sender's send, stay for the next receive, which gets
    it. Catches: the stream checked only after the head was claimed and its
    data pulled (the message dropped, its sender's send failed; a refused irecv
    raised out of an unrelated wait and stayed posted, taking the next one)."""
    gpu, comm = _fake_comm(fake_cuda, bound=BOUND, slots=2, eager_max=1024, cma="on")
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            ws = [comm.isend(np.frombuffer(_payload(i, 5000), dtype=np.uint8).copy(), 1) for i in range(2)]
            for w in ws:
                w.wait()
        else:
            if comm.route_info(0)["cma"] != "on":
                pytest.skip("no CMA here: a host rendezvous cannot land in device memory")
            out = gpu.alloc(BOUND)
            time.sleep(0.3)  # the first head is in
            refused_while_captured(gpu, c, s, out, BOUND)
            received_in_order(gpu, c, s, out, BOUND, 5000, range(2))
        comm.barrier()
