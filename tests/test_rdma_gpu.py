"""GPU tensors to peers on the rdma route (transport/rdma/rdma_gpu.cpp), on the
CPU stand-in for the NVIDIA driver (transport/nvlink/fake_libcuda.cc) with
libfabric tcp;ofi_rxm: the staging copies, data-ready and landed flags and
stream waits all run through the fake's stream threads; FAKE_CUDA_DELAY_US
makes every stream operation late, so anything that read data before its
stream got there would see the wrong bytes.

Two groups: ranks on one host with the route forced to rdma (`@world`), and
ranks in separate network namespaces (tests/netns.py) for the stress across
"hosts" and the failure modes (a link pulled, a peer killed).

GPUDirect RDMA (VARCOMM_RDMA_HMEM=1, which this libfabric's tcp takes): the
same tests with staging and receive slots in the fake's GPU memory, which the
NIC (here tcp) registers as the host memory it is on the stand-in; so all of
its data path runs here except the FI_HMEM_CUDA registration itself."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import test_gpu
import varcomm
from conftest import same_bytes
from netns import IFACE, Netns, finish, lose_member_mid_stream, require_netns
from test_gpu import (
    U8,
    FakeGpu,
    _payload,
    isends_reused_in_stream_order,
    nvlink_built,
    received_in_order,
    refused_while_captured,
)
from test_gpu_alltoall import FAKE, _fake, _on, _run_entry_points
from varcomm import arrays, dtypes
from varcomm.collectives import alltoall as A
from varcomm.collectives.moe import combine, dispatch
from varcomm.testing import seeded, world

ROOT = Path(__file__).resolve().parents[1]
BOUND = 256 * 1024
CHUNK = 16 * 1024  # small, so most messages are several pipelined chunks
NOT_READY = 600    # CUDA_ERROR_NOT_READY from cuStreamQuery

pytestmark = pytest.mark.skipif("rdma" not in varcomm.build_info()["transports"],
                                reason="needs the rdma transport (libfabric-dev at build time)")


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> str:
    """The fake driver, built as tests/test_gpu.py builds it."""
    return str(test_gpu.fake_cuda.__wrapped__(tmp_path_factory))


def _comm(path: str, **kw):
    gpu = FakeGpu(path)
    os.environ["VARCOMM_NVLINK"] = "1"
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    comm = varcomm.init(transport="rdma", timeout=30, bound=BOUND, rdma_chunk=CHUNK, **kw)
    peer = (comm.rank + 1) % comm.world_size
    assert comm.device_transport_for(peer) == "rdma-gpu", comm.describe_transport(peer)
    return gpu, comm


def _gdr_flushes(gpu: FakeGpu) -> int:
    """cuFlushGPUDirectRDMAWrites calls so far in this process (the fake counts them)."""
    f = gpu.lib.fake_cuda_gdr_flushes
    f.restype = ctypes.c_long
    return int(f())


def _check_gpudirect(comm, hmem: str) -> None:
    """With VARCOMM_RDMA_HMEM=1 the pair's device route is GPUDirect: GPU staging and GPU receive slots."""
    info = comm.route_info(1 - comm.rank)
    want = "selected" if hmem == "1" else "off"
    assert info["device_gpudirect"] == want, info
    assert (int(info["device_gpu_receive_slots"]) > 0) == (hmem == "1"), info


def _query(gpu: FakeGpu, s: int) -> int:
    return int(gpu.lib.cuStreamQuery(ctypes.c_void_p(s)))


@world(2, timeout=180, requires=("libfabric",))
@pytest.mark.parametrize(("delay_us", "strict", "hmem"),
                         [("0", "0", "0"), ("30", "0", "0"), ("30", "1", "0"), ("0", "0", "1"), ("30", "1", "1")])
