"""The "varcomm" backend of torch.distributed, and varcomm.distributed."""
from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch._dynamo  # functional collectives import it on first use: once here, not in every rank
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import varcomm
import varcomm.torch  # registers the backend
from varcomm.integrations.torch_backend import VarcommProcessGroup, comm_of, placeholder
from varcomm.testing import rank, world

SMALL_BOUND = str(64 * 1024)  # small receive slots, so messages over the bound (rendezvous) are cheap to test


def _spy(comm, calls, names=("isend", "irecv")):
    """Count what goes through a Communicator's isend/irecv (or other methods)."""
    for name in names:
        real = getattr(comm, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        setattr(comm, name, spy)


@world(2, timeout=60)
def test_send_recv_exact_sizes_and_refusals():
    os.environ["VARCOMM_BOUND"] = SMALL_BOUND
    dist.init_process_group("varcomm")
    try:
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, VarcommProcessGroup) and dist.get_backend() == "varcomm"
        assert pg.comm.bound == 64 * 1024
        calls: list[str] = []
        _spy(pg.comm, calls)
        r = dist.get_rank()
        big = torch.arange(100_000, dtype=torch.float64)  # 800 KB: a header and 13 chunks of 64 KiB
        cases = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor(7, dtype=torch.int64),
                 torch.tensor([True, False, True]), torch.randn(5, dtype=torch.bfloat16), torch.empty(0, 3), big]
        if r == 0:
            for c in cases:
                dist.send(c, dst=1)
            dist.isend(torch.full((6,), 2.5), dst=1, tag=3).wait()
            dist.send(torch.ones(5), dst=1)  # refused by a 4-element recv, then received properly
            dist.send(torch.ones(3), dst=1)  # refused by a 4-element recv (too small)
            dist.send(torch.ones(4, dtype=torch.int32), dst=1)  # refused: dtype
            dist.send(big, dst=1)  # over the bound (rendezvous), refused by a small recv
            dist.send(torch.ones(4), dst=1)  # into a non-contiguous tensor
        else:
            for c in cases:
                got = torch.full_like(c, 0) if c.numel() else torch.empty_like(c)
                assert dist.recv(got, src=0) == 0
                assert torch.equal(got, c), (got, c)
            x = torch.zeros(6)
            w = dist.irecv(x, src=0, tag=3)
            assert isinstance(w, dist.Work) and w.wait() is True and x.tolist() == [2.5] * 6
            with pytest.raises(RuntimeError, match=r"shape \(4,\).*16 bytes.*larger.*20 bytes"):
                dist.recv(torch.zeros(4), src=0)
            y = torch.zeros(5)
            dist.recv(y, src=0)  # the refused message was kept
            assert y.tolist() == [1.0] * 5
            four = torch.full((4,), -1.0)
            with pytest.raises(RuntimeError, match=r"16 bytes.*12 bytes does not fill out \(16 bytes\) exactly.*kept"):
                dist.recv(four, src=0)
            assert four.tolist() == [-1.0] * 4  # refused before anything was written
            three = torch.zeros(3)
            dist.recv(three, src=0)  # the refused message was kept
            assert three.tolist() == [1.0] * 3
            with pytest.raises(RuntimeError, match="does not match it.*int32 does not match.*float32"):
                dist.recv(torch.zeros(4), src=0)
            assert dist.recv(torch.zeros(4, dtype=torch.int32), src=0) == 0  # the kept int32 message
            with pytest.raises(RuntimeError, match=r"larger.*800000 bytes does not fit out \(80 bytes\).*kept"):
                dist.recv(torch.zeros(10, dtype=torch.float64), src=0)
            assert torch.equal(pg.comm.recv(0), big)  # kept, as every refused message is: drop it
            z = torch.zeros(4, 2)[:, 0]
            dist.recv(z, src=0)
            assert z.tolist() == [1.0] * 4
        assert calls and all(c in ("isend", "irecv") for c in calls), "p2p did not go through varcomm"
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_large_receives_waited_out_of_order_get_their_own_messages():
    """Receives posted together from one source and tag, messages over the bound
    among them, waited last first: each gets its own message (a rendezvous
    message's data streams by its own sequence number, never by tag)."""
    os.environ["VARCOMM_BOUND"] = SMALL_BOUND
    dist.init_process_group("varcomm")
    try:
        msgs = [torch.arange(40_000, dtype=torch.float64), torch.arange(30_000, dtype=torch.float64) + 0.5,
                torch.full((16_384,), 7.0, dtype=torch.float32), torch.arange(50_000, dtype=torch.float32) - 3]
        if dist.get_rank() == 0:
            works = [dist.isend(m, dst=1) for m in msgs + msgs]
            for w in works:
                w.wait()
        else:
            outs = [torch.empty_like(m) for m in msgs]
            works = [dist.irecv(o, src=0) for o in outs]  # 2 chunked, one exactly the bound, 1 chunked
            holders = [placeholder() for _ in msgs]
            pworks = [dist.irecv(h, src=0) for h in holders]
            for w in reversed(works + pworks):
                w.wait()
            for m, o, h in zip(msgs, outs, holders):
                assert torch.equal(o, m), (o[:4], m[:4])
                assert torch.equal(h, m), (h.shape, m.shape)
    finally:
        dist.destroy_process_group()


