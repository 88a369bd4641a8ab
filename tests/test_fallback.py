"""The fallback transport (transport/fallback): the engine's writes emulated over
gloo. Frames from a peer are checked before anything lands; a dead or closing
peer fails requests within seconds; close never hangs on messages in flight."""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import struct
import time

import numpy as np
import pytest
import torch

import varcomm
from varcomm import _C
from varcomm.testing import world

# ---- one process: forged frames straight into landing() ----------------------

BOUND, SLOTS = 1024, 4
WRITE, CREDIT, BYE = 0x76630011, 0x76630012, 0x76630013
U8 = (1 << 16) | (8 << 8) | 1  # the dtype word of uint8


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# csrc/protocol.h's Layout, for rank 0 of 2 (the attacked receiver).
CREDIT_ROW = _align(SLOTS * 8, 64)
RINGS = _align(4096 + 2 * CREDIT_ROW, 4096)
SLOT_BYTES = 256 + _align(BOUND, 256)


def slot_off(sender: int, k: int) -> int:
    return RINGS + (sender * SLOTS + k) * SLOT_BYTES


def pair_tag(round0: list[bytes], src: int, dst: int, key: bytes = b"") -> int:
    """The header tag of pair src -> dst (csrc/routes.cpp pair_tag), from the
    ranks' round-0 set-up records: these frames play rank 1, so they carry its tag."""
    job = hashlib.sha256(b"".join(str(len(b)).encode() + b":" + b for b in round0)).digest()
    msg = b"\0".join([b"varcomm-pair1", b"0", str(src).encode(), str(dst).encode(), job, b""])
    return int.from_bytes(hmac.new(key, msg, "sha256").digest()[:8], "little")


AUTH = {"tag": 0}  # rank 1 -> 0's pair tag in the engine receiver() made last


def frame(kind: int, off: int, n: int, seq: int, *, nbytes: int | None = None, hdr_seq: int | None = None,
          ndim: int = 1, flags: int = 0, tag: int = 7) -> bytes:
    shape = [n] + [0] * 7
    hdr = struct.pack("<QQqII8qQQQ", seq if hdr_seq is None else hdr_seq, n if nbytes is None else nbytes, tag,
                      U8, ndim, *shape, flags, AUTH["tag"], 0)  # csrc/protocol.h MsgHeader; src 0
    return struct.pack("<IIQQQ", kind, len(hdr) if kind == WRITE else 0, off, n, seq) + hdr.ljust(128, b"\0")


def receiver() -> tuple[object, object]:
    """Rank 0 of a 2-rank engine whose peer 1 is on the fallback (nothing runs
    the mover): both ranks' cores set up in this process, rank 1 then dropped."""
    opts = varcomm.Options.resolve(transport="fallback", bound=BOUND, slots=SLOTS).placed(1).core(-1)
    cs = [_C.Comm(r, 2, opts) for r in range(2)]
    outs = [c.setup_begin() for c in cs]
    AUTH["tag"] = pair_tag(outs, 1, 0)
    while outs[0] is not None:
        outs = [c.setup_step(outs) for c in cs]
    c = cs[0]
    assert c.routes == ["shm", "fallback"] and c.needs_fallback_group
    cs[1].close()
    return c, _C.fallback_mover(c)


def deliver(mover: object, k: int, seq: int, payload: bytes) -> int:
    """Land a valid message from rank 1 in slot k; returns the slot's payload address."""
    slot = mover.landing(1, frame(WRITE, slot_off(1, k), len(payload), seq))
    assert isinstance(slot, memoryview) and len(slot) == len(payload)
    slot[:] = payload
    mover.landed(1)
    return np.frombuffer(slot, dtype=np.uint8).ctypes.data if payload else 0


