"""Lifetimes the user controls: zero-copy slot loans (recv(copy=False)) and
works dropped without wait() (the engine's detached requests).

Every test goes through the public API only (init, send/recv/isend/irecv,
Work.wait/is_completed, recv(copy=False)); gc.collect() forces the drops."""
from __future__ import annotations

import gc
import mmap
import os
import re
import time

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS, make_tensor, same_bytes
from varcomm.testing import seeded, world

BOUND = 64 * 1024
DTS = [torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.bool, torch.float16, torch.complex64]


def _seed() -> int:
    return seeded(int(os.environ.get("VARCOMM_TEST_SEED", "0")) or None)


def _plan(seed: int, n: int, dts: list[torch.dtype] = DTS) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """n random (dtype, shape) cases, sizes from 0 to exactly the bound."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        dt = dts[int(g.integers(len(dts)))]
        isz = torch.empty((), dtype=dt).element_size()
        numel = BOUND // isz if i == 0 else int(g.integers(0, BOUND // isz + 1)) if g.random() < 0.3 \
            else int(g.integers(0, 300))
        out.append((dt, (numel,) if numel % 2 or numel == 0 else (2, numel // 2)))
    return out


def _flat_bytes(x) -> bytes:
    return x.tobytes() if isinstance(x, np.ndarray) else x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------
# copy=False: slot loans


@pytest.mark.parametrize("array", ["torch", "numpy"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_loan_contents(transport, array):
    """A loan has the sender's bytes, dtype and shape (random sizes up to the
    bound, every kind of dtype), several held at once.
    Catches: a view of the wrong slot or offset (header instead of payload),
    a wrong length/shape/dtype on the view, a slot returned early."""
    seed = _seed()
    cases = _plan(seed, 40, DTS if array == "torch" else [d for d in DTS if d != torch.bfloat16])
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30, array=array) as comm:
        if comm.rank == 0:
            for i, (dt, shape) in enumerate(cases):
                comm.send(make_tensor(dt, shape, seed=seed + i), dst=1)
        else:
            held = []
            for i, (dt, shape) in enumerate(cases):
                v = comm.recv(src=0, copy=False)
                want = make_tensor(dt, shape, seed=seed + i)
                assert tuple(v.shape) == shape, (seed, i, v.shape, shape)
                if array == "numpy":
                    assert isinstance(v, np.ndarray), type(v)
                    assert v.dtype == torch.empty((), dtype=dt).numpy().dtype, (i, v.dtype, dt)
                else:
                    assert isinstance(v, torch.Tensor) and v.dtype == dt, (i, type(v), getattr(v, "dtype", None))
                assert _flat_bytes(v) == _flat_bytes(want), f"seed {seed} message {i} ({dt} {shape}) differs"
                held.append((v, want))
                if len(held) == 3:  # up to 3 of 4 slots lent at once; the oldest go back
                    for v2, w2 in held:
                        assert _flat_bytes(v2) == _flat_bytes(w2), f"seed {seed}: a held loan changed"
                    held.clear()
                    gc.collect()
        comm.barrier()


def _wait_until(pred, what: str, limit: float = 10.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit, what
        time.sleep(0.0005)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_loan_holds_the_slot_until_freed(transport):
    """slots=2: two held loans (one only through a derived view) stop a third
    send (TimeoutError, nothing half-written); dropping the derived view lets
    it through; the other loan stays intact while 20 more messages go through
    the freed slot.
    Catches: a slot credited at recv time instead of at free (the send would
    not block, the loan would be overwritten), a slot returned while a derived
    view still reads it, the wrong slot returned (the held loan overwritten)."""
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30) as comm:
        a = torch.arange(1000, dtype=torch.int32)
        b = torch.arange(2000, dtype=torch.int64) * 3
        if comm.rank == 0:
            comm.send(a, dst=1)
            comm.send(b, dst=1)
            comm.barrier()  # 1: rank 1 holds both loans
            t0 = time.monotonic()
            with pytest.raises(varcomm.TimeoutError, match="rank 1"):
                comm.send(torch.full((10,), 7.0), dst=1, timeout=0.5)
            assert time.monotonic() - t0 >= 0.45
            comm.barrier()  # 2: rank 1 drops one loan
            for i in range(20):
                comm.send(torch.full((100 + i,), float(i)), dst=1, timeout=20)
            comm.barrier()  # 3
        else:
            va = comm.recv(src=0, copy=False)
            vb = comm.recv(src=0, copy=False)
            derived = va[10:20]
            del va
            gc.collect()  # the derived view alone keeps the slot
            comm.barrier()  # 1
            comm.barrier()  # 2: rank 0's third send timed out
            assert derived.tolist() == list(range(10, 20))
            del derived
            gc.collect()
            for i in range(20):
                got = comm.recv(src=0)
                assert got.tolist() == [float(i)] * (100 + i), i
                assert torch.equal(vb, b), f"held loan overwritten after message {i}"
            comm.barrier()  # 3
            # The message that timed out was cancelled, not half-sent: nothing else is
            # waiting (rank 0 may have closed by now: then its goodbye says so).
            with pytest.raises((varcomm.TimeoutError, varcomm.PeerFailure)):
                comm.recv(src=0, timeout=0.3)


@pytest.mark.parametrize("array", ["torch", "numpy"])
@world(2, timeout=60)
def test_a_forked_child_dropping_its_copy_of_a_loan_or_work_gives_nothing_back(array):
    """Rank 1 holds a copy=False result and a matched irecv (its message in,
    not yet waited for: both hold a slot), forks, and the child drops its
    copies and exits. The child's Loan gave the parent's slot back to the
    sender (helper-65), who wrote its next message into it: the tensor the
    parent held changed from 1.0 to 100.0; the child's dropped Work did the
    same for the irecv's slot (helper-68). Now a child made after the
    communicator gives nothing back: the sender's next send finds no free
    slot (slots=2) until the parent drops its own.
    Catches: the child's credit from either."""
    with varcomm.init(bound=4096, slots=2, timeout=10, array=array) as comm:
        if comm.rank == 0:
            comm.send(np.full(256, 1.0, np.float32), 1)
            comm.send(np.full(256, 5.0, np.float32), 1, tag=5)
            comm.barrier()  # 1: rank 1 holds both, and its child came and went
            with pytest.raises(varcomm.TimeoutError):
                comm.send(np.full(256, 100.0, np.float32), 1, timeout=0.5)
            comm.barrier()  # 2
            comm.barrier()  # 3: rank 1 dropped its loan and waited its irecv
            comm.send(np.full(256, 101.0, np.float32), 1)
            comm.barrier()  # 4
        else:
            held = comm.recv(0, copy=False)
            pending = comm.irecv(0, tag=5)
            deadline = time.monotonic() + 10
            while not pending.is_completed():  # matched: its slot is the Work's to give back
                assert time.monotonic() < deadline
                time.sleep(0.001)
            pid = os.fork()
            if pid == 0:
                del held, pending
                gc.collect()
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
            comm.barrier()  # 1
            comm.barrier()  # 2: rank 0's send found no slot
            assert (np.asarray(held) == 1.0).all()
            assert (np.asarray(pending.wait()) == 5.0).all()
            del held
            gc.collect()
            comm.barrier()  # 3
            assert (np.asarray(comm.recv(0)) == 101.0).all()
            comm.barrier()  # 4


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_loan_outlives_close(transport):
    """A loan held past comm.close() (and past the Communicator itself) is
    still readable, and freeing it afterwards is safe.
    Catches: the receive region unmapped at close under a live view (a
    crash or garbage), a release after close that raises or writes a
    credit into a torn-down transport."""
    x = make_tensor(torch.float64, (3, 333), seed=11)
    comm = varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30)
    if comm.rank == 0:
        comm.send(x, dst=1)
        comm.close()
        return
    v = comm.recv(src=0, copy=False)
    comm.close()
    del comm
    gc.collect()
    assert same_bytes(v, x)
    w = v.reshape(-1)[::7].clone()
    del v
    gc.collect()  # the slot's release runs on a closed communicator
    assert torch.equal(w, x.reshape(-1)[::7])


