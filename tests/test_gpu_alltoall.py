"""All-to-all of device memory (CUDA tensors, splits known on the host) through
every entry point: all_to_all_v, all_to_all_single, all_to_all and
moe.dispatch/combine, checked byte for byte against a single-process reference.

Two groups, as in test_gpu.py:

* `test_fake_*`: on the CPU stand-in for the NVIDIA driver
  (transport/nvlink/fake_libcuda.cc: device memory is shared host memory,
  streams are threads). The Python entry points themselves run: `FakeDevice`
  replaces `arrays.DeviceMemory` (the facade's one seam to GPU arrays), so CPU
  tensors over the fake driver's device memory stand in for CUDA tensors and
  take the device path (nvlink slots, stream-ordered copies, the self chunk as
  a device copy, staging to peers with no device route). The host computes what
  kernels would, so "the caller's next work is ordered after the stream" is a
  stream synchronize here. `FAKE_CUDA_DELAY_US` delays every stream operation:
  a result read before its stream ran would be wrong.
* `test_gpu_*`: torch CUDA tensors on a real GPU (`requires=("gpu", ...)`);
  two ranks may share one GPU.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest
import torch

import test_gpu
import varcomm
from conftest import make_tensor, same_bytes
from test_alltoall import _random_splits, _reference, _x
from test_gpu import FakeGpu, nvlink_built
from varcomm import arrays
from varcomm.collectives import alltoall as A
from varcomm.collectives.moe import combine, dispatch
from varcomm.testing import seeded, world

fake_cuda = test_gpu.fake_cuda  # the fixture that builds the fake driver
BOUND = 64 * 1024
FAKE = "fake-cuda:0"  # the FakeDevice's one place
RDMA_REQ: dict[str, tuple[str, ...]] = {"shm": (), "rdma": ("libfabric",)}  # what each forced route needs
CASES = [(torch.float32, (3,)), (torch.bfloat16, (2, 5)), (torch.float32, ()), (torch.bfloat16, (7,))]


class FakeDevice(arrays.DeviceMemory):
    """CPU tensors over the fake driver's device memory (one arena, bump-allocated:
    nothing is reused, so no stream operation can land on a later tensor)."""

    def __init__(self, gpu: FakeGpu, size: int = 96 << 20):
        self.gpu = gpu
        self.current = gpu.stream()  # the caller's "current stream"
        self.base = gpu.alloc(size)
        self.size, self.used = size, 0
        self.arena = torch.frombuffer((ctypes.c_char * size).from_address(self.base), dtype=torch.uint8)

    def place(self, x):
        if not isinstance(x, torch.Tensor) or not x.is_cpu:
            return None
        # The storage's address, not data_ptr(): an empty view's is 0.
        return FAKE if self.base <= x.untyped_storage().data_ptr() < self.base + self.size else None

    def stream(self, place):
        return self.current

    def handle(self, stream):
        return stream

    def empty(self, shape, dtype, place):
        assert place == FAKE, place
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        off = (self.used + 255) // 256 * 256
        self.used = off + n
        assert self.used <= self.size, "FakeDevice arena exhausted: make it larger"
        return self.arena[off:off + n].view(dtype).reshape(tuple(shape))

    def to(self, t, place):
        if self.place(t) == place:
            return t
        a = self.empty(t.shape, t.dtype, place)
        a.copy_(t)
        return a

    def to_host(self, x):
        self.gpu.sync(self.current)
        return x.detach().clone()

    def record(self, x, stream):
        pass

    def wait(self, stream, place):
        self.gpu.sync(stream)  # the host is the next "kernel"

    def synchronize(self, stream):
        self.gpu.sync(stream)


def _fake(path: str, *, delay_us: int = 0, nvlink: str = "1", transport: str = "shm", **kw):
    """A communicator on the fake driver with FakeDevice installed; transport
    shm for host messages (nvlink for device ones where both ranks have it),
    or `transport="rdma"` (rdma-gpu for device ones)."""
    if delay_us:
        os.environ["FAKE_CUDA_DELAY_US"] = str(delay_us)  # read when the library loads (next line)
    gpu = FakeGpu(path)
    dev = FakeDevice(gpu)
    arrays.set_device_memory(dev)
    os.environ["VARCOMM_NVLINK"] = nvlink
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    comm = varcomm.init(transport=transport, **kw)
    return dev, comm


def _on(dev: FakeDevice, t: torch.Tensor) -> torch.Tensor:
    return dev.to(t, FAKE)


def _run_entry_points(dev, comm, seed: int, iters: int, max_rows: int, place=FAKE) -> None:
    """Every entry point, random splits (plenty of empty chunks), fp32 and bf16,
    each result against the single-process reference. dev: a DeviceMemory
    whose place `place` the inputs and outputs are in."""
    r, n = comm.rank, comm.world_size
    for it in range(iters):
        g = np.random.default_rng([seed, it])
        dt, trailing = CASES[it % len(CASES)]
        splits = _random_splits(g, n, max_rows)
        if it % 7 == 3:
            splits[:] = 0
            splits[:, it % n] = g.integers(1, max_rows + 1, size=n)  # all to one
        x = dev.to(_x(seed, it, r, int(splits[r].sum()), trailing, dt), place)
        want = _reference(seed, it, splits, r, trailing, dt)
        what = f"seed {seed} iteration {it}"
        mode = it % 5
        if mode == 0:
            got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
            assert dev.place(got) == place, f"{what}: the output is not in device memory"
        elif mode == 1:  # into a bound-sized device out: a view of its prefix
            out = dev.empty((BOUND // x.element_size(),), dt, place)
            got, rs = A.all_to_all_v(comm, x, torch.tensor(splits[r]), out=out)
            assert got.numel() == 0 or got.data_ptr() == out.data_ptr()
        elif mode == 2:  # async: nothing is read before wait()
            work = A.all_to_all_v(comm, x, splits[r].tolist(), async_op=True)
            got, rs = work.wait()
        elif mode == 3:  # torch's contract, output splits known
            out = dev.empty((int(splits[:, r].sum()),) + trailing, dt, place)
            out.fill_(0)
            A.all_to_all_single(comm, out, x, splits[:, r].tolist(), splits[r].tolist())
            got, rs = out, splits[:, r].tolist()
        else:  # the list form: None outputs allocated on the device, given ones filled
            offs = np.concatenate([[0], np.cumsum(splits[r])])
            ins = [x[offs[d]:offs[d + 1]] for d in range(n)]
            given = [None if s % 2 else dev.empty((int(splits[s, r]),) + trailing, dt, place) for s in range(n)]
            outs = A.all_to_all(comm, given, ins)
            assert all(dev.place(o) == place for o in outs), what
            assert all(outs[s] is given[s] for s in range(n) if given[s] is not None)
            got, rs = torch.cat(outs), [int(o.shape[0]) for o in outs]
        assert list(rs) == splits[:, r].tolist(), (what, rs)
        assert same_bytes(got.cpu(), want), f"{what} mode {mode}: payload differs from the single-process reference"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fake_every_entry_point_matches_reference(fake_cuda, n):
    @world(n, timeout=180)
    def body():
        seed = seeded()
        dev, comm = _fake(fake_cuda, bound=BOUND, slots=3, timeout=60)
        with comm:
            assert all(comm.device_transport_for(p) == "nvlink" for p in range(n)), comm.describe_transport(0)
            _run_entry_points(dev, comm, seed, iters=20, max_rows=40)
            comm.barrier()

    body()


@world(3, timeout=240)
def test_fake_delayed_streams_and_two_phase(fake_cuda):
    """Every stream operation 1 ms late: a copy not ordered before its reader
    (or a credit returned before the slot was read) shows as wrong bytes. The
    conventional two-phase strategy on device memory too."""
    seed = seeded()
    dev, comm = _fake(fake_cuda, delay_us=1000, bound=BOUND, slots=2, timeout=60)
    with comm:
        _run_entry_points(dev, comm, seed, iters=10, max_rows=30)
        comm.barrier()
    with varcomm.init(transport="shm", a2a_algorithm="two-phase", bound=BOUND, slots=2, timeout=60) as comm:
        _run_entry_points(dev, comm, seed + 1, iters=5, max_rows=30)
        comm.barrier()


@world(4, timeout=180)
def test_fake_skewed_zipf_zero_rows_and_self_only(fake_cuda):
    """MoE-like routing (one rank gets most rows), everything to one rank,
    everything to itself (the device self copy alone), nothing at all."""
    seed = seeded()
    dev, comm = _fake(fake_cuda, bound=1 << 20, slots=4, timeout=60)
    with comm:
        r, n = comm.rank, comm.world_size
        for it in range(6):
            g = np.random.default_rng([seed, it])
            splits = np.zeros((n, n), dtype=np.int64)
            for s in range(n):
                dest = np.minimum(g.zipf(1.6, size=300) - 1, 4 * n - 1) // 4
                splits[s] = np.bincount(dest, minlength=n)
            if it == 3:
                splits[:] = 0
                splits[:, 1] = 300
            if it == 4:
                splits[:] = np.diag([300] * n)
            if it == 5:
                splits[:] = 0
            dt = torch.bfloat16 if it % 2 else torch.float32
            x = _on(dev, _x(seed, it, r, int(splits[r].sum()), (16,), dt))
            got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
            assert rs == splits[:, r].tolist() and dev.place(got) == FAKE
            assert same_bytes(got, _reference(seed, it, splits, r, (16,), dt)), f"seed {seed} iteration {it}"
        comm.barrier()


@world(3, timeout=180)
def test_fake_mixed_routes_some_peers_staged(fake_cuda):
    """Rank 2 keeps its nvlink data flags in host memory, ranks 0 and 1 in
    device memory: pairs with rank 2 have no device route, so one collective
    mixes GPU-to-GPU chunks (0 <-> 1, and each self chunk) with chunks staged
    through host memory (to and from rank 2). Then rank 2 without any device
    transport (nvlink off): it runs the host collective on host copies."""
    seed = seeded()
    r0 = varcomm.testing.rank()
    os.environ["VARCOMM_NVLINK_FLAGS"] = "host" if r0 == 2 else "device"
    dev, comm = _fake(fake_cuda, delay_us=300, bound=BOUND, slots=3, timeout=60)
    with comm:
        r = comm.rank
        routes = [comm.device_transport_for(p) for p in range(3)]
        assert routes == (["nvlink", "nvlink", None] if r < 2 else [None, None, "nvlink"]), routes
        _run_entry_points(dev, comm, seed, iters=10, max_rows=30)
        comm.barrier()
    os.environ["VARCOMM_NVLINK"] = "0" if r0 == 2 else "1"
    os.environ["VARCOMM_NVLINK_FLAGS"] = "device"
    with varcomm.init(transport="shm", bound=BOUND, slots=3, timeout=60) as comm:
        assert (comm.device_transport_for(r0) is None) == (r0 == 2)
        _run_entry_points(dev, comm, seed + 1, iters=10, max_rows=30)
        comm.barrier()


@world(3, timeout=180)
def test_fake_staged_chunks_read_once_into_device_outputs(fake_cuda):
    """cma=chunks (auto's choice where the probe prefers two memcpys): rank 2
    has no GPU transport and runs the host collective on host copies; the
    640 KiB host chunks it sends ranks 0 and 1 go by rendezvous, and those
    ranks read them once, through host memory, into their device outputs
    (this failed the pair: the device path pulled only under cma=on)."""
    seed = seeded()
    r0 = varcomm.testing.rank()
    dev, comm = _fake(fake_cuda, nvlink="0" if r0 == 2 else "1", bound=1 << 20, slots=2, timeout=60,
                      cma="chunks")
    with comm:
        r, n = comm.rank, comm.world_size
        if comm.route_info((r + 1) % n)["cma_refused"]:
            pytest.skip("CMA is not allowed here")
        before = comm._c.pulled_bytes
        for it in range(3):
            splits = np.full((n, n), 160)  # rows of 4 KiB: 640 KiB chunks
            x = _on(dev, _x(seed, it, r, int(splits[r].sum()), (1024,), torch.float32))
            got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
            assert dev.place(got) == FAKE
            want = _reference(seed, it, splits, r, (1024,), torch.float32)
            assert list(rs) == [160] * n and same_bytes(got.cpu(), want), f"seed {seed} iteration {it}"
        if r < 2:  # rank 2's chunks, read once (the device pairs' chunks are not host chunks)
            assert comm._c.pulled_bytes - before == 3 * (160 << 12)
        comm.barrier()


@pytest.mark.parametrize("cma", ["auto", "chunks", "off"])
def test_fake_staged_chunk_over_the_bound_reaches_a_device_output(fake_cuda, cma):
    """Rank 2 has no GPU transport and runs the host collective on host
    copies; its chunk for rank 0 is twice rank 0's bound, so it goes by
    rendezvous as a host chunk, into rank 0's device output. Under CMA the
    receive waited to pull it through its slot into the device output, which
    a head over the bound cannot do: the pair failed (PeerFailure on rank 0,
    then and after; rank 2 saw success). It lands in host memory first now."""
    @world(3, timeout=120)
    def body():
        seed = seeded()
        r0 = varcomm.testing.rank()
        bound = 64 << 10
        dev, comm = _fake(fake_cuda, nvlink="0" if r0 == 2 else "1", bound=bound, slots=2, timeout=20, cma=cma)
        with comm:
            r, n = comm.rank, comm.world_size
            for it in range(2):
                splits = np.full((n, n), 4 + it)
                splits[2, 0] = 2 * bound // 4 + it  # rows of 4 bytes
                x = _on(dev, _x(seed, it, r, int(splits[r].sum()), (), torch.float32))
                got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
                want = _reference(seed, it, splits, r, (), torch.float32)
                assert list(rs) == splits[:, r].tolist() and same_bytes(got.cpu(), want), f"seed {seed} it {it}"
            # The list form, outputs allocated on the device once the headers are in
            # (they were taken for host memory up front: the same failed pair).
            size = {(2, 0): 2 * bound // 4}
            ins = [_on(dev, torch.full((size.get((r, d), 4),), float(10 * r + d))) for d in range(n)]
            for outs in (None, [None] * n):
                got = A.all_to_all(comm, outs, ins)
                for s in range(n):
                    g = got[s].cpu()
                    assert dev.place(got[s]) == FAKE and g.shape == (size.get((s, r), 4),), (s, g.shape)
                    assert bool((g == 10 * s + r).all()), (s, g[:4])
            comm.barrier()

    body()


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_fake_errors_then_usable(fake_cuda, transport):
    """The host path's errors on device memory: a chunk over its receiver's
    bound, a dtype and a trailing-shape mismatch, output splits that disagree,
    an out too small; after each, the next collective is right everywhere.
    On nvlink (shm) and on rdma-gpu (the route forced to rdma)."""
    @world(4, timeout=180, requires=RDMA_REQ[transport])
    def body():
        _errors_then_usable(fake_cuda, transport)

    body()


def _errors_then_usable(fake_cuda: str, transport: str) -> None:
    bound = 4096
    dev, comm = _fake(fake_cuda, transport=transport, bound=bound, slots=3, timeout=30)
    with comm:
        want = "rdma-gpu" if transport == "rdma" else "nvlink"
        assert comm.device_transport_for((comm.rank + 1) % comm.world_size) == want
        r, n = comm.rank, comm.world_size

        def still_works(k: int) -> None:
            y = _on(dev, torch.arange(n, dtype=torch.int64) + 10 * r + 100 * k)
            got, rs = A.all_to_all_v(comm, y, [1] * n)
            assert rs == [1] * n and got.tolist() == [10 * s + r + 100 * k for s in range(n)]

        splits = [2] * n
        if r == 1:
            splits[3] = bound // 4 + 1  # one float32 row over rank 3's bound
        x = _on(dev, torch.arange(sum(splits), dtype=torch.float32))
        if r == 1:
            with pytest.raises(varcomm.MessageTooLarge, match="rank 3"):
                A.all_to_all_v(comm, x, splits)
        elif r == 3:
            with pytest.raises(varcomm.MessageTooLarge, match="rank 1") as ei:
                A.all_to_all_v(comm, x, splits)
            assert ei.value.peer == 1
        else:
            assert A.all_to_all_v(comm, x, splits)[1] == [2] * n
        still_works(0)
        x = _on(dev, torch.zeros(n * 2, 4, dtype=torch.float64 if r == 2 else torch.float32))
        with pytest.raises(varcomm.MessageMismatch, match="rank 0" if r == 2 else "rank 2"):
            A.all_to_all_v(comm, x, [2] * n)
        still_works(1)
        x = _on(dev, torch.zeros(n, 5 if r == 1 else 4))
        with pytest.raises(varcomm.MessageMismatch, match="rank 0" if r == 1 else "rank 1"):
            A.all_to_all_v(comm, x, [1] * n)
        still_works(2)
        wrong = (r + 1) % n
        expect = [1] * n
        expect[wrong] = 2
        out = dev.empty((sum(expect), 3), torch.float32, FAKE)
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {wrong}"):
            A.all_to_all_single(comm, out, _on(dev, torch.ones(n, 3)), expect, [1] * n)
        still_works(3)
        with pytest.raises(varcomm.MessageTooLarge, match="out holds"):
            A.all_to_all_v(comm, _on(dev, torch.ones(2 * n)), [2] * n, out=dev.empty((3,), torch.float32, FAKE))
        still_works(4)
        with pytest.raises(varcomm.InvalidArgument, match="same memory"):
            A.all_to_all_v(comm, _on(dev, torch.ones(n)), [1] * n, out=torch.zeros(n))
        comm.barrier()


@world(3, timeout=120)
def test_fake_timeout_then_usable(fake_cuda):
    """Rank 1 is late: ranks 0 and 2 raise TimeoutError naming it; their chunks
    were written before they gave up, so rank 1's collective completes, and the
    next one is right everywhere."""
    dev, comm = _fake(fake_cuda, bound=BOUND, slots=3, timeout=30)
    with comm:
        r, n = comm.rank, comm.world_size
        x = _on(dev, torch.arange(n, dtype=torch.float32) + 10 * r)
        comm.barrier()
        if r != 1:
            with pytest.raises(varcomm.TimeoutError, match="rank 1"):
                A.all_to_all_v(comm, x, [1] * n, timeout=2.0)
            comm.barrier()
        else:
            comm.barrier()
            got, rs = A.all_to_all_v(comm, x, [1] * n, timeout=10)
            assert got.tolist() == [10.0 * s + r for s in range(n)]
        comm.barrier()
        y = _on(dev, torch.arange(2 * n, dtype=torch.int64).reshape(n, 2) + 100 * r)
        got, rs = A.all_to_all_v(comm, y, [1] * n)
        assert got.tolist() == [[100 * s + 2 * r, 100 * s + 2 * r + 1] for s in range(n)]
        comm.barrier()


@world(3, timeout=120)
def test_fake_refused_stream_fails_alone(fake_cuda):
    """Every rank's current stream reports a CUDA graph capture: the all-to-all
    is refused (InvalidArgument naming the graph) before any chunk is written,
    on every rank, and so is a p2p isend; neither stays queued, so the next
    collective and sends on a plain stream are right."""
    dev, comm = _fake(fake_cuda, bound=BOUND, slots=3, timeout=30)
    with comm:
        r, n = comm.rank, comm.world_size
        x = _on(dev, torch.arange(2 * n, dtype=torch.float32) + 10 * r)
        plain = dev.current
        capturing = dev.gpu.stream()
        dev.gpu.lib.fake_cuda_set_capturing(ctypes.c_void_p(capturing), 1)
        dev.current = capturing
        with pytest.raises(varcomm.InvalidArgument, match="CUDA graph"):
            A.all_to_all_v(comm, x, [2] * n)
        with pytest.raises(varcomm.InvalidArgument, match="CUDA graph"):
            comm._c.isend((r + 1) % n, 3, x.data_ptr(), 8, arrays.dtypes.from_torch(torch.float32), (2,), capturing)
        dev.current = plain
        comm.barrier()
        got, rs = A.all_to_all_v(comm, x, [2] * n)
        assert rs == [2] * n and got.tolist() == [10.0 * s + v for s in range(n) for v in (2 * r, 2 * r + 1)]
        w = comm.isend(torch.tensor([r]), (r + 1) % n, tag=3)
        assert comm.recv((r - 1) % n, tag=3).item() == (r - 1) % n
        w.wait()
        comm.barrier()


class _NoHostWait(FakeDevice):
    """As on a GPU: the caller's next work is ordered after the stream without
    the host waiting for it (and rows the host wrote need no wait to copy)."""

    def to_host(self, x):
        return x.detach().clone()

    def wait(self, stream, place):
        pass


@pytest.mark.parametrize("host_flags", [1, 0])
@world(2, timeout=120)
def test_fake_staged_landing_does_not_block_the_host(fake_cuda, host_flags):
    """One rank keeps its data flags in host memory, so the pair has no
    device route: rank 0's chunk lands in rank 1's device out from a host
    slot, by a copy on rank 1's stream (from memory registered with the
    driver: the fake, like the driver, makes a copy from pageable memory wait
    for the stream first, on the caller's thread; rank 1 with device flags
    had registered only its region's control words). With that stream held (earlier GPU
    work still running), rank 1's all_to_all_v returns at once (the engine
    waited for the stream with its lock held, stalling the rank's every
    thread), and the slot stays rank 1's until the copy ran: rank 0's next
    message (slots=1) does not arrive before, and the rows that land are
    rank 0's chunk, not that message."""
    r0 = varcomm.testing.rank()
    os.environ["VARCOMM_NVLINK_FLAGS"] = "host" if r0 == host_flags else "device"
    gpu = FakeGpu(fake_cuda)
    dev = _NoHostWait(gpu)
    arrays.set_device_memory(dev)
    os.environ["VARCOMM_NVLINK"] = "1"
    os.environ["VARCOMM_NVLINK_DEVICE"] = "0"
    with varcomm.init(transport="shm", bound=BOUND, slots=1, timeout=60) as comm:
        r = comm.rank
        assert comm.device_transport_for(1 - r) is None
        xs = [torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * q for q in range(2)]
        splits = [[2, 4], [1, 5]]
        x = _on(dev, xs[r])
        out = dev.empty((16, 2), torch.float32, FAKE)
        out.fill_(-1)
        if r == 1:
            held = gpu.hold(dev.current)
            _, rs = A.all_to_all_v(comm, x, splits[r], out=out)
            assert not held.timed_out, "all_to_all_v waited for the held stream"
            assert rs == [4, 5]
            with pytest.raises(varcomm.TimeoutError):  # its slot is not free before the copy ran
                comm.recv(0, timeout=1.0)
            held.release()
            gpu.sync(dev.current)
            assert out[:9].tolist() == torch.cat([xs[0][2:], xs[1][1:]]).tolist()
            assert comm.recv(0).tolist() == [7, 7, 7]
        else:
            _, rs = A.all_to_all_v(comm, x, splits[r], out=out)
            assert rs == [2, 1]
            comm.send(np.full(3, 7), 1)  # takes rank 1's slot once its copy ran
            gpu.sync(dev.current)
            assert out[:3].tolist() == torch.cat([xs[0][:2], xs[1][:1]]).tolist()
        comm.barrier()