@world(2, timeout=90)
def test_large_refusal_timeout_and_bounds_leave_the_channel_right():
    """Messages over the bound: one smaller than the tensor is refused and
    kept (as below the bound); a wait that times out before its message came
    gives up that receive and the next one gets the message; a later receive's
    wait finishes an earlier one's; a receiver with a larger bound than the
    sender's gets the right bytes."""
    r = rank()
    os.environ["VARCOMM_BOUND"] = SMALL_BOUND if r == 0 else str(2 * 64 * 1024)  # rank 1 takes 128 KiB slots
    dist.init_process_group("varcomm")
    try:
        pg = dist.distributed_c10d._get_default_group()
        a = torch.full((3 * 16_384,), 1.0)  # 192 KiB: over rank 1's bound (128 KiB)
        b = torch.arange(70_000, dtype=torch.float32)  # 280 KB
        if r == 0:
            dist.send(a, dst=1)  # refused by rank 1 (wrong size), then
            dist.send(b, dst=1)  # received right
            pg.comm.recv(1, tag=9)  # rank 1 is waiting with a timeout: now send
            time.sleep(0.3)
            dist.send(b, dst=1)
            dist.send(a, dst=1, tag=4)
            dist.send(b, dst=1, tag=4)
            dist.recv(torch.empty(0), src=1, tag=5)
        else:
            assert pg.comm.peer_bound(0) == 64 * 1024
            big = torch.full((70_000,), -1.0)
            with pytest.raises(RuntimeError, match=r"196608 bytes does not fill out \(280000 bytes\) exactly.*kept"):
                dist.recv(big, src=0)  # smaller than the tensor: refused before anything is written, and kept
            assert bool((big == -1.0).all())
            kept = torch.empty_like(a)
            dist.recv(kept, src=0)
            assert torch.equal(kept, a)
            got = torch.empty(70_000)
            dist.recv(got, src=0)
            assert torch.equal(got, b)
            w = dist.irecv(torch.empty(70_000), src=0)
            pg.comm.send(torch.ones(1), 0, tag=9)
            with pytest.raises(varcomm.TimeoutError, match="nothing arrived"):
                w.wait(timeout=datetime.timedelta(seconds=0.05))
            got2 = torch.empty(70_000)
            dist.recv(got2, src=0)  # the given-up receive took nothing
            assert torch.equal(got2, b)
            ga, gb = torch.empty_like(a), torch.empty_like(b)
            wa, wb = dist.irecv(ga, src=0, tag=4), dist.irecv(gb, src=0, tag=4)
            wb.wait()
            assert wa.wait() and torch.equal(ga, a) and torch.equal(gb, b)
            dist.send(torch.empty(0), dst=0, tag=5)
    finally:
        dist.destroy_process_group()


@world(4, timeout=60)
def test_batch_ring_all_to_all_barrier_and_delegated_collectives():
    dist.init_process_group("varcomm")
    try:
        r, n = dist.get_rank(), dist.get_world_size()
        pg = dist.distributed_c10d._get_default_group()
        calls: list[str] = []
        _spy(pg.comm, calls, ("batch_isend_irecv",))
        # a ring in both directions, one batch
        right, left = torch.full((3,), float(r)), torch.full((2, 2), -float(r))
        from_left, from_right = torch.zeros(3), torch.zeros(2, 2)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.irecv, from_left, (r - 1) % n), dist.P2POp(dist.isend, right, (r + 1) % n),
            dist.P2POp(dist.isend, left, (r - 1) % n), dist.P2POp(dist.irecv, from_right, (r + 1) % n)])
        assert [w.wait() for w in works] == [True] * 4
        assert from_left.tolist() == [float((r - 1) % n)] * 3
        assert (from_right == -float((r + 1) % n)).all()
        assert calls == ["batch_isend_irecv"]
        # all_to_all_single: equal splits, then uneven ones (rank r sends d+1 rows to rank d)
        out = torch.zeros(n, dtype=torch.int64)
        dist.all_to_all_single(out, torch.arange(n) + 10 * r)
        assert out.tolist() == [10 * s + r for s in range(n)]
        in_splits = [d + 1 for d in range(n)]
        x = torch.cat([torch.full((d + 1, 2), 100 * r + d) for d in range(n)])
        out2 = torch.zeros((r + 1) * n, 2, dtype=torch.int64)
        dist.all_to_all_single(out2, x, [r + 1] * n, in_splits)
        assert out2[:, 0].tolist() == [100 * s + r for s in range(n) for _ in range(r + 1)]
        w = dist.all_to_all_single(out, torch.arange(n) * r, async_op=True)
        assert w.wait() and out.tolist() == [s * r for s in range(n)]
        outs = [torch.zeros(s + 1) for s in range(n)]
        dist.all_to_all(outs, [torch.full((r + 1,), float(r)) for _ in range(n)])
        assert [o.tolist() for o in outs] == [[float(s)] * (s + 1) for s in range(n)]
        got = fc.wait_tensor(fc.all_to_all_single(torch.arange(n) + 10 * r, None, None, pg))
        assert got.tolist() == [10 * s + r for s in range(n)]
        dist.barrier()
        # what varcomm does not do: gloo underneath
        t = torch.tensor([float(r)])
        dist.all_reduce(t)
        assert t.item() == sum(range(n))
        g = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(g, torch.tensor([float(r)]))
        assert [v.item() for v in g] == list(map(float, range(n)))
        b = torch.tensor([float(r)])
        dist.broadcast(b, src=2)
        assert b.item() == 2.0
        objs: list = [None] * n
        dist.all_gather_object(objs, {"rank": r})
        assert objs == [{"rank": s} for s in range(n)]
        assert fc.wait_tensor(fc.all_reduce(torch.ones(2), "sum", pg)).tolist() == [float(n)] * 2
    finally:
        dist.destroy_process_group()