# ---------------------------------------------------------------------------
# works dropped without wait()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_isend_still_delivers(transport):
    """isends dropped at once, more than the slots (so some are still queued
    when dropped, and go out later) all arrive, in order, byte-exact.
    Catches: a detached queued send that is never written, or written twice;
    a detached in-flight send whose completion loses the slot ring's order."""
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30) as comm:
        # 1 B to 63 KB: on rdma most go in place (not copied inline), so a dropped one is still read
        xs = [make_tensor(torch.uint8, ((1 + 9001 * i) % BOUND,), seed=i) for i in range(8)]
        if comm.rank == 0:
            for x in xs:
                comm.isend(x, dst=1)  # the Work is dropped here
            gc.collect()
            comm.barrier()  # progresses the queued ones while rank 1 receives
        else:
            comm.barrier()
            for i, x in enumerate(xs):
                assert same_bytes(comm.recv(src=0), x), f"message {i} differs"
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_irecv_takes_its_message(transport):
    """A dropped irecv keeps its place in the stream: the message it would
    have matched is consumed and dropped (engine.cpp detach/progress_recvs),
    whether it was dropped while posted or after it matched; later receives
    get the later messages in order, other tags are untouched, and the
    dropped message's slot goes back (slots=1: the stream keeps moving).
    Catches: a dropped posted recv left in the queue forever (the next recv
    would hang behind it), a dropped matched message that keeps its slot (the
    sender blocks), a drop that eats the wrong message."""
    with varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=30) as comm:
        if comm.rank == 0:
            comm.barrier()  # rank 1 posted and dropped its irecvs
            for i in range(4):
                comm.send(torch.tensor([i]), dst=1, tag=0)
            comm.send(torch.tensor([100]), dst=1, tag=5)
            comm.send(torch.tensor([101]), dst=1, tag=5)
            comm.send(torch.tensor([4]), dst=1, tag=0)  # matched, then dropped unread
            comm.send(torch.tensor([5]), dst=1, tag=0)
        else:
            comm.irecv(src=0, tag=5)  # dropped while posted: will take 100
            comm.irecv(src=0, tag=0)  # dropped while posted: will take 0
            gc.collect()
            comm.barrier()
            assert [comm.recv(src=0, tag=0).item() for _ in range(3)] == [1, 2, 3]
            assert comm.recv(src=0, tag=5).item() == 101  # 100 went to the dropped irecv
            w = comm.irecv(src=0, tag=0)
            _wait_until(w.is_completed, "message 4 never matched")
            del w  # matched and unread: its message is dropped, its slot returned
            gc.collect()
            assert comm.recv(src=0, tag=0).item() == 5
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_irecv_with_out_finishes_into_out(transport):
    """A dropped irecv(out=buf) whose buffer is still alive: the transfer
    finishes (Work.__del__: "the transfer still finishes"), the message lands
    in buf and nowhere else, and the next recv gets the next message.
    Catches: a write past the message into buf, a dropped recv that loses
    the following message, a slot not returned after it (slots=1)."""
    with varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.barrier()
            comm.send(np.arange(10, dtype=np.int32), dst=1)
            comm.send(np.arange(3, dtype=np.int32) + 50, dst=1)
            comm.send(np.arange(4, dtype=np.int32) + 70, dst=1)
        else:
            buf = np.full(64, -1, dtype=np.int32)
            comm.irecv(src=0, out=buf)  # dropped
            gc.collect()
            comm.barrier()
            assert comm.recv(src=0).tolist() == [50, 51, 52]
            assert buf[:10].tolist() == list(range(10)) and (buf[10:] == -1).all(), buf
            assert comm.recv(src=0).tolist() == [70, 71, 72, 73]
        comm.barrier()


