"""Issue 11: large messages. Over the receiver's bound a host message goes by
rendezvous (protocol.h kRendezvous): the receiver copies it once straight out
of the sender's memory where the pair can (shm with CMA), else its data
streams through the slots in bound-sized chunks (rdma, fallback, shm without
CMA). On shm a message over eager_max takes the single copy too. Each test
runs on every transport."""
from __future__ import annotations

import os
import platform
import random
import time

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS
from varcomm.testing import seeded, world

BOUND = 4096


def _data(n: int, salt: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)


def _init(transport: str, **kw):  # type: ignore[no-untyped-def]
    return varcomm.init(transport=transport, timeout=60, **kw)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_over_bound_messages_arrive_every_way(transport):
    """Messages of up to 40x the bound: recv with out=, without (a new array,
    torch and numpy), copy=False, irecv, isend, interleaved with small ones."""
    with _init(transport, bound=BOUND, slots=4) as comm:
        r = comm.rank
        sizes = [BOUND + 1, 3 * BOUND, 40 * BOUND + 5]
        if r == 0:
            for i, n in enumerate(sizes):
                x = _data(n, i)
                comm.send(x, 1, tag=1)
                comm.send(x.view(1, n), 1, tag=2)
                comm.send(x.numpy(), 1, tag=3)
                comm.send(x, 1, tag=4)
                w = comm.isend(x, 1, tag=5)
                comm.send(torch.tensor([i]), 1, tag=6)  # a small one behind the large isend
                w.wait()
            assert comm.recv(1, tag=9).item() == 1
        else:
            for i, n in enumerate(sizes):
                want = _data(n, i)
                out = torch.zeros(50 * BOUND, dtype=torch.uint8)
                got = comm.recv(0, tag=1, out=out)
                assert got.shape == (n,) and torch.equal(got, want)
                got = comm.recv(0, tag=2)
                assert isinstance(got, torch.Tensor) and got.shape == (1, n) and torch.equal(got[0], want)
                got = comm.recv(0, tag=3)
                assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())
                got = comm.recv(0, tag=4, copy=False)  # no slot to lend: copied out once
                assert torch.equal(torch.as_tensor(got), want)
                h = comm.irecv(0, tag=5, out=torch.zeros(n, dtype=torch.uint8))
                assert comm.recv(0, tag=6).item() == i
                assert torch.equal(h.wait(), want)
            comm.send(torch.tensor([1]), 0, tag=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_too_small_out_keeps_the_large_message(transport):
    with _init(transport, bound=BOUND, slots=4) as comm:
        n = 10 * BOUND
        if comm.rank == 0:
            comm.isend(_data(n, 3), 1).wait()
            assert comm.recv(1, tag=9).item() == 1
        else:
            with pytest.raises(varcomm.MessageTooLarge, match="kept"):
                comm.recv(0, out=torch.zeros(n - 1, dtype=torch.uint8))
            with pytest.raises(varcomm.MessageTooLarge, match="kept"):
                comm.irecv(0, out=torch.zeros(BOUND, dtype=torch.uint8)).wait()
            with pytest.raises(varcomm.MessageMismatch):
                comm.recv(0, out=torch.zeros(n, dtype=torch.float32))
            assert torch.equal(comm.recv(0), _data(n, 3))
            comm.send(torch.tensor([1]), 0, tag=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=180)
def test_random_sizes_across_the_thresholds_byte_exact(transport):
    """Sizes on both sides of eager_max and of the bound, every receive form,
    isends in flight together; every byte checked."""
    seed = seeded()
    rng = random.Random(seed)
    bound, eager = 8192, 2048
    sizes = [rng.choice([rng.randint(0, eager), rng.randint(eager, bound + 1), rng.randint(bound, 9 * bound)])
             for _ in range(120)]
    with _init(transport, bound=bound, eager_max=eager, slots=3) as comm:
        if comm.rank == 0:
            works = []
            for i, n in enumerate(sizes):
                works.append(comm.isend(_data(n, i), 1, tag=i % 3))
                if len(works) > 4:
                    works.pop(0).wait()
            for w in works:
                w.wait()
            assert comm.recv(1, tag=99).item() == len(sizes)
        else:
            out = torch.zeros(9 * bound, dtype=torch.uint8)
            ok = 0
            for i, n in enumerate(sizes):
                how = (i * 5 + seed) % 4
                if how == 0:
                    got = comm.recv(0, tag=i % 3, out=out).clone()
                elif how == 1:
                    got = comm.recv(0, tag=i % 3)
                elif how == 2:
                    got = torch.as_tensor(comm.recv(0, tag=i % 3, copy=False)).clone()
                else:
                    got = comm.irecv(0, tag=i % 3, out=out).wait().clone()
                assert got.numel() == n and torch.equal(got, _data(n, i)), (i, n, how)
                ok += 1
            comm.send(torch.tensor([ok]), 0, tag=99)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_timeout_mid_message_leaves_the_pair_usable(transport):
    """A receive waits with a short timeout while the sender is held (it has
    written the head, and on a streaming pair a first chunk): the receive
    times out, and the pair goes on with the next messages."""
    with _init(transport, bound=BOUND, slots=2) as comm:
        n = 20 * BOUND
        if comm.rank == 0:
            w = comm.isend(_data(n, 1), 1)
            comm.recv(1, tag=8)  # rank 1 has timed out: now let the rest flow
            w.wait()
            comm.send(_data(n, 2), 1)
            comm.send(torch.tensor([5]), 1, tag=3)
            assert comm.recv(1, tag=9).item() == 1
        else:
            out = torch.zeros(n, dtype=torch.uint8)
            with pytest.raises(varcomm.TimeoutError):
                # rank 0 does not progress (it blocks in recv(tag=8), which
                # drives its sends too: so the message may also complete)
                h = comm.irecv(0, tag=7, out=out)  # no message with tag 7: times out
                h.wait(timeout=0.3)
            comm.send(torch.tensor([0]), 0, tag=8)
            assert torch.equal(comm.recv(0), _data(n, 1))
            assert torch.equal(comm.recv(0), _data(n, 2))
            assert comm.recv(0, tag=3).item() == 5
            comm.send(torch.tensor([1]), 0, tag=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_cancelled_stream_drops_the_rest_and_the_pair_goes_on(transport):
    """A receive given up on after its rendezvous started (Work dropped or
    timed out mid-stream) never writes into its buffer afterwards, and the
    next message arrives intact."""
    with _init(transport, bound=BOUND, slots=2) as comm:
        n = 64 * BOUND
        if comm.rank == 0:
            comm.send(torch.tensor([0]), 1, tag=1)
            assert comm.recv(1, tag=2).item() == 0  # rank 1 posted its receive
            w = comm.isend(_data(n, 4), 1)
            time.sleep(0.5)  # rank 1 times out meanwhile: the first chunks are in, the rest waits for us
            w.wait()
            comm.send(_data(n, 5), 1)
            assert comm.recv(1, tag=9).item() == 1
        else:
            out = torch.zeros(n, dtype=torch.uint8)
            h = comm.irecv(0, out=out)
            assert comm.recv(0, tag=1).item() == 0
            comm.send(torch.tensor([0]), 0, tag=2)
            try:
                h.wait(timeout=0.2)
                timed_out = False
            except varcomm.TimeoutError as e:
                timed_out = True
                msg = str(e)
            if timed_out and comm.route_info(0).get("cma") != "on":
                assert "mid-message" in msg or "nothing arrived" in msg, msg
            snap = out.clone()
            got = comm.recv(0)
            assert torch.equal(got, _data(n, 5))
            if timed_out:
                assert torch.equal(out, snap)  # nothing written after the give-up
            comm.send(torch.tensor([1]), 0, tag=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60, expect_exit={0: None})
def test_dead_peer_mid_large_message_fails_within_seconds(transport):
    """The sender dies with its message partly delivered (a streaming pair:
    the first chunks are in the receiver's out; shm with CMA: copied at once)."""
    with _init(transport, bound=BOUND, slots=2, peer_timeout=2) as comm:
        n = 256 * BOUND
        if comm.rank == 0:
            w = comm.isend(_data(n, 1), 1)
            assert comm.recv(1, tag=1).item() == 0  # drives the send: the ring fills
            for _ in range(20):
                w.is_completed()
            os._exit(3)
        out = torch.zeros(n, dtype=torch.uint8)
        h = comm.irecv(0, out=out)
        comm.send(torch.tensor([0]), 0, tag=1)
        t0 = time.monotonic()
        try:
            assert torch.equal(h.wait(timeout=30), _data(n, 1))  # all of it came first
        except varcomm.PeerFailure as e:
            assert "rank 0" in str(e), e
        with pytest.raises(varcomm.PeerFailure):
            comm.recv(0, out=out, timeout=30)
        assert time.monotonic() - t0 < 20


@world(2, timeout=60, expect_exit={1: None})
def test_dead_receiver_fails_a_rendezvous_send_within_seconds():
    """The sender of a message waiting for its receiver (shm: its head is
    posted, the data still in the sender's memory) learns of the receiver's
    death."""
    with varcomm.init(transport="shm", bound=BOUND, slots=2, timeout=60) as comm:
        if comm.rank == 1:
            comm.send(torch.tensor([0]), 0)
            time.sleep(0.3)
            os._exit(3)
        comm.recv(1)
        t0 = time.monotonic()
        with pytest.raises(varcomm.PeerFailure):
            comm.send(_data(64 * BOUND, 1), 1, timeout=30)
        assert time.monotonic() - t0 < 20


@world(2, timeout=60)
def test_shm_copies_once_over_eager_max_and_says_so():
    """Under the bound but over eager_max, a shm pair with CMA sends by
    rendezvous: the send completes only once the receiver has copied the data
    out of the sender's memory (an eager send completes when written)."""
    with varcomm.init(transport="shm", bound=1 << 20, eager_max=64 << 10, timeout=30, cma="on") as comm:
        peer = 1 - comm.rank
        d = comm.describe_transport(peer)
        assert "CMA" in d, d
        cma = comm.route_info(peer)["cma"]
        assert cma in ("on", "off"), cma
        if cma == "off":
            assert comm.route_info(peer)["cma_refused"] in d
        n = 512 << 10
        if comm.rank == 0:
            w = comm.isend(_data(n, 1), 1)
            small = comm.isend(torch.tensor([1]), 1, tag=5)  # not held up behind the large one
            time.sleep(0.3)
            assert w.is_completed() == (cma == "off")  # rendezvous: waits for rank 1's recv
            small.wait()
            comm.send(torch.tensor([2]), 1, tag=6)
            w.wait()
            assert torch.equal(comm.recv(1), _data(n, 2))
        else:
            assert comm.recv(0, tag=5).item() == 1
            assert comm.recv(0, tag=6).item() == 2
            assert torch.equal(comm.recv(0), _data(n, 1))
            comm.send(_data(n, 2), 0)


def _flag(name: str) -> str:
    # Both ranks are children of the one test process.
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"varcomm-{os.getppid()}-{name}")


def _wait_file(path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_a_timed_out_rendezvous_send_gives_the_buffer_back(transport):
    """A blocking send over the bound that times out (the receiver is not
    receiving yet) leaves the caller free to reuse its buffer: the receiver,
    receiving later, still gets the message as it was sent, then the next one."""
    n = 64 * BOUND
    with _init(transport, bound=BOUND, slots=4) as comm:
        done = _flag(f"timeout-{transport}")
        if comm.rank == 0:
            x = _data(n, 3).numpy()
            t0 = time.monotonic()
            with pytest.raises(varcomm.TimeoutError, match="buffer is yours again"):
                comm.send(x, 1, tag=1, timeout=0.5)
            assert time.monotonic() - t0 < 10
            x[:] = 0  # the caller reuses it at once
            comm.send(torch.tensor([7]), 1, tag=2)
            open(done, "w").close()
            assert comm.recv(1, tag=9).item() == 1
            os.unlink(done)
        else:
            _wait_file(done)
            got = comm.recv(0, tag=1)
            assert np.array_equal(got, _data(n, 3).numpy()), "the receiver saw the sender's reused buffer"
            assert comm.recv(0, tag=2).item() == 7
            comm.send(torch.tensor([1]), 0, tag=9)


@world(2, timeout=120)
def test_close_withdraws_a_rendezvous_send_nobody_received():
    """close() fails an unreceived rendezvous send (ClosedError), after its
    10 s flush, and the caller may reuse the buffer: the receiver must then
    never deliver it. On shm with CMA the receiver would copy it out of the
    sender's memory, so the sender withdraws it; rank 1 (the sender) stays
    alive meanwhile, so such a copy would succeed. (Rank 1 sends: rank 0 hosts
    the store and would wait out its peers' close too.)"""
    n = 64 * BOUND
    with _init("shm", bound=BOUND, slots=4, cma="on") as comm:
        closed, checked = _flag("closed"), _flag("checked")
        pulls = comm.route_info(1 - comm.rank).get("cma") == "on"
        if comm.rank == 1:
            x = _data(n, 4).numpy()
            w = comm.isend(x, 0, tag=1)
            comm.close()
            with pytest.raises(varcomm.ClosedError):
                w.wait()
            x[:] = 0
            open(closed, "w").close()
            _wait_file(checked, 60)
            os.unlink(checked)
        else:
            _wait_file(closed, 60)
            os.unlink(closed)
            with pytest.raises((varcomm.PeerFailure, varcomm.TimeoutError)) as e:
                got = comm.recv(1, tag=1, timeout=20)
                print("delivered anyway, zeros:", int((np.asarray(got) == 0).sum()))
            if pulls:
                assert "withdrew" in str(e.value), e.value
            open(checked, "w").close()


def _read_only_array(n: int) -> np.ndarray:
    """A writable-looking array over a read-only mapping: a copy into it fails
    (EFAULT) after the receiver has taken the message."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


@world(2, timeout=90)
def test_a_receiver_whose_copy_fails_answers_its_sender():
    """The receiver claims a rendezvous head and its copy fails (its out is
    read-only memory); it stays alive without calling varcomm. The sender's
    send fails soon (PeerFailure: the receiver could not copy it) rather than
    waiting for an answer until the receiver exits (20 s)."""
    n = 64 * BOUND
    with _init("shm", bound=BOUND, slots=4, cma="on") as comm:
        if comm.route_info(1 - comm.rank).get("cma") != "on":
            pytest.skip("CMA refused here: the pair streams")
        if comm.rank == 1:
            with pytest.raises(varcomm.PeerFailure, match="could not be copied"):
                comm.recv(0, tag=1, out=_read_only_array(n))
            time.sleep(20)
        else:
            t0 = time.monotonic()
            with pytest.raises((varcomm.PeerFailure, varcomm.TimeoutError)) as e:
                comm.send(_data(n, 7).numpy(), 1, tag=1, timeout=2)
            assert time.monotonic() - t0 < 15, e.value


@world(2, timeout=90)
def test_failing_the_pair_withdraws_a_moved_send():
    """Rank 0's send times out (its data moves to a copy of rank 0's own), then
    rank 0 fails the pair on its side (its copy of rank 1's message fails)
    while rank 1 lives on: the moved send is withdrawn, not freed under rank
    1, which gets an error, never bytes of freed memory."""
    n = 16 * BOUND
    with _init("shm", bound=BOUND, slots=4, cma="on") as comm:
        if comm.route_info(1 - comm.rank).get("cma") != "on":
            pytest.skip("CMA refused here: the pair streams")
        go, failed = _flag("go"), _flag("failed")
        if comm.rank == 0:
            x = _data(n, 8).numpy()
            with pytest.raises(varcomm.TimeoutError):
                comm.send(x, 1, tag=1, timeout=0.5)
            x[:] = 0
            open(go, "w").close()
            with pytest.raises(varcomm.PeerFailure):
                comm.recv(1, tag=2, out=_read_only_array(n))
            junk = [bytearray(n) for _ in range(4)]  # the heap moves on
            assert junk
            open(failed, "w").close()
            time.sleep(3)
        else:
            _wait_file(go)
            os.unlink(go)
            comm.isend(_data(n, 9), 0, tag=2)
            _wait_file(failed)
            os.unlink(failed)
            with pytest.raises(varcomm.PeerFailure, match="withdrew"):
                comm.recv(0, tag=1)


@world(2, timeout=60, requires=("libfabric",))
def test_rdma_streams_a_message_over_twice_its_chunk_even_under_the_bound():
    """On rdma a host message over twice rdma_chunk goes by rendezvous in
    rdma_chunk pieces, although it fits the slot: the send completes only once
    the receiver has it (an eager send completes when written), and it
    arrives whole, interleaved with small ones."""
    chunk, n = 4096, 40 * 4096 + 3
    with varcomm.init(transport="rdma", bound=1 << 20, slots=4, rdma_chunk=chunk, timeout=30) as comm:
        if comm.rank == 0:
            eager = comm.isend(_data(2 * chunk, 1), 1, tag=1)  # not over twice the chunk: eager
            w = comm.isend(_data(n, 2), 1, tag=2)
            time.sleep(0.3)
            assert not w.is_completed(), "a message over twice rdma_chunk completed before it was received"
            eager.wait()
            comm.send(torch.tensor([5]), 1, tag=3)
            w.wait()
        else:
            assert comm.recv(0, tag=3).item() == 5
            assert torch.equal(comm.recv(0, tag=2), _data(n, 2))
            assert torch.equal(comm.recv(0, tag=1), _data(2 * chunk, 1))


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_receives_without_out_answer_rendezvous_before_they_are_waited(transport):
    """Two stages post receives without out (torch pipelining's placeholders),
    send each other a large message, and wait for their sends first (as its
    1F1B schedule does): each posted receive takes its message as it comes, so
    both sends complete; a receive waited only later used to leave its sender
    waiting for an answer, and both waited until their timeout."""
    n = 64 * BOUND + 5
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=20) as comm:
        peer = 1 - comm.rank
        for i in range(3):
            rw = comm.irecv(peer, tag=i)
            sw = comm.isend(_data(n, 10 * i + comm.rank), peer, tag=i)
            sw.wait()
            assert torch.equal(rw.wait(), _data(n, 10 * i + peer))
        rw = comm.irecv(peer, tag=9)
        comm.send(torch.tensor([comm.rank]), peer, tag=9)
        assert rw.wait().item() == peer


@world(2, timeout=60)
@pytest.mark.parametrize("cma", ["auto", "on", "off"])
def test_cma_option_and_the_probe_decide_single_copy_reads(cma):
    """cma=auto measures once whether one CMA copy beats two memcpys and says
    so (route_info()["cma_probe"]); on and off force it (off: a message over
    the bound streams through the slots). Every way, messages arrive whole."""
    with _init("shm", bound=BOUND, slots=4, cma=cma) as comm:
        peer = 1 - comm.rank
        info, d = comm.route_info(peer), comm.describe_transport(peer)
        if cma == "auto":
            assert "GB/s" in info["cma_probe"], info
            assert info["cma_probe"] in d or info["cma_refused"] in d, (info, d)
            assert (info["cma"] == "on") == ("faster than two" in info["cma_probe"] and not info["cma_refused"])
        elif cma == "off":
            assert info["cma"] == "off" and "cma=off" in d, (info, d)
        else:
            assert info["cma"] == ("off" if info["cma_refused"] else "on"), info
        n = 40 * BOUND + 1
        if comm.rank == 0:
            comm.send(_data(n, 11), 1)
        else:
            assert torch.equal(comm.recv(0), _data(n, 11))


@pytest.mark.parametrize("stores", ["streaming", "ordinary", "auto"])
@world(2, timeout=90)
def test_shm_stores_deliver_exact_bytes_from_any_alignment(stores):
    # Large slot writes may go by non-temporal stores (csrc/hostmem.h copy_to_peer): unaligned heads and tails,
    # and the fence before the ready word, must not cost a byte. Sizes around the 16 KiB switch, sources at
    # odd offsets, into fresh results and into an ordinary out.
    seed = seeded()
    rng = np.random.default_rng(seed)
    sizes = [(16 << 10) - 1, 16 << 10, (16 << 10) + 13, 1 << 20] + [int(x) for x in rng.integers(16 << 10, 1 << 20, 20)]
    offsets = [int(x) for x in rng.integers(0, 64, len(sizes))]
    data = rng.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)
    large = sum(n >= 16 << 10 for n in sizes)
    # cma off and no landing area: every message is copied by its sender into a slot
    with varcomm.init(transport="shm", bound=1 << 20, slots=4, shm_stores=stores, cma="off", landing=0,
                      timeout=30) as comm:
        assert comm.route_info(1 - comm.rank)["stores"] == stores
        before = varcomm._C.peer_copy_stats()
        if comm.rank == 0:
            for n, off in zip(sizes, offsets):
                comm.send(data[off:off + n], dst=1)
                comm.send(data[off:off + n], dst=1)
            after = varcomm._C.peer_copy_stats()
            ordinary, streamed = after[1] - before[1], after[2] - before[2]
            if platform.machine() not in ("x86_64", "AMD64"):  # no non-temporal copy there: plain memcpy, uncounted
                assert streamed == 0, (ordinary, streamed)
            elif stores == "streaming":
                assert streamed == 2 * large, (ordinary, streamed, large)
            elif stores == "ordinary":
                assert streamed == 0, (ordinary, streamed)
            else:  # each large copy timed, one way or the other
                assert ordinary + streamed == 2 * large, (ordinary, streamed, large)
        else:
            out = np.zeros((1 << 20) + 128, dtype=np.uint8)
            for i, (n, off) in enumerate(zip(sizes, offsets)):
                got = comm.recv(src=0)
                assert got.nbytes == n and bytes(np.asarray(got)) == bytes(data[off:off + n]), \
                    f"message {i} ({n} bytes from offset {off}) differs, stores={stores} (seed {seed})"
                out[:] = 0
                got = comm.recv(src=0, out=out[off:])
                assert bytes(np.asarray(got)) == bytes(data[off:off + n]) and not out[off + n:].any(), \
                    f"message {i} into out at {off} differs, stores={stores} (seed {seed})"
        comm.barrier()


@pytest.mark.parametrize("stores", ["streaming", "ordinary"])
@world(2, timeout=90)
def test_slow_slot_writes_ask_the_receiver_to_read_by_cma(stores):
    # Under cma=chunks a p2p message over the bound into an ordinary out streams through the slots (two copies).
    # While the sender's slot writes are slow (shm_stores=streaming says so for good; auto during a VM spell) its
    # rendezvous heads ask for one CMA read instead (protocol.h kSlowSlots); otherwise they stream as before.
    seed = seeded()
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(1 << 20, 3 << 20, 6)]
    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    with varcomm.init(transport="shm", bound=1 << 20, slots=4, shm_stores=stores, cma="chunks", timeout=30) as comm:
        if comm.route_info(1 - comm.rank)["cma_refused"]:
            pytest.skip("CMA is refused between these processes (ptrace rights)")
        if comm.rank == 0:
            for i, n in enumerate(sizes):
                comm.send(data[:n], dst=1)
                w = comm.isend(data[i:i + n], dst=1)  # to an irecv posted first
                w.wait()
        else:
            out = np.zeros(3 << 20, dtype=np.uint8)
            before = comm._c.pulled_bytes
            for i, n in enumerate(sizes):
                got = comm.recv(src=0, out=out)
                assert bytes(np.asarray(got)) == bytes(data[:n]), f"message {i} of {n} bytes differs (seed {seed})"
                w = comm.irecv(src=0, out=out)
                got = w.wait()
                assert bytes(np.asarray(got)) == bytes(data[i:i + n]), f"irecv {i} differs (seed {seed})"
            pulled = comm._c.pulled_bytes - before
            want = 2 * sum(sizes) if stores == "streaming" else 0
            assert pulled == want, (stores, pulled, want)
        comm.barrier()
        # A new array's data is written by its sender into the receiver's landing area: timed apart from the slots
        # (its copies must not speak for them), and never a reason to ask for a CMA read.
        if comm.rank == 0:
            before, land0 = varcomm._C.peer_copy_stats(), varcomm._C.peer_copy_stats(landing=True)
            for n in sizes:
                comm.send(data[:n], dst=1)
            after, land1 = varcomm._C.peer_copy_stats(), varcomm._C.peer_copy_stats(landing=True)
            assert after[1:3] == before[1:3], (stores, before, after)
            want = len(sizes) if stores == "streaming" and platform.machine() in ("x86_64", "AMD64") else 0
            assert land1[2] - land0[2] == want, (stores, land0, land1)
        else:
            before = comm._c.pulled_bytes
            for i, n in enumerate(sizes):
                got = comm.recv(src=0)
                assert bytes(np.asarray(got)) == bytes(data[:n]), f"new array {i} differs (seed {seed})"
            assert comm._c.pulled_bytes == before, "a new array was read by CMA, not written into the landing area"
        comm.barrier()


def test_store_chooser_follows_a_spell_and_ignores_noise():
    # csrc/hostmem.h StoreChooser, with made-up times: 1 MiB copies every ms; ordinary 33 ns/KiB and
    # non-temporal 50 outside a spell, ordinary 380 in one (this VM's numbers).
    trace = varcomm._C._store_chooser_trace
    normal = [(t, 33, 50) for t in range(0, 100_000, 1000)]
    out = trace(normal)
    assert not any(s for _, s, _ in out), "streamed outside a spell"
    assert 0 < sum(w == 1 for w, _, _ in out) <= 21, "the other way is tried every 5 ms, no more"
    # One preempted copy (10x) and a 1.6x-slower stretch are no spell.
    assert not any(s for _, s, _ in trace(normal[:50] + [(50_000, 400, 50)] + normal[51:]))
    assert not any(s for _, s, _ in trace([(t, 80, 50) for t in range(0, 100_000, 1000)]))
    # A spell: streaming within a few retries, and slow() while copies keep coming.
    spell = [(t, 380, 40) for t in range(100_000, 200_000, 1000)]
    out = trace(normal + spell)
    at = next(i for i, (_, s, _) in enumerate(out) if s)
    assert 100 <= at <= 100 + 16, f"switched at event {at}"
    assert all(s and slow for _, s, slow in out[at + 1:]), "left streaming mid-spell"
    assert sum(w == 1 for w, _, _ in out[at + 1:]) >= len(out) - at - 1 - 21
    # No copies for 25 ms: not slow any more (a stale verdict), though the choice stands.
    last = out[-1]
    stale = trace(normal + spell + [(225_000, 0, 0)])[-1]
    assert last[1] and last[2] and stale == (-1, True, False), (last, stale)
    # The spell ends: back to ordinary stores within a few retries.
    after = [(t, 33, 40) for t in range(200_000, 300_000, 1000)]
    out = trace(normal + spell + after)
    back = next(i for i, (_, s, _) in enumerate(out) if i >= 200 and not s)
    assert back <= 200 + 16, f"switched back at event {back}"
    assert not any(s for _, s, _ in out[back:])