@world(4, timeout=60)
def test_new_group_and_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        # Groups made one after another: ranks 2 and 3 are not in the first, so they make
        # fewer communicators than ranks 0 and 1 before the third.
        g01 = dist.new_group([0, 1])
        g23 = dist.new_group([2, 3])
        g02 = dist.new_group([0, 2])
        mine = g01 if r < 2 else g23
        assert isinstance(mine, VarcommProcessGroup) and comm_of(mine).world_size == 2
        assert comm_of(mine).rank == dist.get_group_rank(mine, r)
        peer = r ^ 1
        got = torch.zeros(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(r)), peer, mine),
                                        dist.P2POp(dist.irecv, got, peer, mine)])
        for w in works:
            w.wait()
        assert got.tolist() == [float(peer)] * 2
        if r in (0, 2):
            x = torch.zeros(3)
            if r == 0:
                dist.send(torch.arange(3.0), group=g02, group_dst=1)
            else:
                dist.recv(x, group=g02, group_src=0)
                assert x.tolist() == [0.0, 1.0, 2.0]
            t = torch.tensor([1.0])
            dist.all_reduce(t, group=g02)
            assert t.item() == 2.0
        dist.barrier(group=mine)

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
        assert isinstance(pp, VarcommProcessGroup) and isinstance(dp, VarcommProcessGroup)
        me = mesh.get_local_rank("pp")
        nxt = torch.zeros(1)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, torch.tensor([float(r)]), group=pp, group_peer=1 - me),
            dist.P2POp(dist.irecv, nxt, group=pp, group_peer=1 - me)])
        for w in works:
            w.wait()
        assert nxt.item() == float(dist.get_global_rank(pp, 1 - me))
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=dp)
        assert t.item() == float(sum(dist.get_process_group_ranks(dp)))
        out = torch.zeros(2)
        dist.all_to_all_single(out, torch.tensor([float(r), float(r)]), group=dp)
        assert out.tolist() == [float(g) for g in dist.get_process_group_ranks(dp)]
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_device_mesh_1d():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("varcomm")
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = mesh.get_group()
        assert isinstance(g, VarcommProcessGroup)
        r = dist.get_rank()
        if r == 0:
            dist.send(torch.tensor([5, 6]), dst=1, group=g)
        else:
            x = torch.zeros(2, dtype=torch.int64)
            dist.recv(x, src=0, group=g)
            assert x.tolist() == [5, 6]
    finally:
        dist.destroy_process_group()