def _unmappable(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    """An int32 array whose memory is unmapped as soon as it and its mmap go:
    a later access through a stale pointer faults instead of landing in
    memory that happens to be reused."""
    m = mmap.mmap(-1, nbytes)
    return np.frombuffer(m, dtype=np.int32), m


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_irecv_never_writes_into_freed_out(transport):
    """A dropped irecv whose out= buffer is gone too must not write into that
    memory when its message arrives (the rank must survive and stay usable).
    Catches: the engine writing into a buffer nobody keeps alive."""
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.barrier()
            comm.send(np.arange(1000, dtype=np.int32), dst=1)
            comm.send(np.arange(5, dtype=np.int32), dst=1)
        else:
            buf, m = _unmappable(1 << 16)
            comm.irecv(src=0, out=buf)  # dropped, and then its buffer too
            del buf, m
            gc.collect()
            comm.barrier()
            got = comm.recv(src=0)
            assert got.tolist()[:5] == [0, 1, 2, 3, 4] or got.size == 1000
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_queued_isend_never_reads_freed_source(transport):
    """isend of a buffer that the caller then frees, dropping the Work, while
    the receiver holds every slot: the message must still arrive intact (the
    library keeps what it reads alive), and the sender must not crash.
    Catches: a queued detached send reading memory nobody keeps alive."""
    with varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=5, array="numpy") as comm:
        if comm.rank == 0:
            comm.send(np.zeros(1, dtype=np.int32), dst=1)  # fills the only slot
            x, m = _unmappable(1 << 16)
            x[:] = np.arange(x.size, dtype=np.int32)
            comm.isend(x, dst=1)  # queued: no free slot; dropped with its source
            del x, m
            gc.collect()
            comm.barrier()  # 1: still queued
            comm.barrier()  # 2: progresses the queued send once rank 1 freed the slot
        else:
            first = comm.recv(src=0, copy=False)  # held: the sender's only slot stays full
            comm.barrier()  # 1
            del first
            gc.collect()
            comm.barrier()  # 2
            got = comm.recv(src=0)
            assert (got == np.arange(1 << 14, dtype=np.int32)).all()
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_dropping_works_in_a_loop(transport):
    """2000 messages; the sender drops every isend, the receiver alternates
    a recv, an irecv waited on, an irecv dropped while posted and an irecv
    dropped after it matched. Every message not dropped is byte-exact and in
    order; slots=2, so a slot leaked by any drop path stalls the stream.
    Catches: request or slot leaks in the detach paths, a recycled request
    id that still names an old message (a later recv getting stale bytes)."""
    seed = _seed()
    n = 2000
    g = np.random.default_rng(seed)
    sizes = g.integers(0, 2000, n)
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            for i in range(n):  # nothing else keeps the sources of the dropped isends
                x = np.random.default_rng([seed, i]).integers(0, 256, int(sizes[i]), dtype=np.uint8)
                comm.isend(x, dst=1)
                if i % 500 == 0:
                    gc.collect()
            comm.barrier()  # progresses the queued sends while rank 1 receives
        else:
            buf = np.empty(BOUND, dtype=np.uint8)
            for i in range(n):
                want = np.random.default_rng([seed, i]).integers(0, 256, int(sizes[i]), dtype=np.uint8)
                k = i % 4
                if k == 0:
                    got = comm.recv(src=0)
                elif k == 1:
                    got = comm.irecv(src=0, out=buf).wait()
                elif k == 2:
                    comm.irecv(src=0)  # dropped while posted: takes message i
                    got = None
                else:
                    w = comm.irecv(src=0)
                    _wait_until(w.is_completed, f"seed {seed}: message {i} never matched")
                    del w  # dropped after it matched
                    got = None
                if got is not None:
                    assert got.tobytes() == want.tobytes(), f"seed {seed}: message {i} ({sizes[i]} bytes) differs"
            comm.barrier()


