"""Point-to-point semantics, run on every transport this build has and on the fallback."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS, dtype_cases, make_tensor, same_bytes
from varcomm.testing import seeded, world

BOUND = 64 * 1024


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_every_dtype_and_shape(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
        cases = dtype_cases(BOUND)
        if comm.rank == 0:
            for i, (dt, shape) in enumerate(cases):
                comm.send(make_tensor(dt, shape, seed=i), dst=1, tag=i % 3)
        else:
            for i, (dt, shape) in enumerate(cases):
                got = comm.recv(src=0, tag=i % 3)
                want = make_tensor(dt, shape, seed=i)
                assert got.dtype == dt, (i, got.dtype, dt)
                assert tuple(got.shape) == tuple(shape), (i, got.shape, shape)
                assert same_bytes(got, want), f"case {i}: {dt} {shape} payload differs"


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_numpy_in_numpy_out_and_prefix_views(transport):
    with varcomm.init(transport=transport, bound=BOUND, array="numpy", timeout=30) as comm:
        if comm.rank == 0:
            comm.send(np.arange(12, dtype=np.int32).reshape(3, 4), dst=1)
            comm.send(np.arange(5, dtype=np.float64), dst=1)
            comm.send(torch.arange(6, dtype=torch.int16).reshape(2, 3), dst=1)
            comm.send(np.array(7.5, dtype=np.float32), dst=1)  # 0-d
        else:
            a = comm.recv(src=0)
            assert isinstance(a, np.ndarray) and a.shape == (3, 4) and a.dtype == np.int32
            assert (a == np.arange(12).reshape(3, 4)).all()
            buf = np.full(100, -1.0)
            b = comm.recv(src=0, out=buf)
            assert b.shape == (5,) and np.shares_memory(b, buf) and (b == np.arange(5)).all()
            assert buf[5] == -1.0, "recv wrote past the message"
            tbuf = torch.zeros(64, dtype=torch.int16)
            c = comm.recv(src=0, out=tbuf)
            assert isinstance(c, torch.Tensor) and c.shape == (2, 3) and c.data_ptr() == tbuf.data_ptr()
            assert c.tolist() == [[0, 1, 2], [3, 4, 5]]
            d = comm.recv(src=0)
            assert d.shape == () and d.dtype == np.float32 and float(d) == 7.5


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_order_per_tag_and_tags_do_not_block(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=8, timeout=30) as comm:
        if comm.rank == 0:
            for i in range(3):
                comm.send(torch.tensor([1, i]), dst=1, tag=1)
                comm.send(torch.tensor([2, i]), dst=1, tag=2)
            comm.send(torch.tensor([9]), dst=1, tag=3)
        else:
            # Tag 3 was sent last but is received first: tags 1 and 2 wait in slots.
            assert comm.recv(src=0, tag=3).tolist() == [9]
            assert [comm.recv(src=0, tag=2).tolist() for _ in range(3)] == [[2, 0], [2, 1], [2, 2]]
            assert [comm.recv(src=0, tag=1).tolist() for _ in range(3)] == [[1, 0], [1, 1], [1, 2]]


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(4, timeout=90)
def test_batch_ring_and_all_pairs(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        nxt, prv = (r + 1) % n, (r - 1) % n
        for step in range(5):
            ops = [varcomm.P2POp(comm.irecv, None, prv, tag=step),
                   varcomm.P2POp(comm.isend, torch.full((r + step + 1,), float(r)), nxt, tag=step)]
            works = comm.batch_isend_irecv(ops)
            got = works[0].wait()
            works[1].wait()
            assert got.tolist() == [float(prv)] * (prv + step + 1)
        # all-pairs, waited on in reverse order of posting
        sends = [comm.isend(torch.tensor([r * 10 + d]), dst=d, tag=7) for d in range(n)]
        recvs = [comm.irecv(src=s, tag=7) for s in range(n)]
        for s in reversed(range(n)):
            assert recvs[s].wait().tolist() == [s * 10 + r]
        for w in sends:
            w.wait()
            assert w.is_completed()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_both_sides_isend_a_window_then_recv(transport):
    """bibw's pattern: a window of isends, then blocking recvs. Sends queued
    for want of a credit must move while their sender is blocked in recv (the
    credit may arrive then, and the peer waits for them)."""
    with varcomm.init(transport=transport, bound=BOUND, slots=8, timeout=30) as comm:
        peer = 1 - comm.rank
        src = torch.arange(256, dtype=torch.float32) + comm.rank
        out = torch.empty(BOUND // 4, dtype=torch.float32)
        for it in range(60):
            works = [comm.isend(src[:16 + i], peer, tag=0) for i in range(8)]
            for i in range(8):
                got = comm.recv(peer, out=out)
                assert torch.equal(got, torch.arange(16 + i, dtype=torch.float32) + peer), (it, i)
            for w in works:
                w.wait()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(4, timeout=240)
def test_randomized_stress(transport):
    """>= 20,000 messages per transport (the fallback included) of random size,
    shape, dtype and tag between random pairs, every payload checked exactly."""
    seed = seeded(int(os.environ.get("VARCOMM_TEST_SEED", "0")) or None)
    per_pair = 1700  # 12 pairs -> 20,400 messages
    dts = [torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.bool, torch.float16]
    with varcomm.init(transport=transport, bound=BOUND, slots=8, timeout=60) as comm:
        r, n = comm.rank, comm.world_size

        def plan(s: int, d: int) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
            g = np.random.default_rng([seed, s, d])
            out = []
            for _ in range(per_pair):
                dt = dts[int(g.integers(len(dts)))]
                isz = torch.empty((), dtype=dt).element_size()
                numel = int(g.integers(0, BOUND // isz + 1)) if g.random() < 0.05 else int(g.integers(0, 512))
                shape = (numel,) if g.random() < 0.5 or numel == 0 else (1, numel)
                out.append((int(g.integers(3)), dt, shape))
            return out

        outgoing = {d: plan(r, d) for d in range(n) if d != r}
        incoming = {s: plan(s, r) for s in range(n) if s != r}
        window = 16
        for start in range(0, per_pair, window):
            ops = []
            for s, msgs in incoming.items():
                for i in range(start, min(start + window, per_pair)):
                    ops.append(varcomm.P2POp(comm.irecv, None, s, tag=msgs[i][0]))
            srcs = []
            for d, msgs in outgoing.items():
                for i in range(start, min(start + window, per_pair)):
                    tag, dt, shape = msgs[i]
                    t = make_tensor(dt, shape, seed=hash((seed, r, d, i)) & 0xFFFF)
                    srcs.append(t)
                    ops.append(varcomm.P2POp(comm.isend, t, d, tag=tag))
            works = comm.batch_isend_irecv(ops)
            k = 0
            for s, msgs in incoming.items():
                for i in range(start, min(start + window, per_pair)):
                    tag, dt, shape = msgs[i]
                    got = works[k].wait()
                    k += 1
                    want = make_tensor(dt, shape, seed=hash((seed, s, r, i)) & 0xFFFF)
                    assert got.dtype == dt and tuple(got.shape) == shape, (s, i, got.dtype, got.shape)
                    assert same_bytes(got, want), f"seed {seed}: message {i} from {s} corrupted"
            for w in works[k:]:
                w.wait()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_errors_leave_the_channel_usable(transport):
    with varcomm.init(transport=transport, bound=1024, slots=4, max_message=4096, timeout=30) as comm:
        if comm.rank == 0:
            with pytest.raises(varcomm.MessageTooLarge, match="max_message"):
                comm.send(torch.zeros(4097, dtype=torch.uint8), dst=1)  # refused before anything is written
            with pytest.raises(varcomm.InvalidArgument, match="out of range"):
                comm.send(torch.zeros(1), dst=5)
            with pytest.raises(varcomm.InvalidArgument):
                comm.send(torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8), dst=1)
            comm.send(torch.arange(8, dtype=torch.int64).reshape(2, 4).t(), dst=1)  # non-contiguous: copied
            comm.send(torch.arange(100, dtype=torch.float32), dst=1, tag=1)
            comm.send(torch.arange(4, dtype=torch.float32), dst=1, tag=2)
            comm.barrier()  # rank 1's timed-out recv happens here
            comm.send(torch.tensor([42]), dst=1, tag=5)
        else:
            nc = comm.recv(src=0)
            assert nc.tolist() == torch.arange(8).reshape(2, 4).t().tolist()
            small = torch.zeros(10, dtype=torch.float32)
            with pytest.raises(varcomm.MessageTooLarge, match="kept"):
                comm.recv(src=0, tag=1, out=small)
            with pytest.raises(varcomm.MessageMismatch):
                comm.recv(src=0, tag=1, out=torch.zeros(200, dtype=torch.int32))
            # Not lost: the next recv gets it.
            assert comm.recv(src=0, tag=1).tolist() == list(range(100))
            assert comm.recv(src=0, tag=2, out=torch.zeros(10)).tolist() == [0.0, 1.0, 2.0, 3.0]
            t0 = time.monotonic()
            with pytest.raises(varcomm.TimeoutError, match="rank 0"):
                comm.recv(src=0, tag=5, timeout=0.3)
            assert time.monotonic() - t0 < 5
            comm.barrier()
            assert comm.recv(src=0, tag=5, timeout=30).tolist() == [42]


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_self_send_and_isend_timeout(transport):
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30) as comm:
        r = comm.rank
        comm.send(torch.tensor([r, 1]), dst=r, tag=4)
        assert comm.recv(src=r, tag=4).tolist() == [r, 1]
        if r == 0:
            # Rank 1 never receives: two slots fill, the third send times out
            # without writing anything, and the channel still works afterwards.
            comm.send(torch.tensor([1]), dst=1, tag=9)
            comm.send(torch.tensor([2]), dst=1, tag=9)
            with pytest.raises(varcomm.TimeoutError, match="slot"):
                comm.send(torch.tensor([3]), dst=1, tag=9, timeout=0.3)
        comm.barrier()
        if r == 1:
            assert [comm.recv(src=0, tag=9).item() for _ in range(2)] == [1, 2]
            with pytest.raises(varcomm.TimeoutError):
                comm.recv(src=0, tag=9, timeout=0.3)  # the timed-out send left nothing behind
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(3, timeout=60, expect_exit={2: None})
def test_dead_peer_fails_promptly_and_others_keep_working(transport):
    comm = varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=60)
    r = comm.rank
    # Everyone's init is over before rank 2 dies: a rank dying during another's
    # set-up fails that set-up instead (the fallback's gloo mesh was still connecting).
    comm.barrier()
    if r == 2:
        for i in range(5):
            comm.send(torch.tensor([i]), dst=0)
        os._exit(3)  # dies mid-stream, without closing
    if r == 0:
        got = [comm.recv(src=2).item() for _ in range(5)]
        assert got == list(range(5))
        t0 = time.monotonic()
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            comm.recv(src=2)
        assert time.monotonic() - t0 < 10, "dead peer took too long to detect"
        with pytest.raises(varcomm.PeerFailure):
            comm.recv(src=2)  # later operations fail at once
    # The survivors' channel still works.
    other = 1 - r
    comm.send(torch.tensor([r]), dst=other)
    assert comm.recv(src=other).item() == other


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60, expect_exit={1: None})
def test_a_send_to_a_peer_dead_for_a_second_fails_though_a_slot_is_free(transport):
    """Rank 1 dies with every slot of its ring from rank 0 free: rank 0's
    small sends, 1.5 s later, each found a free slot and returned success (up
    to `slots` of them; the peer was looked at every 64 sends) while a recv
    from it failed at once. The first one raises PeerFailure now."""
    comm = varcomm.init(transport=transport, bound=BOUND, slots=8, timeout=30)
    comm.barrier()
    if comm.rank == 1:
        os._exit(3)
    time.sleep(1.5)
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        comm.send(torch.tensor([1]), dst=1)
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        comm.isend(torch.tensor([2]), dst=1).wait()


@world(2, timeout=60, expect_exit={1: None})
def test_no_shared_memory_leftovers_even_after_a_crash():
    before = set(os.listdir("/dev/shm"))
    comm = varcomm.init(transport="shm", bound=BOUND, slots=2, timeout=30)
    # The regions are anonymous memfds: nothing is ever named in /dev/shm, and
    # the fds that let peers map them are closed once everyone has.
    assert set(os.listdir("/dev/shm")) - before == set()
    fds = []
    for f in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{f}"))
        except FileNotFoundError:  # the fd listdir itself used
            pass
    assert not [f for f in fds if "memfd:varcomm" in f], fds
    if comm.rank == 1:
        os.kill(os.getpid(), 9)
    with pytest.raises(varcomm.PeerFailure):
        comm.recv(src=1, timeout=20)
    assert set(os.listdir("/dev/shm")) - before == set()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_descriptor_messages(transport):
    """A descriptor describes data sent separately (it may exceed the bound):
    a recv returns its Status; a recv into out= refuses it and keeps it."""
    from varcomm import dtypes

    f64 = dtypes.word(dtypes.FLOAT, 64)
    with varcomm.init(transport=transport, bound=BOUND, timeout=30) as comm:
        if comm.rank == 0:
            comm.isend_descriptor(1, 10 * BOUND, f64, (BOUND // 8, 10), tag=3).wait()
            comm.isend_descriptor(1, 24, f64, (3,), tag=3).wait()
            comm.send(torch.arange(3.0, dtype=torch.float64), dst=1, tag=3)
        else:
            st = comm.recv(src=0, tag=3)
            assert isinstance(st, varcomm.Status) and st.descriptor and not st.device
            assert (st.nbytes, st.dtype, st.shape) == (10 * BOUND, f64, (BOUND // 8, 10))
            out = torch.zeros(3, dtype=torch.float64)
            with pytest.raises(varcomm.MessageMismatch, match="descriptor.*kept"):
                comm.recv(src=0, tag=3, out=out)
            st = comm.recv(src=0, tag=3)  # kept: the next recv gets it
            assert st.descriptor and st.nbytes == 24
            assert comm.recv(src=0, tag=3, out=out).tolist() == [0.0, 1.0, 2.0]


@world(2, timeout=60)
def test_blocking_recv_drives_queued_sends_after_a_descriptor():
    """A blocking recv keeps this rank's queued isends moving (the peer may
    wait for them before it answers). The engine counts queued sends to know
    when to: a descriptor send that was never counted used to drive that count
    below zero, so that after it the next queued isend was not moved and both
    ranks hung."""
    from varcomm import dtypes

    f64 = dtypes.word(dtypes.FLOAT, 64)
    with varcomm.init(transport="shm", bound=BOUND, slots=1, timeout=10) as comm:
        if comm.rank == 0:
            comm.isend_descriptor(1, 24, f64, (3,), tag=9).wait()
            comm.recv(src=1, tag=8)  # rank 1's slot for us is free again
            a = comm.isend(np.full(4, 1.0), dst=1, tag=1)
            b = comm.isend(np.full(4, 2.0), dst=1, tag=2)  # queued: rank 1's one slot holds a
            got = comm.recv(src=1, tag=3, out=np.zeros(1))  # rank 1 answers only once it has b
            a.wait()
            b.wait()
            assert got.tolist() == [3.0]
        else:
            assert comm.recv(src=0, tag=9).descriptor
            comm.send(np.zeros(1), dst=0, tag=8)
            assert comm.recv(src=0, tag=1).tolist() == [1.0] * 4
            assert comm.recv(src=0, tag=2).tolist() == [2.0] * 4
            comm.send(np.full(1, 3.0), dst=0, tag=3)


@pytest.mark.parametrize("field", ["ndim", "nbytes", "seq"])
@world(2, timeout=60)
def test_malformed_header_fails_the_peer(field):
    """A peer writes our region, so what its headers say is checked before it
    is used: one that would make a recv read past its slot (nbytes over the
    bound), build a shape of more than 8 dims, or name another message (seq)
    fails the peer with PeerFailure instead. The lie is written into rank 0's
    own slot here (a slot loan gives its address), as a buggy or hostile
    rank 1 mapping it would."""
    import ctypes

    bound = 4096
    slot_bytes = 256 + bound  # csrc/protocol.h Layout::slot_bytes: slot control + header + payload
    with varcomm.init(transport="shm", bound=bound, slots=4, array="numpy", timeout=10) as comm:
        if comm.rank == 1:
            for tag in (1, 2, 3):
                comm.send(np.full(4, float(tag)), dst=0, tag=tag)
            return  # its messages stay in rank 0's slots
        comm.recv(src=1, tag=3)  # writes land in order: tags 1 and 2 are in slots 0 and 1 by now
        loan = comm.recv(src=1, tag=1, copy=False)
        hdr = loan.ctypes.data + slot_bytes - 128  # slot 1's MsgHeader
        off, value = {"seq": (0, 99), "nbytes": (8, 3 * bound), "ndim": (28, 1000)}[field]
        ctypes.c_uint64.from_address(hdr + off).value = value if field != "ndim" else (
            ctypes.c_uint64.from_address(hdr + off).value & ~0xFFFFFFFF | value)
        with pytest.raises(varcomm.PeerFailure, match="malformed message header"):
            comm.recv(src=1, tag=2)
        with pytest.raises(varcomm.PeerFailure, match="malformed message header"):
            comm.recv(src=1, tag=2, out=np.zeros(4))
        del loan


@world(1)
def test_point_to_point_tags_stay_out_of_the_collective_space():
    """Tags from 2**40 up belong to collectives: a user message there could be
    matched by a collective's receive (or take one's message)."""
    with varcomm.init(timeout=10, array="numpy") as comm:
        for call in (lambda: comm.send(np.zeros(2), dst=0, tag=1 << 40),
                     lambda: comm.send(torch.zeros(2), dst=0, tag=A2A_TAG),
                     lambda: comm.isend(torch.zeros(2), dst=0, tag=A2A_TAG),
                     lambda: comm.irecv(src=0, tag=A2A_TAG),
                     lambda: comm.recv(src=0, tag=A2A_TAG, out=np.zeros(2))):
            with pytest.raises(varcomm.InvalidArgument, match="reserved for collectives"):
                call()
        comm.send(np.ones(2), dst=0, tag=(1 << 40) - 1)  # the largest user tag still works
        assert comm.recv(src=0, tag=(1 << 40) - 1).tolist() == [1.0, 1.0]


A2A_TAG = 1 << 41


@world(2, timeout=60)
def test_batch_exact_without_a_tensor_or_on_an_isend_is_refused():
    """P2POp(comm.irecv, None, src, exact=True) was taken (exact checks the
    message against a tensor there is none of; recv(exact=True) without out
    refuses), and exact=True on an isend was ignored. Both are refused before
    anything is posted."""
    with varcomm.init(timeout=20) as comm:
        peer = 1 - comm.rank
        with pytest.raises(varcomm.InvalidArgument, match=r"ops\[1\]: exact=True checks the message"):
            comm.batch_isend_irecv([varcomm.P2POp(comm.isend, torch.ones(2), peer),
                                    varcomm.P2POp(comm.irecv, None, peer, exact=True)])
        with pytest.raises(varcomm.InvalidArgument, match=r"ops\[0\]: exact=True is for an irecv"):
            comm.batch_isend_irecv([varcomm.P2POp(comm.isend, torch.ones(2), peer, exact=True)])
        out = torch.zeros(2)
        for w in comm.batch_isend_irecv([varcomm.P2POp(comm.isend, torch.full((2,), float(comm.rank)), peer),
                                         varcomm.P2POp(comm.irecv, out, peer, exact=True)]):
            w.wait()
        assert out.tolist() == [float(peer)] * 2  # nothing was posted by the refused batches


@world(2, timeout=60)
def test_copy_false_with_out_is_refused_and_the_message_kept():
    """copy=False (lend the slot) and out= (land in out) ask for two things;
    out= won silently, so a caller expecting a loan held out's memory instead.
    Refused before anything is taken: the next recv gets the message."""
    with varcomm.init(timeout=10) as comm:
        if comm.rank == 1:
            comm.send(torch.arange(4.0), dst=0)
        else:
            out = torch.zeros(8)
            for call in (lambda: comm.recv(src=1, out=out, copy=False),
                         lambda: comm.recv(src=1, out=out.numpy(), copy=False),
                         lambda: comm.irecv(src=1, out=out, copy=False)):
                with pytest.raises(varcomm.InvalidArgument, match="copy=False lends the receive slot"):
                    call()
            assert torch.equal(out, torch.zeros(8))
            assert torch.equal(comm.recv(src=1, out=out), torch.arange(4.0))
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=90)
def test_memoryless_and_huge_empty_tensors(transport):
    # torch's efficient zero tensor (autograd's zero gradients) has data_ptr 0
    # and nbytes > 0: sends read address 0 (SIGSEGV), a receive into one wrote
    # there. An empty tensor whose leading dims overflow when multiplied first
    # ((2**62, 0)) was refused by the receiver as a malformed header, failing
    # the pair for good.
    with varcomm.init(transport=transport, bound=BOUND, timeout=30) as comm:
        z = torch._efficientzerotensor(5)
        assert z.data_ptr() == 0 and z.nbytes == 20
        zv = torch._efficientzerotensor(6)[1:]  # a view: data_ptr 4, still no memory
        assert zv.data_ptr() == 4 and zv._is_zerotensor()
        if comm.rank == 0:
            comm.send(z, 1, tag=1)
            comm.isend(zv, 1, tag=2).wait()
            comm.send(torch.empty((2**62, 0)), 1, tag=3)
            comm.send(np.empty((2**40, 0), np.float32), 1, tag=4)
            comm.send(torch.arange(3), 1, tag=5)
            nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
            with pytest.raises(varcomm.InvalidArgument, match="nested tensor"):
                comm.send(nested, 1)
        else:
            for tag in (1, 2):
                got = comm.recv(0, tag=tag)
                assert not got._is_zerotensor() and torch.equal(got, torch.zeros(5)), (tag, got)
            for out in (torch._efficientzerotensor(4), torch._efficientzerotensor(5)[1:]):
                with pytest.raises(varcomm.InvalidArgument, match="out is a zero tensor"):
                    comm.recv(0, tag=3, out=out)
            assert tuple(comm.recv(0, tag=3).shape) == (2**62, 0)
            assert tuple(comm.recv(0, tag=4).shape) == (2**40, 0)
            assert torch.equal(comm.recv(0, tag=5), torch.arange(3))
        # An all-to-all of a zero tensor (or a view of one) sends its zeros; one as an output is refused.
        for x0 in (torch._efficientzerotensor(4), torch._efficientzerotensor(5)[1:]):
            x = x0 if comm.rank == 0 else torch.full((4,), 7.0)
            y, splits = comm.all_to_all_v(x, [2, 2])
            assert splits == [2, 2] and torch.equal(y, torch.tensor([0.0, 0.0, 7.0, 7.0])), y
        for form in ("v", "single", "list"):
            with pytest.raises(varcomm.VarcommError, match="zero tensor|refused"):
                if form == "v":
                    comm.all_to_all_v(torch.ones(4), [2, 2], out=torch._efficientzerotensor(4))
                elif form == "single":
                    comm.all_to_all_single(torch._efficientzerotensor(4), torch.ones(4))
                else:
                    comm.all_to_all([torch._efficientzerotensor(2)] * 2, [torch.ones(2)] * 2)
        with pytest.raises(varcomm.VarcommError, match="nested tensor|refused"):
            comm.all_to_all_v(torch.nested.nested_tensor([torch.ones(2), torch.ones(2)]), [1, 1])
        # Rows too wide to describe (only an empty x has them): refused on every rank, the next call pairs up.
        with pytest.raises(varcomm.InvalidArgument, match="more than a message can describe|refused"):
            comm.all_to_all_v(torch.empty((0, 2**62)), [0, 0])
        y, _ = comm.all_to_all_v(torch.full((2,), float(comm.rank)), [1, 1])
        assert y.tolist() == [0.0, 1.0]