@world(3, timeout=90, expect_exit={2: None})
def test_fake_dead_peer_raises_peer_failure(fake_cuda):
    dev, comm = _fake(fake_cuda, bound=BOUND, slots=3, timeout=60)
    r, n = comm.rank, comm.world_size
    if r == 2:
        os._exit(3)  # dies without closing
    # PeerFailure, not the 60 s TimeoutError: the death was noticed, not waited out
    # (no wall-clock bound here: under load that measures the machine).
    with pytest.raises(varcomm.PeerFailure, match="rank 2"):
        A.all_to_all_v(comm, _on(dev, torch.zeros(n, 3)), [1] * n)
    other = 1 - r  # the survivors' channel still works, device memory too
    comm.send(torch.tensor([r]), dst=other)
    assert comm.recv(src=other).item() == other


def _moe_inputs(seed: int, rank: int, E: int, K: int, H: int):
    g = torch.Generator().manual_seed(hash((seed, rank)) & 0x7FFFFFFF)
    T = int(torch.randint(0, 30, (), generator=g)) if rank != 1 else 0  # rank 1: no tokens at all
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    return torch.randn(T, H, generator=g, dtype=torch.float64), ids, torch.rand(T, K, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("n", "transport"), [(3, "shm"), (4, "shm"), (3, "rdma")])
def test_fake_moe_dispatch_combine_autograd(fake_cuda, n, transport):
    """dispatch/combine on device tokens: forward and every gradient equal the
    same computation done locally (fp64: 1e-12), and the all-to-alls ran on
    device memory (nvlink, or rdma-gpu with the route forced to rdma)."""
    @world(n, timeout=180, requires=RDMA_REQ[transport])
    def body():
        seed = seeded()
        E, K, H = 2 * n, 2, 5
        dev, comm = _fake(fake_cuda, transport=transport, delay_us=200, bound=1 << 20, slots=3, timeout=60)
        with comm:
            r = comm.rank
            per = E // n
            tokens, ids, w = _moe_inputs(seed, r, E, K, H)
            td = _on(dev, tokens).requires_grad_(True)
            wd = _on(dev, w).requires_grad_(True)
            scale = torch.arange(1, E + 1, dtype=torch.float64)
            used = dev.used
            et, tpe, handle = dispatch(comm, td, ids, wd, E)
            assert handle.place == FAKE
            if tokens.shape[0] or sum(handle.recv_splits):
                assert dev.used > used, "dispatch did not run on device memory"
            mine = torch.repeat_interleave(scale[r * per:(r + 1) * per], tpe)
            y = combine(comm, torch.tanh(et) * mine[:, None], handle)
            (y ** 2).sum().backward()
            t2 = tokens.clone().requires_grad_(True)
            w2 = w.clone().requires_grad_(True)
            ref = (w2[..., None] * torch.tanh(t2)[:, None, :] * scale[ids][..., None]).sum(1)
            (ref ** 2).sum().backward()
            for a, b in ((y.detach(), ref.detach()), (td.grad, t2.grad), (wd.grad, w2.grad)):
                assert a.shape == b.shape and bool(((a - b).abs() <= 1e-12 + 1e-12 * b.abs()).all()), (a, b)
            comm.barrier()

    body()