def test_fake_rdma_device_messages_byte_exact(fake_cuda, delay_us, strict, hmem):
    """Randomized sizes 0..bound (chunk edges included), more messages than
    slots, with and without a late stream, with the staging memory registered
    as verbs/efa require (VARCOMM_RDMA_STRICT), and by GPUDirect (hmem 1):
    each arrives byte-exact into a device out, a new buffer (irecv,
    copy_out), host memory; one is dropped unread and its slot still comes
    back; a host message lands in device memory. Under GPUDirect every landed
    chunk was flushed before a stream read it."""
    os.environ["FAKE_CUDA_DELAY_US"] = delay_us
    os.environ["VARCOMM_RDMA_STRICT"] = strict
    os.environ["VARCOMM_RDMA_HMEM"] = hmem
    gpu, comm = _comm(fake_cuda, slots=3)
    _check_gpudirect(comm, hmem)
    flushed = _gdr_flushes(gpu)
    comm.barrier()  # rank 0 sends once rank 1 counted: a chunk landed before would be missed
    rng = np.random.default_rng(seeded())
    edges = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, BOUND - 1, BOUND]
    sizes = edges + [int(x) for x in rng.integers(0, BOUND + 1, 24)]
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            for i, n in enumerate(sizes):
                p = gpu.alloc(n)
                gpu.put(p, _payload(i, n))
                c.send(1, 0, p, n, U8, (n,), 30.0, s)
            p = gpu.alloc(5000)
            gpu.put(p, _payload(1000, 5000))
            c.send(1, 1, p, 5000, U8, (5000,), 30.0, s)  # dropped unread
            # a host message into device memory (over twice rdma_chunk: on a pair with a device route it
            # stays eager, since a streamed one could not land in GPU memory)
            host = np.frombuffer(_payload(1001, 3 * CHUNK + 7), dtype=np.uint8).copy()
            c.send(1, 2, host.ctypes.data, host.nbytes, U8, (host.size,), 30.0, -1, host)
            for i in range(4):  # after the dropped one: its slot must come back
                p = gpu.alloc(2 * CHUNK)
                gpu.put(p, _payload(1100 + i, 2 * CHUNK))
                c.send(1, 3, p, 2 * CHUNK, U8, (2 * CHUNK,), 30.0, s)
        else:
            out = gpu.alloc(BOUND)
            host = np.zeros(BOUND, dtype=np.uint8)
            for i, n in enumerate(sizes):
                how = i % 3
                if how == 0:
                    h = c.recv_into(0, 0, out, BOUND, U8, 30.0, s)
                    assert h.nbytes == n and h.shape == (n,) and h.device, (i, h)
                    gpu.sync(s)
                    got = gpu.get(out, n)
                elif how == 1:
                    rid = c.irecv(0, 0, 0, 0, 0)
                    c.wait(rid, 30.0)
                    st = c.info(rid)
                    assert st.nbytes == n and st.device, (i, st)
                    dst = gpu.alloc(n)
                    c.copy_out(rid, dst, s)
                    gpu.sync(s)
                    got = gpu.get(dst, n)
                else:  # a device message into host memory
                    h = c.recv_into(0, 0, host.ctypes.data, host.nbytes, U8, 30.0)
                    assert h.nbytes == n, (i, h)
                    got = host[:n].tobytes()
                assert got == _payload(i, n), f"message {i} ({n} bytes, path {how}) differs"
            rid = c.irecv(0, 1, 0, 0, 0)
            c.wait(rid, 30.0)
            c.release(rid)
            h = c.recv_into(0, 2, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert h.nbytes == 3 * CHUNK + 7 and gpu.get(out, 3 * CHUNK + 7) == _payload(1001, 3 * CHUNK + 7)
            for i in range(4):
                c.recv_into(0, 3, out, BOUND, U8, 30.0, s)
                gpu.sync(s)
                assert gpu.get(out, 2 * CHUNK) == _payload(1100 + i, 2 * CHUNK)
            chunks = sum(-(-n // CHUNK) for n in sizes) + 1 + 8  # + the dropped one + 4 x 2
            assert _gdr_flushes(gpu) - flushed == (chunks if hmem == "1" else 0)
        comm.barrier()


@world(2, timeout=180, requires=("libfabric",))
@pytest.mark.parametrize("hmem", ["0", "1"])
def test_fake_rdma_stream_order_and_enqueue_never_waits(fake_cuda, hmem):
    """Every stream operation 0.1 s late. The sender overwrites its source on
    the same stream right after the send: the message must still carry the
    bytes before it. Send and recv return while their streams have not run
    yet (the host never waits for GPU work), and the receiver's next stream
    operation, a copy of out, sees the message."""
    os.environ["FAKE_CUDA_DELAY_US"] = "100000"
    os.environ["VARCOMM_RDMA_HMEM"] = hmem
    gpu, comm = _comm(fake_cuda, slots=2)
    _check_gpudirect(comm, hmem)
    memset = gpu.lib.cuMemsetD8Async
    memset.argtypes = [ctypes.c_ulonglong, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    copy = gpu.lib.cuMemcpyAsync
    copy.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p]
    c, r = comm._c, comm.rank
    s = gpu.stream()
    n = 3 * CHUNK + 5
    with comm:
        if r == 0:
            src = gpu.alloc(n)
            gpu.put(src, _payload(7, n))
            c.send(1, 0, src, n, U8, (n,), 30.0, s)
            assert _query(gpu, s) == NOT_READY, "send waited for its stream"
            assert memset(src, 0xEE, n, s) == 0  # later on the stream: must not leak into the message
            gpu.sync(s)
        else:
            out, seen = gpu.alloc(BOUND), gpu.alloc(n)
            gpu.put(out, b"\x11" * n)
            h = c.recv_into(0, 0, out, BOUND, U8, 30.0, s)
            assert h.nbytes == n
            assert _query(gpu, s) == NOT_READY, "recv waited for its stream"
            assert copy(seen, out, n, s) == 0  # the consumer, next on the stream
            gpu.sync(s)
            assert gpu.get(seen, n) == _payload(7, n), "the consumer did not see the message"
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
@pytest.mark.parametrize("hmem", ["0", "1"])
def test_fake_rdma_an_isend_past_a_full_ring_keeps_the_stream_order_of_its_source(fake_cuda, hmem):
    """As on nvlink (test_gpu): isends of device buffers past the receiver's
    free slots, each buffer overwritten right after on the same stream. A send
    that waited for a slot staged its payload later, behind the overwrite.
    Catches: any message not the bytes sent."""
    os.environ["VARCOMM_RDMA_HMEM"] = hmem
    gpu, comm = _comm(fake_cuda, slots=1)
    with comm:
        isends_reused_in_stream_order(gpu, comm, 2 * CHUNK + 3, 6, BOUND)


@world(2, timeout=120, requires=("libfabric",))
def test_fake_rdma_close_flushes_staged_sends(fake_cuda):
    """The sender closes right after its sends returned, while its late stream
    has not yet staged their data: close keeps flushing until every chunk is
    on the wire, and the receiver gets every message intact."""
    os.environ["FAKE_CUDA_DELAY_US"] = "20000"
    gpu, comm = _comm(fake_cuda, slots=4)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    n = 2 * CHUNK + 3
    if r == 0:
        for i in range(4):
            p = gpu.alloc(n)
            gpu.put(p, _payload(40 + i, n))
            c.send(1, 0, p, n, U8, (n,), 30.0, s)
        assert _query(gpu, s) == NOT_READY
        comm.close()
    else:
        out = gpu.alloc(BOUND)
        for i in range(4):
            c.recv_into(0, 0, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert gpu.get(out, n) == _payload(40 + i, n), f"message {i} differs"
        comm.close()


@world(2, timeout=120, requires=("libfabric",))
def test_fake_rdma_errors_as_on_the_host_path(fake_cuda):
    """A device message over the receiver's bound is refused before anything
    is sent; an out too small or of another dtype is refused with the message
    kept, which the next receive gets intact; the channel stays usable."""
    gpu, comm = _comm(fake_cuda, slots=2)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    with comm:
        if r == 0:
            big = gpu.alloc(BOUND + 1)
            with pytest.raises(varcomm.MessageTooLarge, match="exceeds the receive bound"):
                c.send(1, 0, big, BOUND + 1, U8, (BOUND + 1,), 30.0, s)
            p = gpu.alloc(5 * CHUNK)
            gpu.put(p, _payload(3, 5 * CHUNK))
            c.send(1, 0, p, 5 * CHUNK, U8, (5 * CHUNK,), 30.0, s)
        else:
            small = gpu.alloc(CHUNK)
            with pytest.raises(varcomm.MessageTooLarge, match="does not fit out"):
                c.recv_into(0, 0, small, CHUNK, U8, 30.0, s)
            with pytest.raises(varcomm.MessageMismatch, match="does not match out's dtype"):
                c.recv_into(0, 0, gpu.alloc(BOUND), BOUND, dtypes.word(dtypes.FLOAT, 32), 30.0, s)
            out = gpu.alloc(BOUND)
            h = c.recv_into(0, 0, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert h.nbytes == 5 * CHUNK and gpu.get(out, 5 * CHUNK) == _payload(3, 5 * CHUNK)
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
@pytest.mark.parametrize("hmem", ["auto", "0", "1"])
def test_fake_rdma_gpudirect_selection(fake_cuda, hmem):
    """GPUDirect RDMA is chosen by the provider's capabilities: tcp is no RDMA
    NIC, so auto stages and says why, 0 says it was turned off, and 1 (forced)
    takes it, since the stand-in's GPU memory is host memory (with a real
    driver it is refused at init unless the provider offers FI_HMEM, naming
    the variable)."""
    os.environ["VARCOMM_RDMA_HMEM"] = hmem
    FakeGpu(fake_cuda)
    os.environ.update(VARCOMM_NVLINK="1", VARCOMM_NVLINK_DEVICE="0")
    try:
        comm = varcomm.init(transport="rdma", timeout=30, bound=BOUND)
    except varcomm.InvalidArgument as e:
        raise AssertionError(f"VARCOMM_RDMA_HMEM={hmem} refused on the stand-in: {e}") from e
    with comm:
        desc = comm.describe_transport(1 - comm.rank)
        info = comm.route_info(1 - comm.rank)
        assert info["device_route"] == "rdma-gpu", desc
        if hmem == "auto":
            assert "GPUDirect RDMA: not used: provider tcp;ofi_rxm is no RDMA NIC" in desc, desc
        elif hmem == "0":
            assert "GPUDirect RDMA: off (VARCOMM_RDMA_HMEM=0)" in desc, desc
        else:  # tcp offers no FI_HMEM here, but the stand-in's GPU memory is host memory: selected
            assert "GPUDirect RDMA, selected by VARCOMM_RDMA_HMEM=1 (CPU stand-in driver: its GPU memory is host " \
                   "memory, which tcp;ofi_rxm registers as such)" in desc, desc
            assert f"receives land in {info['device_gpu_receive_slots']} bytes of GPU receive slots" in desc, desc
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
@pytest.mark.parametrize("hmem", ["1", "auto"])
def test_fake_rdma_gpudirect_on_a_gpu_without_it(fake_cuda, hmem):
    """A GPU that reports no GPUDirect RDMA support (the fake with
    FAKE_CUDA_NO_GDR): forced, init refuses and names the variable (also
    with VARCOMM_NVLINK=auto, which routes around other device transports'
    failures); auto stages, and says so."""
    os.environ.update(FAKE_CUDA_NO_GDR="1", VARCOMM_RDMA_HMEM=hmem)
    FakeGpu(fake_cuda)
    os.environ.update(VARCOMM_NVLINK="auto", VARCOMM_NVLINK_DEVICE="0")
    if hmem == "1":
        with pytest.raises(varcomm.InvalidArgument, match="VARCOMM_RDMA_HMEM=1 .*cuda:0 does not support GPUDirect"):
            varcomm.init(transport="rdma", timeout=30, bound=BOUND)
        return
    with varcomm.init(transport="rdma", timeout=30, bound=BOUND) as comm:
        assert comm.route_info(1 - comm.rank)["device_gpudirect"] == "off"
        assert "GPUDirect RDMA: not used: cuda:0 does not support it" in comm.describe_transport(1 - comm.rank)
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
def test_fake_rdma_gpudirect_from_a_thread_without_a_context(fake_cuda):
    """GPUDirect's GPU memory and stream are made in the communicator's
    context, not the caller's: a send (the first, which allocates the staging)
    and a receive into host memory (a copy out of a GPU slot on varcomm's own
    stream) from a thread with no CUDA context current both work (the fake,
    as the driver, refuses allocations and streams without one)."""
    import threading
    os.environ["VARCOMM_RDMA_HMEM"] = "1"
    gpu, comm = _comm(fake_cuda, slots=2)
    c, r = comm._c, comm.rank
    n = 3 * CHUNK + 1

    def in_a_thread(fn):
        res: list[object] = []

        def run():
            try:
                res.append(fn())
            except BaseException as e:  # raised below, in the test's thread
                res.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        assert res, "the thread did not finish"
        if isinstance(res[0], BaseException):
            raise res[0]
        return res[0]

    with comm:
        if r == 0:
            s = gpu.stream()
            p = gpu.alloc(n)
            gpu.put(p, _payload(5, n))
            in_a_thread(lambda: c.send(1, 0, p, n, U8, (n,), 30.0, s))
            gpu.sync(s)
        else:
            host = np.zeros(n, dtype=np.uint8)
            h = in_a_thread(lambda: c.recv_into(0, 0, host.ctypes.data, host.nbytes, U8, 30.0))
            assert h.nbytes == n and host.tobytes() == _payload(5, n)
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
def test_fake_rdma_gpudirect_with_a_staged_peer(fake_cuda):
    """Rank 0 uses GPUDirect, rank 1 stages (VARCOMM_RDMA_HMEM differs by
    rank): each side decides alone, so rank 0 writes from GPU staging into
    rank 1's host slots, and rank 1 from pinned memory into rank 0's GPU
    slots; messages both ways arrive byte-exact, and only rank 0 flushes."""
    os.environ["VARCOMM_RDMA_HMEM"] = "1" if int(os.environ["RANK"]) == 0 else "0"
    os.environ["FAKE_CUDA_DELAY_US"] = "20"
    gpu, comm = _comm(fake_cuda, slots=2)
    c, r = comm._c, comm.rank
    _check_gpudirect(comm, "1" if r == 0 else "0")
    s = gpu.stream()
    sizes = [1, CHUNK, 3 * CHUNK + 5, BOUND]
    out = gpu.alloc(BOUND)
    flushed = _gdr_flushes(gpu)
    with comm:
        for i, n in enumerate(sizes):
            for turn in (0, 1):
                if r == turn:
                    p = gpu.alloc(n)
                    gpu.put(p, _payload(10 * i + turn, n))
                    c.send(1 - r, 0, p, n, U8, (n,), 30.0, s)
                else:
                    h = c.recv_into(1 - r, 0, out, BOUND, U8, 30.0, s)
                    gpu.sync(s)
                    assert h.nbytes == n and gpu.get(out, n) == _payload(10 * i + turn, n), (i, turn)
        chunks = sum(-(-n // CHUNK) for n in sizes)
        assert _gdr_flushes(gpu) - flushed == (chunks if r == 0 else 0)
        comm.barrier()


# ---------------------------------------------------------------------------
# across network namespaces

WORKER = textwrap.dedent('''
    import os, sys, time
    import numpy as np
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_gpu import FakeGpu, _payload, U8
    mode, flags, fake = sys.argv[1], sys.argv[2], sys.argv[3]
    gpu = FakeGpu(fake)
    os.environ.update(VARCOMM_NVLINK="1", VARCOMM_NVLINK_DEVICE="0")
    import varcomm
    r = int(os.environ["RANK"]); n = int(os.environ["WORLD_SIZE"])
    BOUND, CHUNK = 256 * 1024, 16 * 1024
    comm = varcomm.init(transport="rdma", bound=BOUND, slots=3, timeout=60, rdma_chunk=CHUNK)
    for q in range(n):
        if q != r:
            assert comm.device_transport_for(q) == "rdma-gpu", comm.describe_transport(q)
            gdr = comm.route_info(q)["device_gpudirect"]
            assert gdr == ("selected" if os.environ["VARCOMM_RDMA_HMEM"] == "1" else "off"), gdr
    c = comm._c
    s = gpu.stream()
    def mark(name):
        open(os.path.join(flags, f"{name}{r}"), "w").close()
    def wait_for(name):
        while not os.path.exists(os.path.join(flags, name)):
            time.sleep(0.01)
    if mode == "ring":
        rng = np.random.default_rng(int(os.environ["SEED"]))
        sizes = rng.integers(0, BOUND + 1, (60, n)).tolist()
        nxt, prv = (r + 1) % n, (r - 1) % n
        out = gpu.alloc(BOUND)
        for step, row in enumerate(sizes):
            m = row[r]
            src = gpu.alloc(m)
            gpu.put(src, _payload(1000 * r + step, m))
            rid = c.irecv(prv, step % 2, out, BOUND, U8, s)
            w = c.isend(nxt, step % 2, src, m, U8, (m,), s)
            c.wait(w, 60.0)
            c.wait(rid, 60.0)
            gpu.sync(s)
            want = row[prv]
            assert gpu.get(out, want) == _payload(1000 * prv + step, want), (step, want)
        print("OK", r, flush=True)
        comm.close()
        sys.exit(0)
    # failure modes: rank 2 streams device messages to rank 0; ranks 0 and 1 also talk
    if r == 2:
        src = gpu.alloc(4 * CHUNK)
        for i in range(10**6):
            gpu.put(src, _payload(i, 4 * CHUNK))
            c.send(0, 0, src, 4 * CHUNK, U8, (4 * CHUNK,), 60.0, s)
            gpu.sync(s)
            if i == 20:
                mark("streaming")
    else:
        other = 1 - r
        out = gpu.alloc(BOUND)
        if r == 0:
            for i in range(20):
                c.recv_into(2, 0, out, BOUND, U8, 30.0, s)
                gpu.sync(s)
                assert gpu.get(out, 4 * CHUNK) == _payload(i, 4 * CHUNK), i
        wait_for("streaming2")
        mark("ready")
        t0 = time.monotonic()
        if r == 0:
            try:
                while True:
                    c.recv_into(2, 0, out, BOUND, U8, 30.0, s)
            except varcomm.PeerFailure as e:
                took = time.monotonic() - t0
                gpu.sync(s)  # no stream is left waiting for data that will never come
                print(f"PeerFailure after {took:.1f}s: {e}", flush=True)
                assert "rank 2" in str(e)
        src = gpu.alloc(3 * CHUNK)
        for i in range(30):  # the survivors' device channel keeps working
            gpu.put(src, _payload(500 + 10 * r + i, 3 * CHUNK))
            c.send(other, 1, src, 3 * CHUNK, U8, (3 * CHUNK,), 30.0, s)
            c.recv_into(other, 1, out, BOUND, U8, 30.0, s)
            gpu.sync(s)
            assert gpu.get(out, 3 * CHUNK) == _payload(500 + 10 * other + i, 3 * CHUNK), i
        # Both have all 30 before either exits: a device send returns before its
        # chunks are on the wire, and a peer gone mid-message is a failed peer.
        comm.send(np.zeros(1, np.uint8), other, tag=2)
        comm.recv(other, tag=2)
        print("OK", r, flush=True)
        os._exit(0)
''')


def _run(net: Netns, tmp: Path, mode: str, n: int, fake: str, seed: int = 0,
         hmem: str = "0") -> list[subprocess.Popen]:
    """hmem: VARCOMM_RDMA_HMEM of every rank ("0", "1"), or "mixed": GPUDirect on every rank but rank 1."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    flags = tmp / "flags"
    flags.mkdir(exist_ok=True)
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=net.addr(0), MASTER_PORT="29613", VARCOMM_FI_PROVIDER="tcp;ofi_rxm",
                   VARCOMM_FI_IFACE=IFACE, VARCOMM_PEER_TIMEOUT="4", OMP_NUM_THREADS="1",
                   FAKE_CUDA_DELAY_US="20", SEED=str(seed), TESTS_DIR=str(ROOT / "tests"),
                   PYTHONPATH=str(ROOT / "python"),
                   VARCOMM_RDMA_HMEM="1" if hmem == "1" or (hmem == "mixed" and r != 1) else "0")
        procs.append(net.popen(r, [sys.executable, str(script), mode, str(flags), fake], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs



@pytest.mark.parametrize("hmem", ["0", "1", "mixed"])
def test_device_ring_across_namespaces_byte_exact(tmp_path, fake_cuda, hmem):
    """Three "hosts": a ring of device messages of random sizes (0..bound, many
    chunks), byte-exact on a late fake stream; staged, GPUDirect, and
    GPUDirect on two of the three ranks."""
    require_netns()
    seed = seeded()
    with Netns(3) as net:
        res = finish(_run(net, tmp_path, "ring", 3, fake_cuda, seed, hmem), timeout=150)
    for r, (code, out) in enumerate(res):
        assert code == 0 and f"OK {r}" in out, f"rank {r} (exit {code}, seed {seed}):\n{out[-3000:]}"


@pytest.mark.parametrize(("how", "hmem"), [("link_down", "0"), ("kill", "0"), ("kill", "1")])
def test_device_peer_lost_mid_stream_fails_promptly(tmp_path, fake_cuda, how, hmem):
    """A device stream from rank 2 to rank 0; rank 2's link pulled or rank 2
    killed: rank 0 gets PeerFailure within seconds, its stream is not left
    waiting (GPUDirect: on data for its GPU slots), and ranks 0 and 1 keep
    exchanging device messages."""
    require_netns()
    with Netns(3) as net:
        lose_member_mid_stream(net, _run(net, tmp_path, "fail", 3, fake_cuda, hmem=hmem), tmp_path / "flags", how, 90)


# ---------------------------------------------------------------------------
# torch CUDA tensors on a real GPU: two ranks (which may share one GPU) with the
# route forced to rdma, tcp;ofi_rxm on loopback unless VARCOMM_FI_PROVIDER says
# otherwise: real streams, pinned memory, cuStreamWaitValue64 on host-mapped flags.

GPU_REQ = ("gpu", "libfabric", nvlink_built)


def _gpu_rdma_comm(**kw):
    import torch

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.zeros(1, device="cuda")  # CUDA in use before init: the GPU transports open
    comm = varcomm.init(transport="rdma", timeout=60, **kw)
    peer = 1 - comm.rank
    assert comm.device_transport_for(peer) == "rdma-gpu", comm.describe_transport(peer)
    return torch, comm


@world(2, timeout=240, requires=GPU_REQ)
def test_gpu_rdma_tensors_byte_exact():
    """Random sizes and dtypes, new tensors and out=, chunked and not; the
    receiver's consumer on the current stream sees each message."""
    torch, comm = _gpu_rdma_comm(bound=4 << 20, slots=4, rdma_chunk=256 << 10)
    rng = np.random.default_rng(seeded())
    sizes = [0, 1, 4095, 256 << 10, (256 << 10) + 1] + [int(x) for x in rng.integers(1, 1 << 20, 20)]
    with comm:
        for i, n in enumerate(sizes):
            if comm.rank == 0:
                x = torch.arange(n, device="cuda", dtype=torch.int32) * (i + 1)
                comm.send(x, dst=1, tag=i % 3)
            else:
                y = comm.recv(src=0, tag=i % 3)
                assert y.is_cuda and y.shape == (n,) and y.dtype == torch.int32
                want = torch.arange(n, device="cuda", dtype=torch.int32) * (i + 1)
                assert bool((y == want).all()), f"message {i} ({n} ints) differs"
            if comm.rank == 0:
                comm.send(torch.arange(n, device="cuda", dtype=torch.int32), dst=1, tag=9)
            else:
                out = torch.full((1 << 20,), -1, device="cuda", dtype=torch.int32)
                z = comm.recv(src=0, tag=9, out=out)
                assert z.shape == (n,) and bool((z == torch.arange(n, device="cuda", dtype=torch.int32)).all())
        comm.barrier()


@world(2, timeout=240, requires=GPU_REQ)
def test_gpu_rdma_enqueue_does_not_wait_for_the_stream():
    """Sends and receives enqueued behind 0.5 s of GPU work return while the
    stream is still busy; the data is right once it ran; the source is
    overwritten later on the stream without leaking into the message."""
    torch, comm = _gpu_rdma_comm(bound=1 << 20, slots=4)
    with comm:
        if comm.rank == 0:
            x = torch.full((1 << 18,), 7, device="cuda", dtype=torch.int32)
            torch.cuda._sleep(int(0.5 * 1e9))  # ~0.5 s of spinning at 1 GHz clocks or more
            comm.send(x, dst=1)
            assert not torch.cuda.current_stream().query(), "send waited for its stream"
            x.fill_(-1)
            torch.cuda.synchronize()
        else:
            torch.cuda._sleep(int(0.5 * 1e9))
            y = comm.recv(src=0)
            assert not torch.cuda.current_stream().query(), "recv waited for its stream"
            assert bool((y == 7).all())
        comm.barrier()


# ---------------------------------------------------------------------------
# all-to-all and MoE (host-known splits) on rdma-gpu: the entry points of
# tests/test_gpu_alltoall.py over its FakeDevice, with the route forced to rdma

def _a2a_comm(path: str, *, no_ipc: bool = False, delay_us: int = 0):
    """A FakeDevice communicator whose peers are all on rdma-gpu. no_ipc: the
    fake refuses CUDA IPC on this rank, so nvlink cannot open (VARCOMM_NVLINK
    auto, as a real job runs) and rdma-gpu is its only GPU transport: its
    self chunk is still a device copy on the stream."""
    os.environ["FAKE_CUDA_NO_IPC"] = "1" if no_ipc else "0"
    dev, comm = _fake(path, transport="rdma", delay_us=delay_us, nvlink="auto" if no_ipc else "1",
                      bound=BOUND, slots=3, timeout=60, rdma_chunk=CHUNK)
    r, n = comm.rank, comm.world_size
    routes = [comm.device_transport_for(p) for p in range(n)]
    assert routes == [(None if no_ipc else "nvlink") if p == r else "rdma-gpu" for p in range(n)], routes
    return dev, comm


@pytest.mark.parametrize(("n", "delay_us", "no_ipc", "hmem"),
                         [(2, 0, "", "0"), (3, 0, "", "0"), (3, 300, "", "0"), (3, 0, "0", "0"), (2, 300, "01", "0"),
                          (3, 300, "", "1")])
def test_fake_rdma_all_to_all_entry_points_match_reference(fake_cuda, n, delay_us, no_ipc, hmem):
    """all_to_all_v / all_to_all_single / all_to_all on device memory, every
    peer on rdma-gpu, byte-exact against the single-process reference, with and
    without late streams, staged and by GPUDirect; ranks in `no_ipc` have no
    nvlink at all (their self chunk goes through rdma-gpu's device copy)."""
    @world(n, timeout=240, requires=("libfabric",))
    def body():
        os.environ["VARCOMM_RDMA_HMEM"] = hmem
        seed = seeded()
        dev, comm = _a2a_comm(fake_cuda, no_ipc=str(varcomm.testing.rank()) in no_ipc, delay_us=delay_us)
        gdr = {comm.route_info(p)["device_gpudirect"] for p in range(n) if p != comm.rank}
        assert gdr == {"selected" if hmem == "1" else "off"}, gdr
        with comm:
            _run_entry_points(dev, comm, seed, iters=15, max_rows=40)
            comm.barrier()

    body()


@world(2, timeout=180, requires=("libfabric",))
@pytest.mark.parametrize("no_ipc", [False, True])
def test_fake_rdma_all_to_all_never_waits_for_the_stream(fake_cuda, no_ipc):
    """Every stream operation 50 ms late: when all_to_all_v, all_to_all_single
    and a MoE dispatch hand their result to the caller's stream, that stream has
    not run yet (the host never waited for GPU work, self chunk included), and
    the result is right once it ran."""
    dev, comm = _a2a_comm(fake_cuda, no_ipc=no_ipc, delay_us=50_000)
    seen: list[int] = []
    sync = dev.wait

    def wait(stream, place):  # the facade's hand-over to the caller's next work
        seen.append(_query(dev.gpu, stream))
        sync(stream, place)

    dev.wait = wait  # type: ignore[method-assign]
    with comm:
        r = comm.rank
        x = _on(dev, torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * r)
        got, rs = A.all_to_all_v(comm, x, [2, 4])
        want = [torch.arange(12, dtype=torch.float32).reshape(6, 2)[(0, 2)[r]:(2, 6)[r]] + 100 * s for s in range(2)]
        assert rs == [(2, 4)[r]] * 2 and same_bytes(got.cpu(), torch.cat(want))
        out = dev.empty((6, 2), torch.float32, FAKE)
        A.all_to_all_single(comm, out, x, [3, 3], [3, 3])
        assert same_bytes(out.cpu(), torch.cat([x.cpu()[3 * r:3 * r + 3] - 100 * r + 100 * s for s in range(2)]))
        tokens = _on(dev, torch.arange(8, dtype=torch.float64).reshape(4, 2) + 10 * r)
        ids = torch.tensor([[0], [1], [1], [0]])
        et, tpe, handle = dispatch(comm, tokens, ids, _on(dev, torch.ones(4, 1, dtype=torch.float64)), 2)
        assert same_bytes(combine(comm, et, handle).cpu(), tokens.cpu())
        assert seen and all(q == NOT_READY for q in seen), f"the host waited for its stream: {seen}"
        comm.barrier()


def test_fake_all_to_all_mixed_nvlink_and_rdma_gpu_across_namespaces(tmp_path, fake_cuda):
    """Two "hosts" (network namespaces, each with its own host name): ranks 0
    and 1 share one, so their pair is nvlink, and both reach rank 2 over
    rdma-gpu; every entry point, byte-exact on late streams, in one job."""
    require_netns()
    seed = seeded()
    script = tmp_path / "a2a_worker.py"
    script.write_text(A2A_WORKER)
    with Netns(2) as net:
        procs = []
        for r, ns in enumerate((0, 0, 1)):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r if ns == 0 else 0),
                       LOCAL_WORLD_SIZE="2" if ns == 0 else "1", MASTER_ADDR=net.addr(0), MASTER_PORT="29614",
                       VARCOMM_FI_PROVIDER="tcp;ofi_rxm", VARCOMM_FI_IFACE=IFACE, OMP_NUM_THREADS="1",
                       SEED=str(seed), TESTS_DIR=str(ROOT / "tests"), PYTHONPATH=str(ROOT / "python"))
            # unshare --uts: its own host name, so the two namespaces are two hosts to varcomm
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"vchost{ns}",
                    sys.executable, str(script), fake_cuda]
            procs.append(net.popen(ns, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        res = finish(procs, timeout=200)
    for r, (code, out) in enumerate(res):
        assert code == 0 and f"OK {r}" in out, f"rank {r} (exit {code}, seed {seed}):\n{out[-3000:]}"


A2A_WORKER = textwrap.dedent('''
    import os, sys
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from test_gpu_alltoall import _fake, _run_entry_points
    dev, comm = _fake(sys.argv[1], transport="auto", delay_us=200, bound=256 * 1024, slots=3, timeout=60,
                      rdma_chunk=16 * 1024)
    r = comm.rank
    routes = [comm.device_transport_for(p) for p in range(3)]
    want = ["nvlink", "nvlink", "rdma-gpu"] if r < 2 else ["rdma-gpu", "rdma-gpu", "nvlink"]
    assert routes == want, (routes, comm.describe_transport(2 - r if r < 2 else 0))
    with comm:
        _run_entry_points(dev, comm, int(os.environ["SEED"]), iters=12, max_rows=40)
        comm.barrier()
    print("OK", r, flush=True)
''')


@world(2, timeout=240, requires=GPU_REQ)
def test_gpu_rdma_all_to_all_entry_points_match_reference():
    """The entry points on torch CUDA tensors with every peer on rdma-gpu."""
    torch, comm = _gpu_rdma_comm(bound=BOUND, slots=3, rdma_chunk=CHUNK)
    with comm:
        here = torch.device("cuda", torch.cuda.current_device())
        _run_entry_points(arrays.DeviceMemory(), comm, seeded(), iters=20, max_rows=40, place=here)
        comm.barrier()


@world(2, timeout=120, requires=("libfabric",))
def test_fake_rdma_captured_recv_is_refused_and_the_message_kept(fake_cuda):
    """A receive into device memory on a stream being captured is refused
    (InvalidArgument) and the message, host or device, stays for the next
    receive, which gets it intact. Catches: the message dropped (its slot
    never freed), or its chunks counted before the refusal (the next receive
    of that slot then waited for chunks that never come)."""
    gpu, comm = _comm(fake_cuda, slots=2)
    c, r = comm._c, comm.rank
    s = gpu.stream()
    n = 3 * CHUNK
    with comm:
        if r == 0:
            assert comm._f.send(np.frombuffer(_payload(9, 500), dtype=np.uint8).copy(), 1, 1, 30.0, 1)
            for i in range(4):
                p = gpu.alloc(n)
                gpu.put(p, _payload(i, n))
                c.send(1, 0, p, n, U8, (n,), 30.0, s)
            gpu.sync(s)
        else:
            out = gpu.alloc(BOUND)
            time.sleep(0.3)  # the first messages are in
            for tag in (0, 0, 1, 1):
                refused_while_captured(gpu, c, s, out, BOUND, tag, posted=False)
            received_in_order(gpu, c, s, out, BOUND, 500, [9], tag=1)
            received_in_order(gpu, c, s, out, BOUND, n, range(4))
        comm.barrier()