@pytest.mark.parametrize("out", ["none", "numpy", "torch"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_blocking_recv_progresses_queued_isends(transport, out):
    """MPI's isend; recv; wait pattern: rank 0 starts more isends than rank 1
    has slots for it, then blocks in a recv of rank 1's reply, which rank 1
    sends only after receiving them all. The blocking recv must keep
    writing the queued isends.
    Catches: a blocking receive path that does not progress queued sends."""
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=2) as comm:
        if comm.rank == 0:
            works = [comm.isend(torch.full((10,), float(i)), dst=1) for i in range(5)]
            buf = (None if out == "none" else np.zeros(4, np.int64) if out == "numpy"
                   else torch.zeros(4, dtype=torch.int64))
            assert comm.recv(src=1, out=buf).tolist() == [42]
            for w in works:
                w.wait()
        else:
            time.sleep(0.2)  # rank 0 is in its recv by now
            for i in range(5):
                assert comm.recv(src=0).tolist() == [float(i)] * 10
            comm.send(torch.tensor([42]), dst=0)
        comm.barrier()


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_channel_usable_after_a_recv_that_cannot_build_its_array(transport, copy):
    """A recv that fails after matching (no numpy dtype for bfloat16) must
    leave the channel usable: the message kept for a recv that can take it
    (out=), or dropped with its slot returned; never the slot leaked.
    Catches: a matched request abandoned on a Python-side error."""
    with varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=3, array="numpy") as comm:
        if comm.rank == 0:
            comm.send(torch.ones(4, dtype=torch.bfloat16), dst=1)
            comm.send(torch.arange(3, dtype=torch.int32), dst=1)
        else:
            with pytest.raises(varcomm.InvalidArgument, match="no numpy equivalent"):
                comm.recv(src=0, copy=copy)
            gc.collect()
            try:  # kept for a recv that can take it ...
                assert comm.recv(src=0, out=torch.zeros(8, dtype=torch.bfloat16)).tolist() == [1.0] * 4
            except varcomm.MessageMismatch:  # ... or dropped: the int32 message (kept by the mismatch) is next
                pass
            assert comm.recv(src=0).tolist() == [0, 1, 2]
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_dropped_irecv_with_too_small_out_keeps_the_message(transport):
    """A dropped irecv whose out= is too small for the message that arrives:
    the message is refused without being consumed (as for a waited irecv) and
    goes to the next recv; nothing is written into the small buffer.
    Catches: a detached refused recv that eats or half-writes the message."""
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.barrier()
            comm.send(np.arange(100, dtype=np.int32), dst=1)
            comm.send(np.arange(2, dtype=np.int32), dst=1)
        else:
            small = np.full(10, -1, dtype=np.int32)
            comm.irecv(src=0, out=small)  # dropped; 100 elements will not fit
            gc.collect()
            comm.barrier()
            assert comm.recv(src=0).tolist() == list(range(100))
            assert comm.recv(src=0).tolist() == [0, 1]
            assert (small == -1).all(), small
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60, expect_exit={1: None})
def test_dropped_works_when_the_peer_dies(transport):
    """Dropped irecvs and dropped queued isends to a peer that then dies: the
    survivor gets PeerFailure on its next operation with that peer (within
    seconds, no crash, no hang), and can still talk to itself.
    Catches: a detached request failed twice or left in a queue that a later
    operation trips over (engine.cpp fail_peer's detached branch)."""
    comm = varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=20)
    comm.barrier()
    if comm.rank == 1:  # not rank 0: it hosts the store
        os.kill(os.getpid(), 9)
    try:  # (a send looks at its peer at most every 200 ms: one may see it dead already, and fail at once)
        for i in range(3):  # the first fills the only slot; the others stay queued (their sources dropped too)
            comm.isend(torch.full((100,), float(i)), dst=1)
        comm.irecv(src=1)
        comm.irecv(src=1, out=np.zeros(4))
    except varcomm.PeerFailure:
        pass
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        comm.recv(src=1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(varcomm.PeerFailure):
        comm.send(torch.ones(1), dst=1)
    comm.send(torch.arange(3), dst=0)  # self-sends still work
    assert comm.recv(src=0).tolist() == [0, 1, 2]
    comm.close()


@pytest.mark.parametrize("form", ["new", "out", "irecv"])
@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "fallback"])
@world(2, timeout=90)
def test_a_landed_message_refused_by_its_array_kind_is_kept(transport, copy, form):
    """A large message (a rendezvous its sender wrote into the receiver's
    landing area) that the receive refuses after it landed (array="numpy" and
    bfloat16): kept however often, and the next receive gets it before the
    sender's later message, whole, in a new tensor or in out=. It had been
    dropped with its block (the receiver then waited for a message that was
    gone, and the sender's order broke)."""
    n = 3 << 19  # 3 MiB of bfloat16: over eager_max (rdma: 2 MiB), lands
    with varcomm.init(transport=transport, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.send(torch.arange(n, dtype=torch.bfloat16), dst=1)
            comm.send(torch.arange(3, dtype=torch.int32), dst=1)
        else:
            for _ in range(2):
                with pytest.raises(varcomm.InvalidArgument, match="no numpy equivalent"):
                    comm.recv(src=0, copy=copy)
            want = torch.arange(n, dtype=torch.bfloat16)
            if form == "out":
                out = torch.zeros(n + 8, dtype=torch.bfloat16)
                assert torch.equal(comm.recv(src=0, out=out), want)
            elif form == "irecv":
                assert torch.equal(comm.irecv(src=0, array="torch", copy=copy).wait(), want)
            else:
                assert torch.equal(comm.recv(src=0, array="torch", copy=copy), want)
            assert comm.recv(src=0).tolist() == [0, 1, 2]
            gc.collect()
            deadline = time.time() + 10
            while comm._c.landing_stats()[1] and time.time() < deadline:
                time.sleep(0.05)
            assert comm._c.landing_stats()[1] == 0, "a landing block was kept"
        comm.barrier()


@world(2, timeout=60)
def test_a_landed_message_asked_for_as_cupy_gets_the_cupy_error_and_is_kept():
    """copy=True with array="cupy" on a message that landed: the copy path's
    own answer (here: cupy is missing), never copy=False's "lends a host
    receive slot" (the landed block was offered as a loan first); kept."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed: it would take the message")
    with varcomm.init(transport="shm", timeout=30, array="numpy") as comm:
        n = 3 << 20
        if comm.rank == 0:
            comm.send(np.arange(n, dtype=np.uint8), 1)
        else:
            for _ in range(2):
                with pytest.raises(varcomm.InvalidArgument, match="needs cupy"):
                    comm.recv(0, array="cupy")
            assert np.array_equal(comm.recv(0), np.arange(n, dtype=np.uint8))
        comm.barrier()


# ---------------------------------------------------------------------------
# a peer that closed

@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_a_recv_from_a_rank_that_closed_fails_at_once_after_its_messages(transport):
    """Rank 0 (the rendezvous store's host) sends a small and an over-bound
    message, then closes. Rank 1 still gets both, byte-exact, and its next
    recv from rank 0 fails with PeerFailure within seconds, as does a send
    to it. Catches: that recv waiting until rank 0's close gave up waiting
    for rank 1 (30 s) or its own timeout; the goodbye overtaking the large
    message's data (it would be lost or fail)."""
    small = make_tensor(torch.float32, (7, 3), seed=5)
    big = make_tensor(torch.int64, (3 * BOUND // 8 + 5,), seed=6)
    comm = varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=60)
    if comm.rank == 0:
        comm.send(small, dst=1, tag=1)
        comm.send(big, dst=1, tag=2)
        comm.close()
        return
    time.sleep(1.0)  # rank 0 is in close() by now
    assert same_bytes(comm.recv(src=0, tag=2), big)
    assert same_bytes(comm.recv(src=0, tag=1), small)
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="rank 0 closed its communicator"):
        comm.recv(src=0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(varcomm.PeerFailure, match="rank 0 closed"):
        comm.irecv(src=0, tag=9).wait()
    with pytest.raises(varcomm.PeerFailure, match="rank 0 closed"):
        comm.send(small, dst=0)
    comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_a_send_blocked_on_a_rank_that_closed_fails_within_seconds(transport):
    """Rank 0 closes without receiving; rank 1 sends until rank 0's ring is
    full, and the send that waits for a free slot fails with PeerFailure
    within seconds (it waited for its timeout, 60 s)."""
    comm = varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=60)
    if comm.rank == 0:
        comm.close()
        return
    time.sleep(1.0)
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="rank 0 closed"):
        for _ in range(64):
            comm.send(np.arange(16.0), dst=0)
    assert time.monotonic() - t0 < 5
    comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_receives_posted_before_a_rank_closed_get_its_last_messages(transport):
    """Rank 1 posts its receives, rank 0 sends them their messages and closes
    before rank 1 makes any progress. A peer check (barrier, a wait's slow
    path, close) then delivered the messages and the goodbye together and
    failed the posted receives with "rank 0 closed" although their messages
    had arrived (and were lost with them)."""
    n = 4
    comm = varcomm.init(transport=transport, bound=BOUND, slots=n + 1, timeout=60)
    if comm.rank == 1:
        works = [comm.irecv(src=0, tag=t) for t in range(n)]
    comm.barrier()
    if comm.rank == 0:
        for t in range(n):
            comm.send(np.full(5, t, dtype=np.int32), dst=1, tag=t)
        comm.close()
        return
    time.sleep(1.0)  # rank 0 closed: its messages and goodbye are in our ring
    comm._c.peer_error(0)  # the check that delivers (barriers and slow waits make it)
    for t, w in enumerate(works):
        assert np.array_equal(w.wait(), np.full(5, t, dtype=np.int32)), t
    with pytest.raises(varcomm.PeerFailure, match="rank 0 closed"):
        comm.recv(src=0)
    comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_sends_received_before_their_receiver_closed_complete(transport):
    """Rank 0 isends small and over-bound messages and does not progress;
    rank 1 receives them all and closes. Rank 0's next recv from rank 1
    fails ("closed"), but the sends it received complete: they failed with
    PeerFailure when the goodbye was seen before their completions (or a
    receiver's answer to a large message's head) were processed."""
    small = np.arange(7, dtype=np.float64)
    big = np.arange(3 * BOUND // 8 + 5, dtype=np.int64)
    comm = varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=60)
    if comm.rank == 0:
        works = [comm.isend(x, dst=1, tag=t) for t, x in enumerate((small, big, small, big))]
        time.sleep(1.5)  # rank 1 takes them meanwhile where it can (shm copies them itself)
        with pytest.raises(varcomm.PeerFailure, match="rank 1 closed"):
            comm.recv(src=1, timeout=30)
        for w in works:
            w.wait()
        comm.close()
        return
    for t, x in enumerate((small, big, small, big)):
        assert np.array_equal(comm.recv(src=0, tag=t), x), t
    comm.close()


@world(2, timeout=90, expect_exit={1: None})
def test_close_after_a_fallback_peer_died_does_not_wait_for_its_goodbye():
    """On the fallback, the goodbye to a rank that died stays unacknowledged:
    close() waited its whole flush time (10 s) for it."""
    comm = varcomm.init(transport="fallback", bound=BOUND, slots=4, timeout=60)
    comm.barrier()
    if comm.rank == 1:
        os._exit(0)
    time.sleep(1.0)
    t0 = time.monotonic()
    comm.close()
    assert time.monotonic() - t0 < 5, time.monotonic() - t0


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_sends_still_queued_when_their_receiver_closed_fail(transport):
    """Rank 0 isends 4 messages into a ring of 2 (2 written, 2 queued) and
    waits on a receive from rank 1; rank 1 receives 2 and closes. The goodbye
    check wrote the 2 queued sends into the closed rank's freed slots and
    completed them (their messages lost, reported sent), where they failed
    with PeerFailure ("rank 1 closed"): only sends already written or
    answered may complete."""
    comm = varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=60)
    if comm.rank == 0:
        pending = comm.irecv(src=1, tag=99)  # never sent: its wait sees the goodbye
        works = [comm.isend(np.full(3, t, dtype=np.int32), dst=1, tag=t) for t in range(4)]
    comm.barrier()
    if comm.rank == 1:
        time.sleep(0.3)  # rank 0 is out of the barrier: it calls nothing while we receive and close
        for t in range(2):
            assert comm.recv(src=0, tag=t).tolist() == [t] * 3
        comm.close()
        return
    time.sleep(2.0)
    with pytest.raises(varcomm.PeerFailure, match="rank 1 closed"):
        pending.wait()
    for w in works[:2]:
        w.wait()
    for t, w in enumerate(works[2:], 2):
        with pytest.raises(varcomm.PeerFailure, match="rank 1 closed"):
            w.wait()
            raise AssertionError(f"send {t} completed: rank 1 closed before it was written")
    comm.close()