def test_varcomm_distributed_submodules_are_torchs():
    """The docstring says `import varcomm.distributed as dist  # was: import
    torch.distributed as dist`, so users rewrite torch.distributed.X too: the
    module showed torch's __path__, and `import varcomm.distributed.X` made a
    second copy of torch's module (a DeviceMesh class of its own; pipelining
    raised RuntimeError registering its operators twice). A missing one is
    ModuleNotFoundError under the name asked for; a missing dst says send."""
    import importlib
    import subprocess
    import sys

    import torch.distributed.device_mesh
    import torch.distributed.pipelining.schedules

    import varcomm.distributed

    mesh = importlib.import_module("varcomm.distributed.device_mesh")
    assert mesh is torch.distributed.device_mesh and mesh.DeviceMesh is torch.distributed.device_mesh.DeviceMesh
    assert importlib.import_module("varcomm.distributed.pipelining.schedules") is torch.distributed.pipelining.schedules
    assert torch.distributed.pipelining.schedules.__spec__.name == "torch.distributed.pipelining.schedules"  # (kept)
    assert importlib.import_module("varcomm.integrations.distributed.device_mesh") is torch.distributed.device_mesh
    with pytest.raises(ModuleNotFoundError, match="varcomm.distributed.nope"):
        importlib.import_module("varcomm.distributed.nope")
    # (a fresh process: pipelining's operators register at its first import)
    p = subprocess.run([sys.executable, "-c", "from varcomm.distributed.pipelining import PipelineStage; "
                        "import torch.distributed.pipelining as t; assert PipelineStage is t.PipelineStage"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    with pytest.raises(ValueError, match="dst is required: a send names its destination"):
        varcomm.distributed.send(torch.ones(1), None)


@world(2, timeout=60)
def test_varcomm_distributed_module():
    import varcomm.distributed as vdist

    vdist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        r = vdist.get_rank()
        assert vdist.get_world_size() == 2 and dist.get_backend() == "varcomm"
        if r == 0:
            for n in (3, 17, 4, 0):
                vdist.send(torch.arange(n * 2, dtype=torch.float32).reshape(n, 2), dst=1)
            vdist.send(torch.ones(5, dtype=torch.int16), dst=1)
            vdist.isend(torch.tensor([1, 2, 3]), dst=1, tag=4).wait()
        else:
            for n in (3, 17):
                got = vdist.recv(src=0)  # the size is the sender's
                assert got.shape == (n, 2) and torch.equal(got, torch.arange(n * 2.0).reshape(n, 2))
            buf = torch.full((64,), -1.0)
            v = vdist.recv(buf, src=0)  # a bound-sized buffer: a prefix view
            assert v.shape == (4, 2) and v.data_ptr() == buf.data_ptr() and buf[8] == -1.0
            assert v.flatten().tolist() == list(map(float, range(8)))
            assert vdist.recv(src=0).shape == (0, 2)
            assert vdist.recv(src=0).tolist() == [1] * 5
            assert vdist.irecv(src=0, tag=4).wait().tolist() == [1, 2, 3]
        works = vdist.batch_isend_irecv([vdist.P2POp(vdist.irecv, None, 1 - r),
                                         vdist.P2POp(dist.isend, torch.full((r + 2,), float(r)), 1 - r)])
        assert works[0].wait().tolist() == [float(1 - r)] * (3 - r)
        works[1].wait()
        x = torch.arange(3 + r, dtype=torch.float32)  # rank 0 keeps 1 row and sends 2; rank 1 keeps 1, sends 3
        recvd, splits = vdist.all_to_all_v(x.unsqueeze(1), [1, 2] if r == 0 else [3, 1])
        assert splits == ([1, 3] if r == 0 else [2, 1])
        assert recvd.squeeze(1).tolist() == ([0.0, 0.0, 1.0, 2.0] if r == 0 else [1.0, 2.0, 3.0])
        out = torch.zeros(2)
        vdist.all_to_all_single(out, torch.tensor([float(r), 10.0 + r]))
        assert out.tolist() == ([0.0, 1.0] if r == 0 else [10.0, 11.0])
        t = torch.ones(1)
        vdist.all_reduce(t)  # not ours: torch.distributed's, on gloo underneath
        assert t.item() == 2.0
        vdist.barrier()
        g = vdist.new_group([0, 1])
        if r == 0:
            vdist.send(torch.tensor([42]), group=g, group_dst=1)
        else:
            assert vdist.recv(group=g, src=0).tolist() == [42]
    finally:
        vdist.destroy_process_group()
    assert not dist.is_initialized() and not vdist.is_initialized()


@world(2, timeout=90)
def test_recv_into_strided_tensor_is_exact_and_keeps_refused_messages():
    """A non-contiguous destination gets exactly the message (same dtype, same
    number of elements; another shape of that size is accepted, as torch
    does) on the varcomm backend and in varcomm.distributed; another dtype or
    size is refused naming both, before the tensor is written, and the message
    waits for the next receive."""
    import varcomm.distributed as vdist

    os.environ["VARCOMM_BOUND"] = SMALL_BOUND
    vdist.init_process_group("gloo")
    try:
        big = torch.arange(40_000, dtype=torch.float64)  # 320 KB: over the bound, by rendezvous

        def strided(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.full((rows, 8), -1, dtype=dtype)[:, ::2]

        if dist.get_rank() == 0:
            for _ in range(2):  # once for dist.recv, once for varcomm.distributed
                dist.send(torch.arange(16, dtype=torch.float32), dst=1)
                dist.send(torch.arange(16, dtype=torch.int64), dst=1)  # refused by float32, then taken
                dist.send(torch.arange(12, dtype=torch.float32), dst=1)  # refused by 16 elements, then taken
                dist.send(torch.arange(20, dtype=torch.float32), dst=1)  # refused by 16 elements, then taken
                dist.send(big, dst=1)
                dist.send(torch.arange(16, dtype=torch.float32) + 100, dst=1, tag=7)  # irecv
        else:
            def check(recv, irecv, refused: type[BaseException]) -> None:
                t = strided(4)
                recv(t)
                assert t.tolist() == torch.arange(16.0).reshape(4, 4).tolist()
                t = strided(4)
                with pytest.raises(refused, match=r"int64 does not match.*float32.*kept"):
                    recv(t)
                assert bool((t == -1).all())  # nothing was written (nor cast)
                ti = strided(4, torch.int64)
                recv(ti)
                assert ti.tolist() == torch.arange(16).reshape(4, 4).tolist()
                with pytest.raises(refused, match=r"48 bytes does not fill out \(64 bytes\).*kept"):
                    recv(t)
                assert bool((t == -1).all())
                t3 = strided(3)
                recv(t3)
                assert t3.flatten().tolist() == list(map(float, range(12)))
                with pytest.raises(refused, match=r"80 bytes does not fit out \(64 bytes\).*kept"):
                    recv(t)
                assert bool((t == -1).all())
                t5 = strided(5)
                recv(t5)
                assert t5.flatten().tolist() == list(map(float, range(20)))
                tb = torch.full((200, 400), -1.0, dtype=torch.float64)[:, ::2]
                recv(tb)
                assert torch.equal(tb.flatten(), big)
                t = strided(4)
                irecv(t)
                assert t.flatten().tolist() == [float(i + 100) for i in range(16)]

            check(lambda t: dist.recv(t, src=0), lambda t: dist.irecv(t, src=0, tag=7).wait(), RuntimeError)

            def vrecv(t: torch.Tensor) -> None:
                assert vdist.recv(t, src=0) is t

            def virecv(t: torch.Tensor) -> None:
                assert vdist.irecv(t, src=0, tag=7).wait() is t

            check(vrecv, virecv, varcomm.VarcommError)
    finally:
        vdist.destroy_process_group()


@world(2, timeout=90)
def test_batch_isend_irecv_is_one_communicator_call():
    """torch.distributed.batch_isend_irecv and varcomm.distributed's post a batch
    through one Communicator.batch_isend_irecv: ranks that both send then
    receive messages far over the bound finish with the data exact; a batch
    with a bad op, or ops of different groups, posts nothing, so the next
    receive still gets its message."""
    import varcomm.distributed as vdist

    os.environ["VARCOMM_BOUND"] = SMALL_BOUND
    vdist.init_process_group("gloo")
    try:
        r = dist.get_rank()
        peer = 1 - r
        batches: list[str] = []
        _spy(comm_of(), batches, ("batch_isend_irecv",))
        n = 1 << 20  # 4 MiB of float32: 64 times the bound
        big = torch.arange(n, dtype=torch.float32) + r
        got = torch.empty(n)
        rows = torch.full((64, 16), -1.0)[:, ::2]  # strided: received exactly
        holder = placeholder()
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, got, peer),
            dist.P2POp(dist.isend, torch.arange(512.0) * (r + 1), peer, tag=2),
            dist.P2POp(dist.irecv, rows, peer, tag=2),
            dist.P2POp(dist.isend, torch.ones(r + 2, 3), peer, tag=3), dist.P2POp(dist.irecv, holder, peer, tag=3)])
        assert [w.wait() for w in works] == [True] * 6
        assert torch.equal(got, torch.arange(n, dtype=torch.float32) + peer)
        assert rows.flatten().tolist() == (torch.arange(512.0) * (peer + 1)).tolist()
        assert holder.shape == (peer + 2, 3)
        assert batches == ["batch_isend_irecv"]

        vworks = vdist.batch_isend_irecv([vdist.P2POp(vdist.isend, big, peer), vdist.P2POp(vdist.irecv, None, peer),
                                          vdist.P2POp(vdist.irecv, rows, peer, tag=2),
                                          vdist.P2POp(vdist.isend, torch.arange(512.0) - r, peer, tag=2)])
        assert torch.equal(vworks[1].wait(), torch.arange(n, dtype=torch.float32) + peer)
        assert vworks[2].wait() is rows and rows.flatten().tolist() == (torch.arange(512.0) - peer).tolist()
        vworks[0].wait()
        vworks[3].wait()
        assert batches == ["batch_isend_irecv"] * 2

        g = dist.new_group([0, 1])
        with pytest.raises(RuntimeError, match="tag"):  # the irecv before the bad send is not left posted
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(3), peer),
                                    dist.P2POp(dist.isend, torch.ones(3), peer, tag=1 << 41)])
        with pytest.raises(ValueError, match="same group"):
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(3), peer),
                                    dist.P2POp(dist.isend, torch.ones(3), peer, group=g)])
        with pytest.raises(ValueError, match="same group"):
            vdist.batch_isend_irecv([vdist.P2POp(vdist.irecv, None, peer),
                                     vdist.P2POp(vdist.isend, torch.ones(3), peer, group=g)])
        # Nothing of those was posted: each message below goes to its own receive.
        for group in (None, g):
            w = dist.isend(torch.full((3,), float(r)), peer, group=group)
            back = torch.zeros(3)
            dist.irecv(back, peer, group=group).wait(timeout=datetime.timedelta(seconds=10))
            w.wait()
            assert back.tolist() == [float(peer)] * 3
    finally:
        vdist.destroy_process_group()