# ---------------------------------------------------------------------------
# torch CUDA tensors on a real GPU

GPU_REQ = ("gpu", nvlink_built)


def _gpu_comm(**kw):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    comm = varcomm.init(transport="shm", timeout=60, **kw)
    assert all(comm.device_transport_for(p) == "nvlink" for p in range(comm.world_size)), \
        comm.describe_transport(0)
    return comm


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_every_entry_point_matches_reference():
    seed = seeded()
    with _gpu_comm(bound=BOUND, slots=3) as comm:
        here = torch.device("cuda", torch.cuda.current_device())
        _run_entry_points(arrays.DeviceMemory(), comm, seed, iters=20, max_rows=40, place=here)
        comm.barrier()


@world(3, timeout=180, requires=GPU_REQ)
def test_gpu_mixed_routes_some_peers_staged():
    """As test_fake_mixed_routes_some_peers_staged, on the real driver: rank 2's
    nvlink flags differ, so its pairs are staged through host memory (the host
    slot copied into device memory on the stream) while 0 <-> 1 go GPU to GPU;
    then rank 2 with nvlink off runs the host collective on host copies."""
    seed = seeded()
    r0 = varcomm.testing.rank()
    os.environ["VARCOMM_NVLINK_FLAGS"] = "host" if r0 == 2 else "device"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    here = torch.device("cuda", torch.cuda.current_device())
    with varcomm.init(transport="shm", bound=BOUND, slots=3, timeout=60) as comm:
        routes = [comm.device_transport_for(p) for p in range(3)]
        assert routes == (["nvlink", "nvlink", None] if r0 < 2 else [None, None, "nvlink"]), routes
        _run_entry_points(arrays.DeviceMemory(), comm, seed, iters=10, max_rows=30, place=here)
        comm.barrier()
    os.environ["VARCOMM_NVLINK"] = "0" if r0 == 2 else "1"
    os.environ["VARCOMM_NVLINK_FLAGS"] = "device"
    with varcomm.init(transport="shm", bound=BOUND, slots=3, timeout=60) as comm:
        assert (comm.device_transport_for(r0) is None) == (r0 == 2)
        _run_entry_points(arrays.DeviceMemory(), comm, seed + 1, iters=10, max_rows=30, place=here)
        comm.barrier()


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_collectives_do_not_block_the_host():
    """20 all-to-alls enqueued behind ~0.5 s of GPU work return long before it
    ran (headers travel at enqueue; receivers allocate without waiting on the
    GPU); their results are right once the stream ran."""
    with _gpu_comm(bound=1 << 20, slots=32) as comm:  # a slot per collective: no credit waits either
        r = comm.rank
        xs = [torch.full((64, 256), float(10 * r + i), device="cuda") for i in range(20)]
        torch.cuda.synchronize()
        comm.barrier()
        torch.cuda._sleep(1_000_000_000)
        t0 = time.perf_counter()
        got = [A.all_to_all_v(comm, x, [32, 32])[0] for x in xs]
        host = time.perf_counter() - t0
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        gpu_left = time.perf_counter() - t1
        assert gpu_left > 0.05 and host < gpu_left / 3, (host, gpu_left)
        for i, g in enumerate(got):
            assert g.shape == (64, 256) and g[:32].eq(10 * 0 + i).all() and g[32:].eq(10 * 1 + i).all()
        comm.barrier()