class _SyncRaises:
    """A device all-to-all handle whose synchronize raises what is not a VarcommError."""

    def __init__(self):
        self.closed = False

    def synchronize(self, stream, timeout):
        raise RuntimeError("CUDA error")

    def close(self):
        self.closed = True


@world(2, timeout=60)
def test_close_frees_everything_when_the_device_drain_raises():
    """close() drains the device all-to-all's kernels first; when that raises
    something other than a VarcommError (a RuntimeError, ^C), close raises it
    but still frees the device handle and the core. Catches: the drain outside
    close's try/finally (the handle and the core never freed, and close, marked
    done, could not be called again)."""
    comm = varcomm.init()
    comm.barrier()
    if comm.rank == 0:  # the store's host: it closes normally (and waits for rank 1 to go)
        comm.close()
        return
    dev = comm._device_a2a = _SyncRaises()
    with pytest.raises(RuntimeError, match="CUDA error"):
        comm.close()
    assert dev.closed, "the device handle was not freed"
    with pytest.raises(varcomm.ClosedError):
        comm.send(np.zeros(4, np.uint8), 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_a_dropped_irecv_out_of_a_streamed_message_is_filled_by_close(transport):
    """irecv(out=) of a message streamed through the slots (over the bound,
    CMA off), dropped at once, and the sender closes when its send is done:
    the receiver's close() failed the stream with chunks still in its slots
    (rdma: up to a quarter of out never written, and the send had succeeded).
    By the end of close() out holds the whole message."""
    n = 2_000_000
    msg = torch.arange(n, dtype=torch.float32)
    comm = varcomm.init(transport=transport, bound=64 * 1024, cma="off", landing=0, timeout=30)
    if comm.rank == 0:
        big, small = comm.isend(msg, dst=1), comm.isend(torch.tensor([7.0]), dst=1)
        small.wait()
        big.wait()
        comm.close()
        return
    out = torch.full((n,), -1.0)
    comm.irecv(src=0, out=out)  # the Work is dropped here
    assert comm.recv(src=0).tolist() == [7.0]
    comm.close()
    assert int((out != msg).sum()) == 0, f"{int((out == -1).sum())} of {n} elements never written"


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_a_receive_pending_when_both_close_fails_with_closed(transport):
    """Rank 1 closes, rank 0 20 ms later with a receive from it pending: the
    Work fails with ClosedError (README: whoever closed first). With the
    stream drain at the start of close, rank 0 saw rank 1's goodbye before it
    counted itself as leaving and failed the Work with PeerFailure."""
    comm = varcomm.init(transport=transport, timeout=20)
    if comm.rank == 0:
        w = comm.irecv(src=1, out=torch.zeros(4))
        comm.barrier()
        time.sleep(0.02)
        comm.close()
        with pytest.raises(varcomm.ClosedError):
            w.wait()
    else:
        comm.barrier()
        comm.close()


_EXIT_OPEN = """
import sys, time
import numpy as np
import varcomm
comm = varcomm.init(slots=4, bound=4096, timeout=30)
if comm.rank == 0:
    for i in range(13):
        comm.isend(np.full(100, i, np.int64), 1)  # dropped: past the 4-slot ring, still queued here
    sys.exit(0)  # no close(), no wait()
time.sleep(1)
got = [int(comm.recv(0)[0]) for _ in range(13)]
assert got == list(range(13)), got
print("received", len(got), flush=True)
comm.close()
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exit_without_close_flushes_queued_sends(transport, tmp_path):
    """A rank that isends 13 messages into a 4-slot ring and exits without
    close() or wait(): only the first ones arrived (8 of 13 in a user trial),
    the rest were lost with the process, silently. Communicators left open
    are now closed at interpreter exit, which flushes them."""
    import subprocess
    import sys

    script = tmp_path / "exit_open.py"
    script.write_text(_EXIT_OPEN)
    env = dict(os.environ, VARCOMM_TRANSPORT=transport)
    p = subprocess.run([sys.executable, "-m", "varcomm.run", "-n", "2", str(script)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "received 13" in p.stdout, p.stdout + p.stderr


_EXIT_MANY = """
import sys, time
import varcomm
cs = [varcomm.init(timeout=30) for _ in range(3)]
if sys.argv[1] == "raise" and cs[0].rank == 0:
    raise RuntimeError("rank 0 fails")
if sys.argv[1] == "raise":
    time.sleep(60)  # (the launcher stops this rank once rank 0 failed)
print("done", cs[0].rank, flush=True)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["exit", "raise"])
def test_exit_without_close_is_prompt(transport, how, tmp_path):
    """Three communicators left open at exit: the exit hook closed them in an
    order of memory addresses, different on each rank, and on rdma each
    close waits for the peer to close the same one (10 s a pair: 20 s here).
    A rank failing with an uncaught exception waited up to 30 s (rank 0,
    the store's host) for its peers to close before it exited, so the
    launcher stopped the job that much later. Now the latest is closed
    first on every rank, and a failing rank waits 1 s at most."""
    import subprocess
    import sys

    script = tmp_path / "exit_many.py"
    script.write_text(_EXIT_MANY)
    env = dict(os.environ, VARCOMM_TRANSPORT=transport)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "varcomm.run", "-n", "2", str(script), how], env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    if how == "exit":
        assert p.returncode == 0 and p.stdout.count("done") == 2, p.stdout + p.stderr
    else:
        assert p.returncode != 0 and "rank 0 fails" in p.stderr, p.stdout + p.stderr
    assert took < 9, f"{how} on {transport}: the job took {took:.1f} s to end"