@world(2, timeout=120)
def test_reinit_on_one_store_gloo_then_varcomm_twice():
    """init_process_group, destroy, init again on one store (a store given
    with store=, as torchrun's agent store outlives groups): torch names the
    new group as the old one, and varcomm's set-up must not read the keys the
    earlier group left there."""
    import varcomm.distributed as vdist

    r = rank()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, r == 0,
                          timeout=datetime.timedelta(seconds=30))
    kw = {"store": store, "rank": r, "world_size": 2, "timeout": datetime.timedelta(seconds=30)}
    os.environ["VARCOMM_INIT_TIMEOUT"] = "20"  # a rendezvous that reads stale keys fails (or hangs) within it

    def exchange(step: int, send, recv) -> None:
        if r == 0:
            send(torch.arange(5.0) + step)
        else:
            assert recv().tolist() == (torch.arange(5.0) + step).tolist()

    def torch_p2p(step: int) -> None:
        y = torch.zeros(5)
        exchange(step, lambda x: dist.send(x, dst=1), lambda: (dist.recv(y, src=0), y)[1])

    dist.init_process_group("gloo", **kw)
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
    for step in (1, 2):  # varcomm.distributed's own communicator over torch's gloo default store
        vdist.init_process_group()
        exchange(step, lambda x: vdist.send(x, dst=1), lambda: vdist.recv(src=0))
        vdist.destroy_process_group()
    dist.destroy_process_group()
    for step in (3, 4):
        dist.init_process_group("varcomm", **kw)
        assert isinstance(dist.distributed_c10d._get_default_group(), VarcommProcessGroup)
        torch_p2p(step)
        g = dist.new_group([0, 1])  # a group with the same name as the earlier generation's
        t = torch.tensor([float(r + step)])
        dist.all_reduce(t, group=g)  # its gloo underneath
        assert t.item() == float(1 + 2 * step)
        dist.destroy_process_group()
    store.set(f"done/{r}", "1")
    if r == 0:  # the store lives in rank 0
        store.wait(["done/0", "done/1"])