@world(2, timeout=180, requires=GPU_REQ)
def test_gpu_moe_dispatch_combine_autograd():
    seed = seeded()
    E, K, H = 4, 2, 8
    with _gpu_comm(bound=1 << 20, slots=4) as comm:
        r, n = comm.rank, comm.world_size
        per = E // n
        tokens, ids, w = _moe_inputs(seed, r, E, K, H)
        td, wd = tokens.cuda().requires_grad_(True), w.cuda().requires_grad_(True)
        scale = torch.arange(1, E + 1, dtype=torch.float64, device="cuda")
        et, tpe, handle = dispatch(comm, td, ids.cuda(), wd, E)
        assert et.is_cuda and tpe.is_cuda
        mine = torch.repeat_interleave(scale[r * per:(r + 1) * per], tpe)
        y = combine(comm, torch.tanh(et) * mine[:, None], handle)
        (y ** 2).sum().backward()
        t2, w2 = tokens.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = (w2[..., None] * torch.tanh(t2)[:, None, :] * scale.cpu()[ids][..., None]).sum(1)
        (ref ** 2).sum().backward()
        for a, b in ((y.detach(), ref.detach()), (td.grad, t2.grad), (wd.grad, w2.grad)):
            a = a.cpu()
            assert a.shape == b.shape and bool(((a - b).abs() <= 1e-10 + 1e-10 * b.abs()).all()), (a, b)
        bf = make_tensor(torch.bfloat16, (6, 4), seed=r).cuda()  # bf16 through all_to_all_single
        out = torch.empty(6, 4, dtype=torch.bfloat16, device="cuda")
        A.all_to_all_single(comm, out, bf)
        want = torch.cat([make_tensor(torch.bfloat16, (6, 4), seed=s)[3 * r:3 * r + 3] for s in range(n)])
        assert same_bytes(out.cpu(), want)
        comm.barrier()