_EXIT_FROZEN_HOST = """
import os, signal, sys, time
import numpy as np
import varcomm
comm = varcomm.init(timeout=120)
comm.barrier()
if comm.rank == 0:
    time.sleep(1)  # (rank 1 has seen the barrier complete)
    os.kill(os.getpid(), signal.SIGSTOP)  # the store's host stops answering (a partition, a frozen node)
time.sleep(2)
if sys.argv[1] == "sending":
    for _ in range(40):  # past the ring to the frozen rank: queued, flushed at exit
        comm.isend(np.zeros(25, np.float32), 0)
if sys.argv[1] == "barrier":
    t0 = time.monotonic()
    try:
        comm.barrier(timeout=2)
    except varcomm.TimeoutError as e:
        print(f"barrier raised after {time.monotonic() - t0:.1f} s: {e}", flush=True)
print("main done", flush=True)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["idle", "sending", "barrier"])
def test_exit_without_close_while_the_store_host_is_frozen_ends(transport, how, tmp_path):
    """Rank 0, which hosts the rendezvous store, stops answering (SIGSTOP);
    rank 1 exits without close(): the exit hook's close waited on each store
    call up to the store's timeout (the communicator's, 120 s here), so the
    process hung at its exit (on rdma; killed after 80 s in review). Store
    calls at exit now give up after 5 s each; also those of the flush of
    sends queued to the frozen rank ("sending"). A barrier(timeout=2) there
    ("barrier") blocked in a store call past its timeout, for good (helper-55):
    now a TimeoutError saying the store is silent, 2 s after its timeout."""
    import signal
    import subprocess
    import sys

    from varcomm.tools.run import free_port

    script = tmp_path / "frozen.py"
    script.write_text(_EXIT_FROZEN_HOST)
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VARCOMM_TRANSPORT=transport)
        procs.append(subprocess.Popen([sys.executable, str(script), how], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        out, _ = procs[1].communicate(timeout=60)
        assert "main done" in out and procs[1].returncode == 0, out
        if how == "barrier":
            said = re.search(r"barrier raised after ([\d.]+) s: barrier: the rendezvous store did not answer", out)
            assert said and float(said.group(1)) < 8, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_a_send_while_close_runs_on_another_thread_is_delivered_or_refused(transport):
    """One thread sends into a full 2-slot ring while another calls close():
    on rdma a send that returned OK was never delivered (written behind the
    goodbye, which ends the pair at the receiver). Now a send once close()
    has begun is ClosedError, and every send that returned is received."""
    import threading

    ctl = varcomm.init(transport="shm", timeout=60)  # to tell rank 1 how many sends returned
    comm = varcomm.init(transport=transport, timeout=30, slots=2)
    with ctl:
        if comm.rank == 0:
            closer = threading.Thread(target=lambda: (time.sleep(0.5), comm.close()))
            closer.start()
            done = 0
            with pytest.raises(varcomm.ClosedError):
                for i in range(50):
                    comm.send(np.full(10, i), 1)
                    done += 1
            ctl.send(np.array([done]), 1)  # (before the join: close waits for rank 1 to close too)
            closer.join()
            assert done >= 2, done  # the ring's two slots at least
        else:
            time.sleep(3)
            got = []
            with pytest.raises((varcomm.PeerFailure, varcomm.ClosedError, varcomm.TimeoutError)):
                while True:
                    got.append(int(comm.recv(0, timeout=5)[0]))
            done = int(ctl.recv(0)[0])
            assert got == list(range(done)), (got, done)
            comm.close()


_EXIT_PENDING_A2A = """
import sys
import torch
import varcomm
comm = varcomm.init(timeout=10)
n = comm.world_size
w = comm.all_to_all_v(torch.ones(n, 2), [1] * n, async_op=True)  # never waited, still referenced at exit
comm.barrier()
if sys.argv[1] == "close":
    comm.close()