@world(2, timeout=90)
def test_a_dropped_strided_irecv_still_fills_its_tensor():
    """varcomm.distributed.irecv into a non-contiguous tensor lands in a
    contiguous stand-in and is copied in: a Work dropped without wait() (its
    message still taken, as documented) left the tensor unwritten, the data
    lost in the stand-in. Now the copy runs by the next call (here a recv
    that follows it from the same peer); batch_isend_irecv's alike."""
    import gc

    import varcomm.distributed as vdist

    vdist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            for k in range(3):
                vdist.send(torch.arange(16, dtype=torch.float32) + 100 * k, dst=1)
                vdist.send(torch.tensor([k]), dst=1)
            vdist.send(torch.arange(4, dtype=torch.float32), dst=1)
            for k in (3, 4):  # polled
                vdist.send(torch.arange(16, dtype=torch.float32) + 100 * k, dst=1)
        else:
            t = torch.full((4, 8), -1.0)[:, ::2]
            w = vdist.irecv(t, src=0)
            del w
            gc.collect()
            assert vdist.recv(src=0).tolist() == [0]
            assert t.flatten().tolist() == list(map(float, range(16)))
            t = torch.full((4, 8), -1.0)[:, ::2]
            works = vdist.batch_isend_irecv([vdist.P2POp(vdist.irecv, t, 0)])
            del works
            gc.collect()
            assert vdist.recv(src=0).tolist() == [1]
            assert t.flatten().tolist() == [100.0 + i for i in range(16)]
            t = torch.full((4, 8), -1.0)[:, ::2]
            dist.irecv(t, src=0)  # the varcomm backend's Work, dropped
            gc.collect()
            assert vdist.recv(src=0).tolist() == [2]
            assert t.flatten().tolist() == [200.0 + i for i in range(16)]
            # Elements that share memory cannot hold a message: refused before it is taken.
            shared = torch.zeros(1).expand(4)
            for recv in (dist.recv, vdist.recv):
                with pytest.raises(varcomm.InvalidArgument, match="share memory"):
                    recv(shared, src=0)
            assert vdist.recv(src=0).tolist() == [0.0, 1.0, 2.0, 3.0]  # kept
            # is_completed() is True once the tensor holds the message (it was True before the copy in).
            for k, irecv in ((3, vdist.irecv), (4, dist.irecv)):
                t = torch.full((4, 8), -1.0)[:, ::2]
                w = irecv(t, src=0)
                deadline = time.monotonic() + 30
                while not w.is_completed():
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                assert t.flatten().tolist() == [100.0 * k + i for i in range(16)], k
                w.wait()
        vdist.barrier()
    finally:
        vdist.destroy_process_group()