def test_valid_frames_land_in_the_slot_and_credits_go_back():
    c, mover = receiver()
    deliver(mover, 0, 1, b"hello fallback")
    rid = c.irecv(1, 7, 0, 0, 0)
    c.wait(rid, 5.0)
    st = c.info(rid)
    assert (st.src, st.tag, st.nbytes, st.dtype, st.shape) == (1, 7, 14, U8, (14,))
    out = np.zeros(14, dtype=np.uint8)
    c.copy_out(rid, out.ctypes.data)
    assert out.tobytes() == b"hello fallback"
    # Consuming freed the slot: a credit (seq 1) for rank 1's credit word of slot 0 is queued.
    f = np.zeros(_C.FallbackMover.frame_bytes, dtype=np.uint8)
    ticket, payload = mover.next_op(1, f, 0.5)
    kind, _hl, off, n, value = struct.unpack_from("<IIQQQ", f.tobytes())
    assert ticket > 0 and payload is None and (kind, off, n, value) == (CREDIT, 4096 + CREDIT_ROW * 0, 0, 1)
    assert mover.next_op(1, f, 0.05) == (0, None)  # nothing else queued
    # A credit from rank 1 lands in our credit row for it.
    assert mover.landing(1, frame(CREDIT, 4096 + CREDIT_ROW * 1 + 8, 0, 5)) is True
    assert c.peer_error(1) == ""
    c.close()


def test_a_descriptor_lands_without_a_payload():
    """A descriptor (kDescriptor) describes data sent apart: its nbytes may pass
    the bound, and the frame carries no payload."""
    c, mover = receiver()
    slot = mover.landing(1, frame(WRITE, slot_off(1, 0), 0, 1, nbytes=1 << 40, flags=2))
    assert isinstance(slot, memoryview) and len(slot) == 0
    mover.landed(1)
    rid = c.irecv(1, 7, 0, 0, 0)
    c.wait(rid, 5.0)
    st = c.info(rid)
    assert st.descriptor and st.nbytes == 1 << 40
    c.close()


