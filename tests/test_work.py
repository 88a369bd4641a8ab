"""One Work protocol: every kind of pending operation varcomm returns is a
varcomm.Work, and its synchronize() finishes it (host memory: like wait())."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import varcomm
import varcomm.comm
from varcomm.collectives.alltoall import AllToAllWork
from varcomm.integrations.torch_backend import VarcommWork
from varcomm.testing import world


def _is_work(w: object, kind: type | None = None) -> None:
    assert isinstance(w, varcomm.Work), f"{type(w).__name__} is not a varcomm.Work"
    if kind is not None:
        assert isinstance(w, kind), f"expected a {kind.__name__}, got {type(w).__name__}"


def test_the_protocol_checks_every_method():
    class NoSync:
        def wait(self, timeout=None): ...
        def is_completed(self): ...
        def result(self): ...

    assert not isinstance(NoSync(), varcomm.Work)
    assert not isinstance(object(), varcomm.Work)
    assert varcomm.Work is varcomm.work.Work and varcomm.comm.Work is varcomm.Work


@world(2, timeout=90)
def test_every_pending_op_is_a_work_and_synchronizes():
    import varcomm.distributed as vdist

    vdist.init_process_group("gloo")
    try:
        comm = vdist.get_comm()
        r, peer = comm.rank, 1 - comm.rank

        # point-to-point (P2PWork): synchronize returns what wait returns
        rw = comm.irecv(peer, tag=1)
        sw = comm.isend(torch.arange(4 + r, dtype=torch.int32), peer, tag=1)
        _is_work(rw, varcomm.P2PWork)
        _is_work(sw, varcomm.P2PWork)
        assert sw.synchronize() is None and sw.is_completed()
        got = rw.synchronize()
        assert got.tolist() == list(range(4 + peer)) and rw.is_completed() and rw.result() is got

        # all-to-all (AllToAllWork), numpy in host memory
        x = np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 10 * r
        w = comm.all_to_all_v(x, [1, 2] if r == 0 else [2, 1], async_op=True)
        _is_work(w, AllToAllWork)
        recv, splits = w.synchronize(30)
        assert w.is_completed() and splits == ([1, 2] if r == 0 else [2, 1])
        assert recv.shape == (3, 2) and w.wait() == (recv, splits)

        # varcomm.distributed: a receive into a non-contiguous tensor, and a finished op
        buf = torch.zeros(3, 4)[:, ::2]
        assert not buf.is_contiguous()
        cw = vdist.irecv(buf, src=peer, tag=2)
        vdist.isend(torch.full((3, 2), r + 1.0), dst=peer, tag=2).wait()
        _is_work(cw)
        assert cw.synchronize() is buf and cw.is_completed()
        assert buf.tolist() == [[peer + 1.0] * 2] * 3
        bw = vdist.barrier(async_op=True)
        _is_work(bw)
        assert bw.synchronize() is None and bw.is_completed() and bw.result() is None

        # the torch backend's dist.Work (VarcommWork)
        pg = dist.distributed_c10d._get_default_group()
        t = torch.full((5,), float(r))
        out = torch.zeros(5)
        works = [pg.recv([out], peer, 3), pg.send([t], peer, 3)] if r else [pg.send([t], peer, 3),
                                                                              pg.recv([out], peer, 3)]
        for tw in works:
            _is_work(tw, VarcommWork)
            assert tw.synchronize(30) is None and tw.is_completed() and tw.wait() is True
        assert out.tolist() == [float(peer)] * 5
        # and what torch.distributed itself hands back for it
        tw = dist.isend(torch.ones(2), dst=peer, tag=4)
        _is_work(tw)
        assert dist.irecv(torch.zeros(2), src=peer, tag=4).wait() is True
        tw.synchronize()
        assert tw.is_completed()
    finally:
        vdist.destroy_process_group()


@world(2, timeout=60)
def test_a_timed_out_work_keeps_its_error_and_the_channel_stays_usable():
    """After wait(timeout) raises, the Work is over: is_completed() is True and
    every later wait()/result() raises the same TimeoutError (not an unknown-
    request error); the cancelled receive takes no message."""
    import pytest

    with varcomm.init(timeout=30, array="numpy") as comm:
        if comm.rank == 1:
            w = comm.irecv(0, tag=5)
            with pytest.raises(varcomm.TimeoutError) as first:
                w.wait(timeout=0.3)
            assert w.is_completed()
            for again in (w.wait, w.result, w.synchronize):
                with pytest.raises(varcomm.TimeoutError) as e:
                    again()
                assert e.value is first.value
        comm.barrier()
        if comm.rank == 0:
            comm.send(np.arange(3), 1, tag=5)
        else:
            assert comm.recv(0, tag=5).tolist() == [0, 1, 2]


@world(2, timeout=60)
def test_a_barrier_that_times_out_raises_varcomm_timeout():
    import time

    import pytest

    with varcomm.init(timeout=1) as comm:
        if comm.rank == 0:
            with pytest.raises(varcomm.TimeoutError, match=r"barrier: 1 of 2 ranks arrived within 1 s"):
                comm.barrier()
        else:
            time.sleep(1.5)
            comm.barrier()  # rank 0's arrival still counts: this one passes