print("done", comm.rank, flush=True)
"""


@pytest.mark.parametrize("how", ["open", "close"])
def test_an_unwaited_all_to_all_referenced_at_exit_does_not_hang_it(how, tmp_path):
    """An async all-to-all Work still held by a module global when the
    interpreter finalized: its __del__ started a thread to finish it, and a
    thread started then never runs, so Thread.start() waited for good (a
    user trial: both ranks printed 'done' and never exited)."""
    import subprocess
    import sys

    script = tmp_path / "exit_pending_a2a.py"
    script.write_text(_EXIT_PENDING_A2A)
    p = subprocess.run([sys.executable, "-m", "varcomm.run", "-n", "2", "--timeout", "40", str(script), how],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.count("done") == 2, p.stdout + p.stderr


_EXIT_RAISES = """
import sys
import varcomm
comm = varcomm.init(timeout=30)
comm.barrier()
if comm.rank == 1:
    raise RuntimeError("rank 1 fails")
try:
    comm.recv(1, timeout=20)
except varcomm.PeerFailure as e:
    print("rank 0:", e, flush=True)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_exits_on_an_uncaught_exception_is_said_to_have_failed(transport, tmp_path):
    """Its communicator is closed at exit, which says goodbye: the peers were
    told 'rank 1 closed its communicator', as if it had finished (a user
    trial). The goodbye now says the process exits after an uncaught exception."""
    import subprocess
    import sys

    from varcomm.tools.run import free_port

    script = tmp_path / "exit_raises.py"
    script.write_text(_EXIT_RAISES)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, VARCOMM_TRANSPORT=transport))
             for r in range(2)]
    outs = [p.communicate(timeout=90) for p in procs]
    assert "rank 1 fails" in outs[1][1], outs[1]
    assert "rank 0: " in outs[0][0], outs[0]
    assert "rank 1 failed: its process exits after an uncaught exception" in outs[0][0], outs[0]
