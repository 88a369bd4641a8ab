"""The blocking hot path (Comm.fast(): one core call per send/recv) against
the general path it stands in for: the same results, views and errors for
every argument form it takes or hands on."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS
from varcomm.testing import world

BOUND = 64 * 1024


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_prefix_views_are_out_front(transport, kind):
    """recv(out=) into a 1-d bound-sized out returns a view of out's front with
    the sender's shape (1-d: sliced in the core; n-d: made by the facade), or
    out itself for a message of out's shape.
    Catches: a copy instead of a view, a view of the wrong length or offset, a
    view cached across receives (a later one of another length)."""
    shapes = [(5,), (3, 4), (), (0,), (17,), (BOUND // 8,), (2,)]
    with varcomm.init(transport=transport, bound=BOUND, slots=2, timeout=30) as comm:
        if comm.rank == 0:
            for i, s in enumerate(shapes):
                x = np.asarray(np.arange(int(np.prod(s)), dtype=np.float64).reshape(s) + i)
                comm.send(x if kind == "numpy" else torch.from_numpy(x), 1)
            return
        lib_out = np.zeros(BOUND // 8) if kind == "numpy" else torch.zeros(BOUND // 8, dtype=torch.float64)
        views = []
        for i, s in enumerate(shapes):
            v = comm.recv(0, out=lib_out)
            want = np.arange(int(np.prod(s)), dtype=np.float64).reshape(s) + i
            assert tuple(v.shape) == s, (i, v.shape, s)
            got = v if kind == "numpy" else v.numpy()
            assert np.array_equal(got, want), i
            if s == (BOUND // 8,):
                assert v is lib_out
            elif kind == "numpy":
                assert v.size == 0 or np.shares_memory(v, lib_out), i
                assert v.size == 0 or v.__array_interface__["data"][0] == lib_out.__array_interface__["data"][0]
            else:
                assert v.numel() == 0 or v.data_ptr() == lib_out.data_ptr(), i
            views.append(v)
        assert views[-1].shape == (2,) and views[0].shape == (5,)  # each receive its own view
        views[-1][0] = -1.0
        assert float(lib_out[0]) == -1.0  # a view, not a copy


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_irecv_copy_false_lends_the_slot(transport, kind):
    """irecv(copy=False).wait() lends the slot like recv(copy=False): with one
    slot, the sender's next send waits (TimeoutError, nothing written) while
    the loan lives, and goes through once it is dropped.
    Catches: the slot freed at wait() (the loan then overwritten), never freed
    (the pair wedges), the wrong bytes lent."""
    with varcomm.init(transport=transport, bound=BOUND, slots=1, timeout=30, array=kind) as comm:
        x = np.arange(1000, dtype=np.int32)
        if comm.rank == 0:
            comm.send(x, 1)
            comm.barrier()  # 1: the loan is held
            with pytest.raises(varcomm.TimeoutError):
                comm.send(x * 2, 1, timeout=0.5)
            comm.barrier()  # 2: dropped
            comm.send(x * 3, 1, timeout=20)
            comm.barrier()  # 3
            return
        v = comm.irecv(0, copy=False).wait()
        assert isinstance(v, np.ndarray if kind == "numpy" else torch.Tensor)
        assert np.array_equal(np.asarray(v), x)
        comm.barrier()  # 1
        comm.barrier()  # 2: the send timed out
        assert np.array_equal(np.asarray(v), x), "the held loan was overwritten"
        del v
        gc.collect()
        assert np.array_equal(np.asarray(comm.recv(0)), x * 3)
        comm.barrier()  # 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_argument_forms_the_fast_path_hands_on(transport):
    """numpy integer ranks and tags, int and numpy-float timeouts, strided and
    foreign-byte-order arrays, torch negative views: the fast path declines
    and the general path sends the same values; a bool rank and an
    out-of-range one are refused with InvalidArgument; after close every
    blocking call raises ClosedError.
    Catches: a fast path that takes what it cannot read right (strided bytes,
    swapped bytes, a negative view's raw bits), or that takes a bool as rank 1."""
    with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30, array="numpy") as comm:
        peer = 1 - comm.rank
        base = np.arange(12, dtype=np.int32)
        sends = [
            (base, np.int64(peer), np.int32(3), 5),
            (base[::2], peer, 0, np.float64(20.0)),
            (base.astype(">i4"), peer, 0, None),
            (torch._neg_view(torch.from_numpy(base.astype(np.float32))), peer, 0, 10),
        ]
        wants = [base, base[::2], base, -base.astype(np.float32)]
        if comm.rank == 0:
            for x, dst, tag, t in sends:
                comm.send(x, dst, tag=tag, timeout=t)
            with pytest.raises(varcomm.InvalidArgument):
                comm.send(base, True)
            with pytest.raises(varcomm.InvalidArgument):
                comm.send(base, 2)
        else:
            out = np.zeros(64, np.int32)
            for (_x, _, tag, _), want in zip(sends, wants):
                if want.dtype == np.int32:
                    got = comm.recv(np.int64(0), tag=np.int64(tag), out=out, timeout=np.float64(10))
                else:
                    got = comm.recv(0, tag=tag, timeout=10)
                assert np.array_equal(got, want), (got, want)
            with pytest.raises(varcomm.InvalidArgument):
                comm.recv(True, out=out)
            with pytest.raises(varcomm.InvalidArgument):
                comm.recv(5)
        comm.barrier()
    with pytest.raises(varcomm.ClosedError):
        comm.send(base, peer)
    with pytest.raises(varcomm.ClosedError):
        comm.recv(peer, out=np.zeros(4, np.int32))
    with pytest.raises(varcomm.ClosedError):
        comm.recv(peer, copy=False)


@world(1, timeout=60)
def test_the_hot_path_objects_keep_their_attributes_inline():
    """CPython 3.11 keeps at most 29 attributes of an instance inline; with a
    30th every self.x and comm.send() on the fast path took a dict lookup
    (a send+recv pair of 8 B: 9% more instructions, +0.08 us, found with
    callgrind). Checked after every kind of call, since an attribute set
    later (the barrier counter was) counts too. Group rarely used state in an
    object of its own, as comm._end."""
    import dis
    import io
    import sys

    comm = varcomm.init(transport="shm")
    try:
        x, y = np.zeros(2, np.float32), np.zeros(64, np.float32)
        for _ in range(100):
            comm.send(x, 0)
            comm.recv(0, out=y)
            comm.isend(torch.zeros(2), 0).wait()
            comm.recv(0)
        comm.barrier()
        comm.all_to_all_v(torch.zeros(2, 3), [2])
        comm.all_to_all_v(torch.zeros(2, 3), [2], async_op=True).wait()
        assert len(vars(comm)) < 30, sorted(vars(comm))
        if sys.version_info[:2] == (3, 11):  # (what the count is for, in this version's words)
            text = io.StringIO()
            dis.dis(type(comm).send, adaptive=True, file=text)
            assert "LOAD_ATTR_INSTANCE_VALUE" in text.getvalue() and "LOAD_ATTR_WITH_HINT" not in text.getvalue()
    finally:
        comm.close()
