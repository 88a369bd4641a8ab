"""Issue 11: the landing area (protocol.h kPushCredit). A rendezvous message
received without out=, or into a comm.empty buffer, is written by its sender
straight into a block of the receiver's landing area, and that block is the
result: one copy in all. The block is freed when the result is dropped, a
receive that gives up frees it once the write lands, and a full area falls
back to the other rendezvous paths. Run on every transport that lands (shm,
rdma); the fallback must still deliver the same bytes."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS
from varcomm.testing import seeded, world

BOUND = 4096
LANDS = [t for t in TRANSPORTS if t != "fallback"]


def _data(n: int, salt: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + salt) % 251).astype(np.uint8)


def _init(transport: str, **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("bound", BOUND)
    kw.setdefault("slots", 4)
    return varcomm.init(transport=transport, timeout=60, array="numpy", **kw)


def _blocks(comm) -> int:  # type: ignore[no-untyped-def]
    return comm._c.landing_stats()[1]


def _drained(comm) -> int:  # type: ignore[no-untyped-def]
    """Blocks still in use once pending landings had 10 s to arrive and be freed."""
    deadline = time.time() + 10
    while _blocks(comm) and time.time() < deadline:
        comm._c.progress()
        time.sleep(0.05)
    return _blocks(comm)


@pytest.mark.parametrize("transport", LANDS)
@world(2, timeout=120)
def test_a_large_message_lands_once_and_is_the_result(transport):
    """The result of a rendezvous receive without out is a view of the block
    its sender wrote (numpy and torch, copy=True and copy=False); the block is
    free again once the result and its views are gone."""
    with _init(transport, landing=8 << 20) as comm:
        n = 256 * BOUND + 3
        if comm.rank == 0:
            for i in range(4):
                comm.send(_data(n, i), 1, tag=i)
            assert comm.recv(1, tag=9)[0] == 1
        else:
            free0 = comm._c.landing_stats()[0]
            a = comm.recv(0, tag=0)
            assert np.array_equal(a, _data(n, 0))
            assert _blocks(comm) == 1, "the result is not in the landing area"
            assert comm._c.landing_stats()[0] < free0
            b = comm.recv(0, tag=1, array="torch")
            assert isinstance(b, torch.Tensor) and np.array_equal(b.numpy(), _data(n, 1))
            c = comm.recv(0, tag=2, copy=False)
            d = comm.irecv(0, tag=3).wait()
            assert np.array_equal(c, _data(n, 2)) and np.array_equal(d, _data(n, 3))
            assert _blocks(comm) == 4
            view = a[10:20]
            del a, b, c, d
            assert _blocks(comm) == 1, "a view keeps its block"
            assert list(view) == list(_data(n, 0)[10:20])
            del view
            assert comm._c.landing_stats() == (free0, 0, 0), "a dropped result did not free its block"
            comm.send(np.array([1]), 0, tag=9)


@pytest.mark.parametrize("transport", LANDS)
@world(2, timeout=120)
def test_comm_empty_is_written_in_place(transport):
    """recv(out=comm.empty(...)) returns out itself (or a prefix of it) with
    the sender's bytes, message after message; an ordinary out still works."""
    with _init(transport, landing=8 << 20) as comm:
        cap = 300 * BOUND
        sizes = [cap, 100 * BOUND + 1, 2 * BOUND, cap]
        if comm.rank == 0:
            for i, n in enumerate(sizes):
                comm.send(_data(n, i), 1, tag=1)
            comm.send(torch.from_numpy(_data(cap, 9)), 1, tag=2)
            assert comm.recv(1, tag=9)[0] == 1
        else:
            out = comm.empty(cap, "uint8")
            assert isinstance(out, np.ndarray) and out.shape == (cap,) and _blocks(comm) == 1
            for i, n in enumerate(sizes):
                got = comm.recv(0, tag=1, out=out)
                assert got.shape == (n,) and np.array_equal(got, _data(n, i))
                assert got.ctypes.data == out.ctypes.data, "not received in place"
            assert _blocks(comm) == 1, "a landing into out left a block behind"
            t = comm.empty((cap // 4, 4), torch.uint8, array="torch")
            assert isinstance(t, torch.Tensor) and t.shape == (cap // 4, 4)
            got = comm.irecv(0, tag=2, out=t.view(-1)).wait()
            assert np.array_equal(got.numpy(), _data(cap, 9))
            del out, got, t
            assert _blocks(comm) == 0
            comm.send(np.array([1]), 0, tag=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_a_full_landing_area_falls_back(transport):
    """Results held by the caller fill the area: later messages take the
    other rendezvous paths, byte-exact, and the area is whole again after."""
    with _init(transport, landing=1 << 20) as comm:
        n = 100 * BOUND
        k = 6  # 6 x 400 KiB > 1 MiB
        if comm.rank == 0:
            for i in range(k):
                comm.send(_data(n, i), 1, tag=i)
            out = comm.empty(2 << 20, "uint8")  # larger than the area: an ordinary array
            assert out.shape == (2 << 20,)
            assert comm.recv(1, tag=9)[0] == 1
        else:
            free0 = comm._c.landing_stats()[0]
            held = [comm.recv(0, tag=i) for i in range(k)]
            for i, h in enumerate(held):
                assert np.array_equal(h, _data(n, i)), f"message {i}"
            if transport != "fallback":
                assert 1 <= _blocks(comm) < k
            del held, h
            assert comm._c.landing_stats() == (free0, 0, 0)
            comm.send(np.array([1]), 0, tag=9)


@pytest.mark.parametrize("transport", LANDS)
@world(2, timeout=120)
def test_a_receive_that_gives_up_frees_its_block_and_the_pair_goes_on(transport):
    """The sender posts a rendezvous send and then computes (no progress):
    the receiver times out with the landing promised; when the sender's write
    comes, the block is freed, and the next message arrives intact."""
    with _init(transport, landing=8 << 20) as comm:
        n = 64 * BOUND
        if comm.rank == 0:
            w = comm.isend(_data(n, 1), 1, tag=1)
            time.sleep(3)  # computing: nothing drives the send
            w.wait()
            comm.send(_data(n, 2), 1, tag=2)
            assert comm.recv(1, tag=9)[0] == 1
        else:
            with pytest.raises(varcomm.TimeoutError):
                comm.recv(0, tag=1, timeout=1)
            got = comm.recv(0, tag=2)
            assert np.array_equal(got, _data(n, 2))
            del got
            assert _drained(comm) == 0, "the abandoned landing kept its block"
            comm.send(np.array([1]), 0, tag=9)


@pytest.mark.parametrize("transport", LANDS)
@world(2, timeout=120)
def test_a_comm_empty_buffer_still_to_be_written_waits_until_it_lands(transport):
    """A receive into a comm.empty buffer times out after the landing was
    promised: a new irecv into that buffer is refused (its bytes may still
    change) and a blocking one waits, within its timeout, for that late write;
    nothing is consumed meanwhile, and once the late message has landed the
    buffer takes the next one."""
    with _init(transport, landing=8 << 20) as comm:
        n = 64 * BOUND
        if comm.rank == 0:
            w = comm.isend(_data(n, 1), 1, tag=1)
            time.sleep(3)  # computing: nothing drives the send
            w.wait()
            comm.send(_data(n, 2), 1, tag=2)
        else:
            buf = comm.empty(n, "uint8")
            with pytest.raises(varcomm.TimeoutError, match="told where to write"):
                comm.recv(0, tag=1, out=buf, timeout=1)
            with pytest.raises(varcomm.InvalidArgument, match="still to be written"):
                comm.irecv(0, tag=2, out=buf)
            with pytest.raises(varcomm.TimeoutError, match="still to be written"):
                comm.recv(0, tag=2, out=buf, timeout=0.3)
            # a view into its middle too (helper-69: taken, then overwritten by the late landing)
            view = buf[8192:8192 + 1000]
            with pytest.raises(varcomm.InvalidArgument, match="still to be written"):
                comm.irecv(0, tag=2, out=view)
            with pytest.raises(varcomm.TimeoutError, match="still to be written"):
                comm.recv(0, tag=2, out=view, timeout=0.3)
            got = comm.recv(0, tag=2, out=buf, timeout=20)  # waits for the late landing, then takes tag 2
            assert np.array_equal(got, _data(n, 2))


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=240)
def test_random_landings_byte_exact(transport):
    """Random sizes around eager_max and the bound, every receive form
    (comm.empty out, ordinary out, new array, copy=False, irecv, dropped
    irecv), interleaved with small messages."""
    rng = random.Random(seeded())
    with _init(transport, landing=2 << 20, eager_max=16 << 10, bound=64 << 10, slots=3) as comm:
        cap = 1 << 20
        plan = [(rng.choice([1, 1000, 16 << 10, (16 << 10) + 1, 100_000, 64 << 10, (64 << 10) + 7, 700_000, cap]),
                 rng.randrange(6)) for _ in range(80)]
        if comm.rank == 0:
            for i, (n, _) in enumerate(plan):
                comm.send(_data(n, i), 1, tag=1)
                comm.send(np.array([i]), 1, tag=2)
            assert comm.recv(1, tag=9)[0] == 1
        else:
            empty = comm.empty(cap, "uint8")
            plain = np.zeros(cap, np.uint8)
            held = []
            for i, (n, form) in enumerate(plan):
                want = _data(n, i)
                if form == 0:
                    got = comm.recv(0, tag=1, out=empty)
                elif form == 1:
                    got = comm.recv(0, tag=1, out=plain)
                elif form == 2:
                    got = comm.recv(0, tag=1)
                    held = (held + [(i, got)])[-3:]
                elif form == 3:
                    got = comm.recv(0, tag=1, copy=False)
                elif form == 4:
                    got = comm.irecv(0, tag=1).wait()
                else:
                    comm.irecv(0, tag=1)  # dropped: the message is taken and freed
                    got = want
                assert np.array_equal(got, want), f"message {i} ({n} bytes, form {form})"
                assert comm.recv(0, tag=2)[0] == i
            # Later landings must not have reused a block still held.
            overwritten = [i for i, h in held if not np.array_equal(h, _data(plan[i][0], i))]
            assert held and not overwritten, f"held results overwritten: {overwritten}"
            del held, got, empty
            assert _drained(comm) == 0, "blocks leaked"
            comm.send(np.array([1]), 0, tag=9)


@pytest.mark.parametrize("form", ["out", "new"])
@world(3, timeout=120)
def test_queued_send_moves_while_its_sender_keeps_receiving(form):
    """Rank 1 has a 4 MiB send queued to rank 0 (its data copied by rank 1
    itself: streamed through the ring, CMA off, or written into rank 0's
    landing area) while it makes 1500 blocking receives from rank 2 that always
    find their message there. Those receives must move the queued send too:
    rank 0 gets it, and tells rank 2, long before rank 2's stream ends (it
    came only after the last receive, when a receive that matched at once
    returned without driving sends)."""
    n, count = 4 << 20, 1500
    comm = varcomm.init(transport="shm", bound=1 << 20, slots=8, timeout=60, cma="off")
    r = comm.rank
    with comm:
        comm.barrier()
        if r == 0:
            msg = comm.recv(1, tag=1, out=np.empty(n, np.uint8) if form == "out" else None, array="numpy")
            assert np.array_equal(np.asarray(msg), _data(n, 5))
            comm.send(np.zeros(1, np.uint8), 2, tag=3)  # "got it"
        elif r == 1:
            w = comm.isend(_data(n, 5), 0, tag=1)
            buf = np.empty(16, np.uint8)
            for _ in range(count):
                comm.recv(2, tag=2, out=buf)
                time.sleep(0.0002)  # work per message: rank 2 stays ahead
            w.wait(30)
        else:
            got = comm.irecv(0, tag=3)
            sent = 0
            while sent < count:
                comm.send(np.zeros(16, np.uint8), 1, tag=2)
                sent += 1
                if got.is_completed():
                    break
            told_after = sent
            for _ in range(count - sent):
                comm.send(np.zeros(16, np.uint8), 1, tag=2)
            got.wait(30)
            # (~150 here with the fix, all 1500 without: a margin for a loaded machine,
            # where 1270 was seen with three other jobs on the 2 cores)
            assert told_after < count * 9 // 10, f"rank 0 had rank 1's message only after {told_after} of {count}"
        comm.barrier()


@world(3, timeout=120, expect_exit={1: None})
def test_a_dead_senders_landing_frees_the_comm_empty_buffer():
    """The sender of a message promised a landing into a comm.empty buffer
    dies before writing it: the receive fails (PeerFailure), and the buffer
    takes the next message from a live peer at once (it stayed marked as still
    to be written, so that receive timed out, and its block was never freed)."""
    import os
    import signal

    with varcomm.init(transport="shm", timeout=30, array="numpy", peer_timeout=2) as comm:
        n = 1 << 20
        if comm.rank == 1:
            comm.isend(_data(n, 1), 0)
            time.sleep(1.0)  # computing: nothing writes the landing rank 0 asks for
            os.kill(os.getpid(), signal.SIGKILL)
        elif comm.rank == 2:
            assert comm.recv(0, tag=7)[0] == 1
            comm.send(_data(n, 2), 0)
        else:
            buf = comm.empty(n, "uint8")
            # (not "0 of n bytes had arrived": the sender writes the output itself, helper-69)
            with pytest.raises(varcomm.PeerFailure, match="straight into the output: any part of it may have been"):
                comm.recv(1, out=buf)
            comm.send(np.array([1], np.uint8), 2, tag=7)
            got = comm.recv(2, out=buf, timeout=10)
            assert got.ctypes.data == buf.ctypes.data and np.array_equal(got, _data(n, 2))
            del got, buf
            assert _drained(comm) == 0, "the dead sender's landing kept its block"


@world(2, timeout=120, expect_exit={1: None})
def test_a_failed_chunk_read_keeps_the_output_block_once():
    """A collective's chunk sender posts its chunk and then neither writes it
    into the receiver's comm.empty output (kRawCredit) nor keeps it readable
    (its memory is unmapped): the receiver revokes, its own CMA read fails,
    and the call fails. The output's block was released twice (the read's
    failure, then the pair's), so a new comm.empty came back at the same
    address as the live output, and writes into one changed the other."""
    import ctypes
    import mmap
    import os

    with varcomm.init(transport="shm", timeout=20, array="numpy", cma="on") as comm:
        n = 1 << 16  # 256 KiB chunks of float32: held rendezvous, pushed
        x = np.full(2 * n, comm.rank + 1, dtype=np.float32)
        comm.all_to_all_v(x, [n, n], out=np.empty(2 * n, np.float32))  # warm: the next call is quick
        if comm.rank == 1:
            m = mmap.mmap(-1, x.nbytes)
            src = np.frombuffer(m, np.float32)
            src[:] = 2
            _work = comm.all_to_all_v(src, [n, n], out=np.empty(2 * n, np.float32), async_op=True)  # posted
            libc = ctypes.CDLL(None, use_errno=True)
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            assert libc.munmap(src.ctypes.data, x.nbytes) == 0  # no read of it can succeed now
            comm.send(np.zeros(1, np.float32), 0)
            time.sleep(5)  # computing: nothing writes the chunk
            os._exit(0)
        buf = comm.empty(2 * n, "float32")
        comm.recv(1)
        with pytest.raises(varcomm.PeerFailure,
                           match=r"peer failure: rank 1: its message of \d+ bytes could not be copied"):
            comm.all_to_all_v(x, [n, n], out=buf)
        other = comm.empty(2 * n, "float32")
        assert other.ctypes.data != buf.ctypes.data
        buf[:] = 7
        other[:] = 9
        assert buf[0] == 7
        assert comm._c.landing_stats()[2] >= 2 * x.nbytes, comm._c.landing_stats()  # both still lent


@world(1, timeout=60)
def test_comm_empty_of_a_numpy_dtype_is_a_numpy_array():
    """Under array="auto" the dtype says the kind: np.int8 or np.dtype("f4")
    make numpy arrays (they made torch tensors), torch.int8 a tensor, and a
    dtype name the default kind."""
    with varcomm.init(array="auto") as comm:
        assert isinstance(comm.empty(3, np.int8), np.ndarray)
        assert isinstance(comm.empty((2, 2), np.dtype("f4")), np.ndarray)
        assert isinstance(comm.empty(3, torch.int8), torch.Tensor)
        assert isinstance(comm.empty(3, "float32"), torch.Tensor)  # torch is installed: the default kind
        assert isinstance(comm.empty(3, np.int8, array="torch"), torch.Tensor)  # array= still decides


@world(1, timeout=60)
def test_comm_empty_takes_numpy_ints_and_names_bad_shapes():
    """A numpy integer shape was a TypeError ('numpy.int64' object is not
    iterable) and a shape past 2**63 bytes a raw pybind11 argument error
    (helper-69): numpy ints are ints, and both bad shapes InvalidArgument."""
    with varcomm.init(array="numpy") as comm:
        assert comm.empty(np.int64(5)).shape == (5,)
        assert comm.empty([2, np.int32(3)], "uint8").shape == (2, 3)
        with pytest.raises(varcomm.InvalidArgument, match="more than 2\\*\\*63 bytes"):
            comm.empty((2**32, 2**32))
        for bad in ("abc", 2.5, [1.5]):
            with pytest.raises(varcomm.InvalidArgument, match="shape must be an int or a sequence of ints"):
                comm.empty(bad)