@world(2, timeout=90)
def test_polling_an_async_all_to_all_work_ends():
    """dist.all_to_all_single / dist.all_to_all with async_op=True on the
    varcomm backend: a loop polling work.is_completed() (as torch users poll)
    ends once every pair's data is in; it stayed False until wait(), so such
    a loop never ended. A non-contiguous output holds the data by then, and a
    failed call reports is_completed() True and is_success() False."""
    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        x = torch.arange(4.0) + 10 * r
        want = [2.0 * r, 2.0 * r + 1, 10 + 2.0 * r, 11 + 2.0 * r]
        out, strided = torch.empty(4), torch.zeros(4, 2)[:, 0]
        outs = [torch.empty(2), torch.empty(2, 2)[:, 1]]
        works = [("all_to_all_single", dist.all_to_all_single(out, x, async_op=True)),
                 ("strided all_to_all_single", dist.all_to_all_single(strided, x, async_op=True)),
                 ("all_to_all", dist.all_to_all(outs, [x[:2], x[2:]], async_op=True))]
        for name, w in works:
            deadline = time.monotonic() + 15
            while not w.is_completed():
                assert time.monotonic() < deadline, f"{name}: is_completed() stayed False"
                time.sleep(0.001)
            assert w.is_success(), name
        assert out.tolist() == want and strided.tolist() == want
        assert outs[0].tolist() + outs[1].tolist() == want
        for _, w in works:
            w.wait()
        # A call that fails (rank 1's output rows disagree with what arrives) completes too.
        bad = torch.empty(5 if r == 1 else 4)
        w = dist.all_to_all_single(bad, x, [3, 2] if r == 1 else None, [2, 2], async_op=True)
        deadline = time.monotonic() + 15
        while not w.is_completed():
            assert time.monotonic() < deadline, "a failed call: is_completed() stayed False"
            time.sleep(0.001)
        if r == 1:
            assert not w.is_success()
            with pytest.raises(varcomm.MessageMismatch):
                w.wait()
        else:
            w.wait()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@world(2, timeout=90)
def test_a_dropped_async_all_to_all_still_fills_a_strided_output():
    """dist.all_to_all_single / dist.all_to_all with async_op=True into a
    non-contiguous output, the Work dropped without wait(): the call still
    completes (as documented for a dropped all-to-all Work) and the output
    holds the data, as a dropped strided irecv's tensor does; it was left
    unwritten, the data lost in the contiguous stand-in."""
    import gc

    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        x = torch.arange(4.0) + 10 * r
        want = [2.0 * r, 2.0 * r + 1, 10 + 2.0 * r, 11 + 2.0 * r]
        strided = torch.zeros(4, 2)[:, 0]
        outs = [torch.zeros(2, 2)[:, 1], torch.zeros(2)]
        dist.all_to_all_single(strided, x, async_op=True)
        dist.all_to_all(outs, [x[:2], x[2:]], async_op=True)
        gc.collect()
        deadline = time.monotonic() + 15
        while strided.tolist() != want or outs[0].tolist() + outs[1].tolist() != want:
            assert time.monotonic() < deadline, (strided, outs)
            time.sleep(0.01)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@world(2, timeout=90)
def test_varcomm_distributed_works_on_torchs_varcomm_default_group():
    """After torch.distributed.init_process_group("varcomm") alone, the
    varcomm.distributed functions use that default group; they raised "not
    initialized" (a second init of varcomm.distributed was needed)."""
    import varcomm.distributed as vdist

    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        assert vdist.is_initialized() and vdist.get_rank() == r and vdist.get_world_size() == 2
        got, splits = vdist.all_to_all_v(torch.arange(3.0) + 10 * r, [1, 2] if r == 0 else [2, 1])
        assert splits == ([1, 2] if r == 0 else [2, 1])
        assert got.tolist() == ([0.0, 10.0, 11.0] if r == 0 else [1.0, 2.0, 12.0])
        if r == 0:
            vdist.send(torch.arange(5), dst=1)
        else:
            assert vdist.recv(src=0).tolist() == list(range(5))
    finally:
        dist.destroy_process_group()
    assert not vdist.is_initialized()


@pytest.mark.parametrize("backend", ["gloo", "varcomm"])
@world(2, timeout=90)
def test_varcomm_init_after_torch_distributed_uses_its_store(backend):
    """varcomm.init() after init_process_group (nccl or gloo first, as in
    Megatron, or varcomm) takes torch's default store, rank and size: it bound
    MASTER_PORT again and failed with "a store already answers there"."""
    dist.init_process_group(backend)
    try:
        c = varcomm.init()
        try:
            r = dist.get_rank()
            assert (c.rank, c.world_size) == (r, 2)
            if r == 0:
                c.send(torch.arange(4.0), 1)
            else:
                assert c.recv(0).tolist() == [0.0, 1.0, 2.0, 3.0]
            dist.barrier()  # torch's group still works beside it
        finally:
            c.close()
    finally:
        dist.destroy_process_group()