def test_fake_moe_one_row_of_narrow_tokens(fake_cuda):
    """Device tokens (host topk_ids: the `place` path) whose rows are not a
    multiple of 4 bytes wide (bfloat16 H=5, uint8 H=3), one row received per
    rank: the expert index was read at an unaligned offset of the received
    device row and view(int32) raised; the rows, the backward included, are
    as sent."""
    @world(2, timeout=120)
    def body():
        dev, comm = _fake(fake_cuda, delay_us=200, bound=1 << 20, slots=3, timeout=60)
        with comm:
            r = comm.rank
            ids = torch.tensor([[1 - r]])
            for dt, H in ((torch.uint8, 3), (torch.bfloat16, 5)):
                tokens = (torch.arange(H).reshape(1, H) + 10 * r).to(dt)
                et, tpe, handle = dispatch(comm, _on(dev, tokens), ids, _on(dev, torch.ones(1, 1)), 2)
                assert handle.place == FAKE and tpe.tolist() == [1]
                assert torch.equal(dev.to_host(et), (torch.arange(H).reshape(1, H) + 10 * (1 - r)).to(dt))
            td = _on(dev, torch.arange(5.0).reshape(1, 5).to(torch.bfloat16)).requires_grad_(True)
            et, _, handle = dispatch(comm, td, ids, _on(dev, torch.ones(1, 1)), 2)
            combine(comm, et * 2, handle).sum().backward()
            assert torch.equal(dev.to_host(td.grad), torch.full((1, 5), 2.0, dtype=torch.bfloat16))
            comm.barrier()

    body()