BAD = {
    "our own ring, not its": (lambda: frame(WRITE, slot_off(0, 0), 8, 1), "not a slot of its ring"),
    "inside a slot": (lambda: frame(WRITE, slot_off(1, 1) + 256, 8, 1), "not a slot of its ring"),
    "past its ring": (lambda: frame(WRITE, slot_off(1, SLOTS), 8, 1), "not a slot of its ring"),
    "the control block": (lambda: frame(WRITE, 0, 8, 1), "not a slot of its ring"),
    "over the bound": (lambda: frame(WRITE, slot_off(1, 0), BOUND + 1, 1), "over this rank's bound"),
    "header over the bound": (lambda: frame(WRITE, slot_off(1, 0), 8, 1, nbytes=1 << 40), "header"),
    "header seq differs": (lambda: frame(WRITE, slot_off(1, 0), 8, 1, hdr_seq=9), "header"),
    "too many dims": (lambda: frame(WRITE, slot_off(1, 0), 8, 1, ndim=9), "header"),
    "device payload flag": (lambda: frame(WRITE, slot_off(1, 0), 8, 1, flags=1), "header"),
    "descriptor with a payload": (lambda: frame(WRITE, slot_off(1, 0), 8, 1, flags=2), "header"),
    "credit outside its row": (lambda: frame(CREDIT, 4096 + CREDIT_ROW * 1 + 8 * SLOTS, 0, 1), "credit row"),
    "credit in another's row": (lambda: frame(CREDIT, 4096, 0, 1), "credit row"),
    "unknown kind": (lambda: frame(0x1234, slot_off(1, 0), 8, 1), "unknown kind"),
    "short frame": (lambda: frame(WRITE, slot_off(1, 0), 8, 1)[:100], "bytes, not"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_lying_frame_is_refused_before_anything_is_written(case):
    c, mover = receiver()
    base = deliver(mover, 1, 1, b"x") - slot_off(1, 1) - 256  # our region's address
    size = c.region_bytes
    before = ctypes.string_at(base, size)
    make, why = BAD[case]
    with pytest.raises(varcomm.PeerFailure, match=why):
        mover.landing(1, make())
    assert ctypes.string_at(base, size) == before, "a refused frame changed the region"
    # The peer is failed with the reason, and requests with it fail at once.
    assert "sent a fallback frame" in c.peer_error(1)
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        c.wait(c.irecv(1, 99, 0, 0, 0), 5.0)
    c.close()


def test_a_write_over_a_slot_not_yet_freed_is_refused():
    c, mover = receiver()
    deliver(mover, 0, 1, b"first")
    with pytest.raises(varcomm.PeerFailure, match="not freed"):
        mover.landing(1, frame(WRITE, slot_off(1, 0), 6, 2))
    rid = c.irecv(1, 7, 0, 0, 0)
    c.wait(rid, 5.0)  # the message it would have overwritten is intact
    out = np.zeros(5, dtype=np.uint8)
    c.copy_out(rid, out.ctypes.data)
    assert out.tobytes() == b"first"
    c.close()


# ---- multi-rank: dead and closing peers, close with messages in flight ------


@world(2, timeout=90, expect_exit={1: None})
def test_receiver_killed_mid_stream_fails_the_sender_promptly():
    comm = varcomm.init(transport="fallback", bound=1 << 20, slots=4, timeout=60)
    x = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB
    if comm.rank == 1:
        for _ in range(3):
            assert torch.equal(comm.recv(src=0), x)
        os.kill(os.getpid(), 9)
    sent, last = 0, time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        for _ in range(100):  # its slots fill, then no credit comes back
            comm.send(x, dst=1)
            sent, last = sent + 1, time.monotonic()
    assert time.monotonic() - last < 10, "the dead receiver took too long to detect"
    assert 3 <= sent <= 3 + 4, sent
    with pytest.raises(varcomm.PeerFailure):
        comm.send(x, dst=1)  # later operations fail at once
    comm.close()


@world(2, timeout=90, expect_exit={1: None})
def test_sender_killed_with_payloads_in_flight_fails_the_receiver_promptly():
    comm = varcomm.init(transport="fallback", bound=1 << 20, slots=8, timeout=60)
    x = torch.full((1 << 20,), 7, dtype=torch.uint8)
    if comm.rank == 1:
        comm.send(x, dst=0)
        comm.send(x, dst=0)
        works = [comm.isend(x, dst=0) for _ in range(6)]  # handed to the mover, still moving
        os.kill(os.getpid(), 9)
        del works
    got, last = 0, time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        for _ in range(9):
            m = comm.recv(src=1)
            assert torch.equal(m, x), "a message from the dead rank arrived corrupted"
            got, last = got + 1, time.monotonic()
    assert time.monotonic() - last < 10, "the dead sender took too long to detect"
    assert 2 <= got < 9, got  # a payload cut short is never delivered
    comm.close()


@world(2, timeout=60)
def test_close_with_messages_in_flight_does_not_hang():
    comm = varcomm.init(transport="fallback", bound=1 << 16, slots=2, timeout=60)
    x = torch.ones(1 << 14, dtype=torch.float32)  # 64 KiB
    if comm.rank == 0:
        # Rank 1 never receives: two fill its slots, the rest stay queued.
        works = [comm.isend(x, dst=1, tag=i) for i in range(6)]
    comm.barrier()
    t0 = time.monotonic()
    comm.close()
    assert time.monotonic() - t0 < 8, "close hung on messages in flight"
    if comm.rank == 0:
        del works


@world(2, timeout=60)
def test_a_peer_that_closed_fails_operations_with_it():
    comm = varcomm.init(transport="fallback", bound=1 << 16, slots=2, timeout=60)
    if comm.rank == 1:
        comm.send(torch.tensor([5]), dst=0)
        comm.close()
        return
    assert comm.recv(src=1).tolist() == [5]  # sent before it closed: still delivered
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="closed its communicator"):
        comm.recv(src=1, timeout=30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        comm.send(torch.tensor([1]), dst=1)
    comm.close()


@world(2, timeout=60)
def test_describe_names_the_fallback():
    with varcomm.init(transport="fallback", bound=1 << 16, timeout=30) as comm:
        peer = 1 - comm.rank
        assert comm.transport_for(peer) == "fallback"
        assert comm.describe_transport(peer).startswith("fallback (torch.distributed gloo")
        assert comm.transport_for(comm.rank) == "shm"  # self-sends stay in local memory


@world(2, timeout=120)
def test_alltoall_given_up_keeps_its_in_flight_input_alive():
    """An all-to-all that times out while the mover still sends its input
    (the receiver is stopped, so gloo blocks mid-payload) must keep that input
    alive until the mover is done with it, and let it go then: freeing it at
    the timeout made the mover read unmapped memory once the peer resumed.
    Calls the core's collective binding directly, with the `keep` it takes
    (the objects the plan's pointers belong to)."""
    import gc
    import signal
    import weakref

    from varcomm import _C, dtypes

    big = 32 << 20  # well over what the socket buffers take while the receiver is stopped
    comm = varcomm.init(transport="fallback", bound=big, slots=1, timeout=60)
    if comm.rank == 1:
        comm.send(torch.tensor([os.getpid()]), dst=0)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 resumes us once its collective gave up
        time.sleep(2)  # the mover receives rank 0's payload meanwhile
        comm.close()
        return
    pid = int(comm.recv(src=1).item())
    time.sleep(0.5)
    x = np.full(big, 7, np.uint8)  # mmap'd by malloc: freeing it unmaps it
    alive = weakref.ref(x)
    h = _C.all_to_all_rows(comm._c, 0, 0, 0, x.ctypes.data, 1, [0, big], dtypes.from_numpy(x.dtype), (), 0, 0,
                           None, keep=x)
    with pytest.raises(varcomm.TimeoutError):
        h.run(1.0, None)
    del x, h
    gc.collect()
    assert alive() is not None, "the input was let go while the mover still sends it"
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while alive() is not None and time.monotonic() < deadline:
        comm._c.progress()  # lets go of what the engine is done with
        time.sleep(0.05)
    assert alive() is None, "the input was kept after the mover had sent it"
    comm.close()


@world(2, timeout=120)
def test_blocking_send_timed_out_in_flight_keeps_its_array_alive():
    """A blocking numpy send that times out while the mover still sends it
    (receiver stopped mid-payload) keeps the array alive until the mover is
    done, then lets it go."""
    import gc
    import signal
    import weakref

    big = 32 << 20
    comm = varcomm.init(transport="fallback", bound=big, slots=1, timeout=60)
    if comm.rank == 1:
        comm.send(torch.tensor([os.getpid()]), dst=0)
        os.kill(os.getpid(), signal.SIGSTOP)
        assert comm.recv(src=0, timeout=30).nbytes == big
        comm.close()
        return
    pid = int(comm.recv(src=1).item())
    time.sleep(0.5)
    x = np.full(big, 7, np.uint8)
    alive = weakref.ref(x)
    with pytest.raises(varcomm.TimeoutError):
        comm.send(x, dst=1, timeout=1.0)
    del x
    gc.collect()
    assert alive() is not None, "the array was let go while the mover still sends it"
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while alive() is not None and time.monotonic() < deadline:
        comm._c.progress()
        time.sleep(0.05)
    assert alive() is None, "the array was kept after the mover had sent it"
    comm.close()


@world(2, timeout=90)
def test_an_all_to_all_that_times_out_mid_transfer_raises_not_hangs():
    """A fallback all-to-all of rendezvous-sized parts (MBs over a 4 KiB
    bound) given 0.05 s: at its deadline the call cancelled its parts while
    holding the GIL, and cancelling waits for their writes, which complete on
    the fallback's Python mover threads: every rank hung for good. Now it
    raises TimeoutError within seconds, and the next call pairs up."""
    comm = varcomm.init(transport="fallback", bound=4096, timeout=60)
    r, n = comm.rank, comm.world_size
    rows = 400_000
    x = torch.arange(rows * n * 3, dtype=torch.float32).reshape(rows * n, 3) + 1000 * r
    comm.barrier()
    t0 = time.monotonic()
    with pytest.raises(varcomm.TimeoutError, match="all_to_all_v on rank [01] timed out after 0.05 s"):
        comm.all_to_all_v(x, [rows] * n, timeout=0.05)
    assert time.monotonic() - t0 < 20, f"took {time.monotonic() - t0:.1f} s"
    comm.barrier(timeout=30)
    got, rows_got = comm.all_to_all_v(torch.arange(n) + 10 * r, [1] * n)
    assert rows_got == [1] * n and got.tolist() == [10 * s + r for s in range(n)]
    comm.close()