@world(3, timeout=90)
def test_varcomm_init_after_subgroups_on_some_ranks():
    """Ranks 0 and 1 use a varcomm subgroup (a communicator rank 2 never
    makes) before varcomm.init(): init's keys in torch's store were named by
    every communicator the process had made, so the ranks looked for each
    other under different prefixes and never met."""
    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        g = dist.new_group([0, 1])
        if r < 2:
            dist.all_reduce(torch.ones(1), group=g)  # (the subgroup's communicator is made on first use)
        c = varcomm.init(init_timeout=20)
        try:
            assert (c.rank, c.world_size) == (r, 3)
            if r == 0:
                c.send(torch.arange(3.0), 2)
            elif r == 2:
                assert c.recv(0).tolist() == [0.0, 1.0, 2.0]
        finally:
            c.close()
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_float_bool_and_str_ranks_are_refused_by_varcomm_distributed_and_batches():
    """varcomm.distributed and the backend's batch_isend_irecv took int(peer):
    dst=1.7, "1" and True reached rank 1, src=0.5 received from rank 0. Each
    is InvalidArgument naming the argument, as comm.send and dist.send say."""
    import varcomm.distributed as vdist

    dist.init_process_group("varcomm")
    try:
        r = dist.get_rank()
        for bad in (1.7 - r, str(1 - r), bool(1 - r)):
            with pytest.raises(varcomm.InvalidArgument, match="(dst|src) must be an int rank"):
                if r == 0:
                    vdist.send(torch.ones(2), dst=bad)
                else:
                    vdist.recv(src=bad)
            with pytest.raises(varcomm.InvalidArgument, match="group_dst must be an int rank"):
                vdist.send(torch.ones(2), group_dst=bad)
            with pytest.raises(varcomm.InvalidArgument, match="P2POp (group_)?peer must be an int rank"):
                op = dist.P2POp(dist.isend if r == 0 else dist.irecv, torch.ones(2), 1 - r)
                op.peer = bad
                if hasattr(op, "group_peer"):
                    op.group_peer = bad
                dist.batch_isend_irecv([op])
        dist.barrier()  # nothing was sent
        if r == 0:
            vdist.send(torch.arange(2.0), dst=1)
        else:
            assert vdist.recv(src=0).tolist() == [0.0, 1.0]
    finally:
        dist.destroy_process_group()


@world(3, timeout=60)
def test_a_rank_outside_a_group_is_told_so():
    """vdist.send(..., group=g) on a rank that is not in g said "group -100 is
    not on the varcomm backend: make it with new_group()", which it was."""
    import varcomm.distributed as vdist

    dist.init_process_group("varcomm")
    try:
        g = dist.new_group([1, 2])
        if dist.get_rank() == 0:
            with pytest.raises(ValueError, match="not a member of the group"):
                vdist.send(torch.ones(1), dst=2, group=g)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["env", "pg_options"])
@world(2, timeout=60)
def test_a_varcomm_timeout_set_by_the_user_bounds_the_backends_waits(how):
    """VARCOMM_TIMEOUT=2 (or pg_options with timeout=2) under
    init_process_group("varcomm"), whose own timeout defaults to 30 minutes:
    a recv from a peer that sends nothing raised after torch's 30 minutes,
    the varcomm setting silently ignored. It raises within seconds now."""
    import varcomm

    kw: dict = {}
    if how == "env":
        os.environ["VARCOMM_TIMEOUT"] = "2"
    else:
        kw["pg_options"] = varcomm.Options.resolve(timeout=2)
    dist.init_process_group("varcomm", **kw)
    try:
        if dist.get_rank() == 0:
            t0 = time.monotonic()
            with pytest.raises(varcomm.TimeoutError):
                dist.recv(torch.zeros(3), src=1)
            assert time.monotonic() - t0 < 10
        dist.distributed_c10d._get_default_group().comm.barrier(timeout=20)  # (rank 1 waits out rank 0's 2 s)
        dist.barrier()  # the channel stays usable
    finally:
        dist.destroy_process_group()


def test_a_varcomm_timeout_set_to_its_default_still_counts_as_set():
    """VARCOMM_TIMEOUT=600 (the default's value) or Options.resolve(timeout=600)
    is a timeout the user set: it wins over the group's; left unset, the
    group's timeout applies (600 was taken for unset: torch's 30 minutes won)."""
    from varcomm.integrations.torch_backend import _wait_timeout
    from varcomm.options import Options

    group = datetime.timedelta(seconds=1800)
    assert _wait_timeout(Options.resolve({"VARCOMM_TIMEOUT": "600"}), group) == 600
    assert _wait_timeout(Options.resolve({}, timeout=600), group) == 600
    assert _wait_timeout(Options.resolve({}).override(timeout=600), group) == 600
    assert _wait_timeout(Options.resolve({"VARCOMM_TIMEOUT": "none"}), group) is None
    assert _wait_timeout(Options.resolve({}), group) == 1800
    assert _wait_timeout(Options.resolve({}).override(bound=1 << 20), group) == 1800
    assert _wait_timeout(Options(timeout=5), group) == 5  # built directly: a value other than the default
