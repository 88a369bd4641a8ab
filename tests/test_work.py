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


@world(3, timeout=60)
def test_a_barrier_timeout_names_the_ranks_still_missing():
    """Rank 1 arrived, rank 2 did not: the text said '1 of 3 ranks arrived;
    missing: ranks 1, 2' (the records were read only once all were in)."""
    import time

    import pytest

    with varcomm.init(timeout=1) as comm:
        if comm.rank == 0:
            with pytest.raises(varcomm.TimeoutError,
                               match=r"barrier: 2 of 3 ranks arrived within 1 s.*missing: rank 2$"):
                comm.barrier()
        elif comm.rank == 1:
            with pytest.raises(varcomm.TimeoutError, match=r"missing: rank 2$"):
                comm.barrier()
        else:
            time.sleep(1.5)
            comm.barrier()


@world(3, timeout=60)
def test_a_barrier_completes_for_the_others_when_rank_0_gave_up_on_it():
    """Rank 0 reads the arrivals and says when all are in; rank 0's barrier
    timed out (rank 2 was late) and it went on: ranks 1 and 2 waited for
    rank 0's word until their own timeout (a review). Now rank 0 says it gave
    up, and they read the arrivals themselves."""
    import time

    import pytest

    with varcomm.init(timeout=30) as comm:
        t0 = time.monotonic()
        if comm.rank == 0:
            with pytest.raises(varcomm.TimeoutError):
                comm.barrier(timeout=1)
            time.sleep(6)  # (alive, doing something else)
        else:
            if comm.rank == 2:
                time.sleep(2)
            comm.barrier(timeout=20)
            assert time.monotonic() - t0 < 5, time.monotonic() - t0


def test_a_strided_copy_in_waits_for_the_stream_its_message_lands_on(monkeypatch):
    """A receive into a non-contiguous CUDA tensor over a device route lands in
    a contiguous stand-in on the stream current when it was posted; its copy
    in (P2PWork._then, varcomm.distributed's _CopyInto) must be ordered after
    that stream. wait() ran the copy before it made the current stream wait
    for the posting one, and a dropped Work settled later never waited: with
    post and wait on different streams the copy read the stand-in before the
    message was in it. (Fakes stand in for CUDA streams: torch here is CPU-only.)"""
    from varcomm import arrays
    from varcomm.comm import Communicator, P2PWork

    events: list[tuple[str, ...]] = []

    class Stream:
        device = "cuda:0"

        def __init__(self, name: str):
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            events.append(("wait", self.name, other.name))

    posted, current = Stream("posted"), Stream("current")
    monkeypatch.setattr(arrays.torch.cuda, "current_stream", lambda device=None: current)

    class Core:
        def wait(self, rid, timeout): pass
        def test(self, rid): return True

    class Comm:
        _timeout = None
        _closed = False
        _c = Core()
        _settle_orphans = Communicator._settle_orphans

        def __init__(self):
            self._orphans: list = []

    def copy_in(got):
        events.append(("copy", got))
        return got

    comm = Comm()
    w = P2PWork(comm, 7, lambda: "stand-in", 0, "recv", None, posted)._then(copy_in)  # type: ignore[arg-type]
    assert w.wait() == "stand-in"
    assert events.index(("wait", "current", "posted")) < events.index(("copy", "stand-in")), events

    events.clear()
    w = P2PWork(comm, 8, lambda: "stand-in", 0, "recv", None, posted)._then(copy_in)  # type: ignore[arg-type]
    del w  # dropped: settled by the next call
    assert len(comm._orphans) == 1
    comm._settle_orphans()
    assert ("copy", "stand-in") in events, events
    assert ("wait", "current", "posted") in events, events
    assert events.index(("wait", "current", "posted")) < events.index(("copy", "stand-in")), events
