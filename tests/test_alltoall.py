"""Variable-size all-to-all (varcomm.collectives.alltoall), on every transport this build
has and on the fallback, on 2, 3 and 4 ranks. Every rank can rebuild every
other rank's input from the seed, so each result is checked byte-for-byte
against a single-process reference."""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS, make_tensor, same_bytes
from varcomm.collectives import alltoall as A
from varcomm.testing import seeded, world

BOUND = 64 * 1024
# Every transport, plus shm running the conventional two-phase algorithm (counts
# first, then payload: what the fallback runs) so that path is checked natively too.
MODES = TRANSPORTS + ["shm/two-phase"]


def _init(mode: str, **kw):
    transport, _, algorithm = mode.partition("/")
    return varcomm.init(transport=transport, a2a_algorithm=algorithm or "auto", **kw)


def _x(seed: int, it: int, src: int, rows: int, trailing: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
    return make_tensor(dt, (rows,) + trailing, seed=hash((seed, it, src)) & 0x7FFFFFFF)


def _reference(seed: int, it: int, splits: np.ndarray, me: int, trailing: tuple[int, ...],
               dt: torch.dtype) -> torch.Tensor:
    """What rank `me` must receive: rows from every source, in source order."""
    parts = []
    for s in range(splits.shape[0]):
        x = _x(seed, it, s, int(splits[s].sum()), trailing, dt)
        off = int(splits[s, :me].sum())
        parts.append(x[off:off + int(splits[s, me])])
    return torch.cat(parts)


def _check(got, want: torch.Tensor, recv_splits, splits: np.ndarray, me: int, what: str) -> None:
    assert list(recv_splits) == splits[:, me].tolist(), (what, recv_splits, splits[:, me])
    assert same_bytes(got, want), f"{what}: payload differs from the single-process reference"


def _random_splits(g: np.random.Generator, n: int, max_rows: int) -> np.ndarray:
    m = g.integers(0, max_rows + 1, size=(n, n))
    m[g.random((n, n)) < 0.3] = 0  # plenty of empty chunks
    return m


CASES = [(torch.float32, (3,)), (torch.bfloat16, (2, 5)), (torch.int64, ()), (torch.uint8, (7,))]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("transport", MODES)
def test_random_splits_match_reference(transport, n):
    @world(n, timeout=120)
    def body():
        seed = seeded()
        iters = 24 if transport != "fallback" else 8
        with _init(transport, bound=BOUND, slots=4, timeout=60) as comm:
            r = comm.rank
            for it in range(iters):
                g = np.random.default_rng([seed, it])
                dt, trailing = CASES[it % len(CASES)]
                splits = _random_splits(g, n, 40)
                x = _x(seed, it, r, int(splits[r].sum()), trailing, dt)
                want = _reference(seed, it, splits, r, trailing, dt)
                mode = it % 4
                sp = splits[r].tolist() if it % 2 else torch.tensor(splits[r])
                if mode == 0:  # plain, splits as a CPU tensor
                    got, rs = A.all_to_all_v(comm, x, sp)
                    assert isinstance(got, torch.Tensor)
                elif mode == 1:  # into a bound-sized out: a view of its prefix
                    out = torch.full((BOUND // x.element_size(),), 0, dtype=dt)
                    got, rs = A.all_to_all_v(comm, x, sp, out=out)
                    assert got.data_ptr() == out.data_ptr() or got.numel() == 0
                elif mode == 2:  # async
                    work = A.all_to_all_v(comm, x, sp, async_op=True)
                    got, rs = work.wait()
                    assert work.is_completed()
                else:  # numpy in, numpy out (bfloat16 has no numpy dtype: go through uint8 rows)
                    if dt == torch.bfloat16:
                        xn = x.view(torch.uint8).numpy()
                        got_n, rs = A.all_to_all_v(comm, xn, sp)
                        got = torch.from_numpy(got_n).view(dt)
                    else:
                        got_n, rs = A.all_to_all_v(comm, x.numpy(), sp)
                        assert isinstance(got_n, np.ndarray)
                        got = torch.from_numpy(got_n)
                _check(got, want, rs, splits, r, f"seed {seed} iteration {it} mode {mode}")

    body()


@pytest.mark.parametrize("transport", MODES)
@world(4, timeout=120)
def test_skewed_zipf_and_all_to_one(transport):
    """MoE-like routing: token -> expert drawn from a Zipf law (one rank gets
    most tokens), then every token to one rank, then everything to itself."""
    seed = seeded()
    with _init(transport, bound=1 << 20, slots=4, timeout=60) as comm:
        r, n = comm.rank, comm.world_size
        hidden = 16
        for it in range(6):
            g = np.random.default_rng([seed, it])
            tokens = 512 if transport != "fallback" else 128
            splits = np.zeros((n, n), dtype=np.int64)
            for s in range(n):
                dest = np.minimum(g.zipf(1.6, size=tokens) - 1, 4 * n - 1) // 4  # 4 experts per rank
                splits[s] = np.bincount(dest, minlength=n)
            if it == 4:
                splits[:] = 0
                splits[:, 2] = tokens  # all to one
            if it == 5:
                splits[:] = np.diag([tokens] * n)  # everyone to itself
            x = _x(seed, it, r, tokens, (hidden,), torch.float32)
            got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
            _check(got, _reference(seed, it, splits, r, (hidden,), torch.float32), rs, splits, r,
                   f"seed {seed} iteration {it}")


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=120)
def test_many_iterations_changing_sizes_and_back_to_back(transport):
    """Sizes change every step; several collectives are in flight at once and
    waited on out of order; user point-to-point traffic on tag 0 in between
    never matches a collective."""
    seed = seeded()
    iters = 120 if transport != "fallback" else 20
    with _init(transport, bound=BOUND, slots=8, timeout=60) as comm:
        r, n = comm.rank, comm.world_size
        nxt, prv = (r + 1) % n, (r - 1) % n
        for it in range(0, iters, 3):
            works, wants = [], []
            p2p = comm.isend(torch.tensor([r, it]), nxt, tag=0)
            for k in range(3):
                g = np.random.default_rng([seed, it + k])
                splits = g.integers(0, 30, size=(n, n))
                x = _x(seed, it + k, r, int(splits[r].sum()), (4,), torch.float32)
                works.append(A.all_to_all_v(comm, x, splits[r].tolist(), async_op=True))
                wants.append((splits, _reference(seed, it + k, splits, r, (4,), torch.float32)))
            assert comm.recv(prv, tag=0).tolist() == [prv, it]
            p2p.wait()
            for k in (2, 0, 1):
                got, rs = works[k].wait()
                _check(got, wants[k][1], rs, wants[k][0], r, f"seed {seed} iteration {it + k}")


@pytest.mark.parametrize("transport", MODES)
@world(4, timeout=120)
def test_over_bound_chunks_travel_and_two_phase_refuses_them_everywhere(transport):
    """Rank 1's chunk for rank 3 is over rank 3's bound (by one row, then 20
    bounds' worth). One-phase: it travels by rendezvous like a point-to-point
    message and arrives whole (before, every such call raised: a MoE step
    failed once routing skewed). Two-phase (the count-first baseline, held to
    the bound): rank 1 raises MessageTooLarge (nothing written), rank 3
    MessageTooLarge naming rank 1, nobody hangs. Either way all ranks then run
    more collectives successfully."""
    bound = 4096
    two = transport.endswith("two-phase")
    with _init(transport, bound=bound, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size

        def splits_of(s: int, big: int) -> list[int]:
            sp = [2] * n
            if s == 1:
                sp[3] = big
            return sp

        for big in (bound // 4 + 1, 20 * bound // 4 + 3):
            x = torch.arange(sum(splits_of(r, big)), dtype=torch.float32) + 100000 * r
            if not two:
                got, rs = A.all_to_all_v(comm, x, splits_of(r, big))
                assert rs == [splits_of(s, big)[r] for s in range(n)]
                want = []
                for s in range(n):
                    sp = splits_of(s, big)
                    off = sum(sp[:r])
                    want.append(torch.arange(off, off + sp[r], dtype=torch.float32) + 100000 * s)
                assert torch.equal(got, torch.cat(want)), f"rank {r}: over-bound chunks arrived wrong"
            elif r == 1:
                with pytest.raises(varcomm.MessageTooLarge, match="rank 3") as ei:
                    A.all_to_all_v(comm, x, splits_of(r, big))
                assert ei.value.peer == 3
            elif r == 3:
                with pytest.raises(varcomm.MessageTooLarge, match="rank 1 could not send its chunk") as ei:
                    A.all_to_all_v(comm, x, splits_of(r, big))
                assert ei.value.peer == 1
            else:
                got, rs = A.all_to_all_v(comm, x, splits_of(r, big))  # unaffected pairs complete
                assert rs == [2] * n
            # The very next collective works on every rank, with the right data.
            y = torch.arange(n, dtype=torch.int64) + 10 * r
            got, rs = A.all_to_all_v(comm, y, [1] * n)
            assert rs == [1] * n and got.tolist() == [10 * s + r for s in range(n)]
        # The list form too.
        ins = [torch.full((bound // 8 + 1 if (r == 0 and d == 2) else 1,), r, dtype=torch.int64) for d in range(n)]
        if not two:
            outs = A.all_to_all(comm, None, ins)
            assert [o.tolist() for o in outs] == [[s] * (bound // 8 + 1 if (s == 0 and r == 2) else 1)
                                                  for s in range(n)]
        elif r == 0:
            with pytest.raises(varcomm.MessageTooLarge):
                A.all_to_all(comm, None, ins)
        elif r == 2:
            with pytest.raises(varcomm.MessageTooLarge, match="rank 0"):
                A.all_to_all(comm, None, ins)
        else:
            A.all_to_all(comm, None, ins)
        got, rs = A.all_to_all_v(comm, torch.full((n,), r), [1] * n)
        assert got.tolist() == list(range(n))


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90)
def test_dtype_and_trailing_shape_mismatch(transport):
    with _init(transport, bound=BOUND, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        x = torch.zeros(n * 2, 4, dtype=torch.float64 if r == 2 else torch.float32)
        with pytest.raises(varcomm.MessageMismatch, match="rank 0" if r == 2 else "rank 2"):
            A.all_to_all_v(comm, x, [2] * n)
        x = torch.zeros(n, 5 if r == 1 else 4)
        with pytest.raises(varcomm.MessageMismatch, match="rank 0" if r == 1 else "rank 1"):
            A.all_to_all_v(comm, x, [1] * n)
        # Still usable.
        got, rs = A.all_to_all_v(comm, torch.full((n, 2), float(r)), [1] * n)
        assert got[:, 0].tolist() == [float(s) for s in range(n)]


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90)
def test_all_to_all_single_and_list_forms(transport):
    seed = seeded()
    with _init(transport, bound=BOUND, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        # equal splits
        inp = torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3) + 100 * r
        out = torch.empty(n * 2, 3)
        assert A.all_to_all_single(comm, out, inp) is None
        want = torch.cat([(torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3) + 100 * s)[2 * r:2 * r + 2]
                          for s in range(n)])
        assert torch.equal(out, want)
        # uneven, known output splits: received straight into output's slices
        g = np.random.default_rng(seed)
        splits = g.integers(0, 6, size=(n, n))
        x = _x(seed, 0, r, int(splits[r].sum()), (2,), torch.int32)
        out = torch.full((int(splits[:, r].sum()), 2), -1, dtype=torch.int32)
        work = A.all_to_all_single(comm, out, x, splits[:, r].tolist(), splits[r].tolist(), async_op=True)
        work.wait()
        assert torch.equal(out, _reference(seed, 0, splits, r, (2,), torch.int32))
        # wrong output_split_sizes: MessageMismatch naming the source, then usable
        bad = splits[:, r].tolist()
        wrong = (r + 1) % n
        bad[wrong] += 1
        out = torch.zeros(sum(bad), 2, dtype=torch.int32)
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {wrong}"):
            A.all_to_all_single(comm, out, x, bad, splits[r].tolist())
        # list form: any shapes and dtypes, 0-d included; None outputs allocated
        ins = [torch.full((d + 1, r + 1), float(10 * r + d)) for d in range(n)]
        ins[(r + 1) % n] = torch.tensor(r * 7, dtype=torch.int16)  # a 0-d int16
        outs = A.all_to_all(comm, None, ins)
        for s in range(n):
            if r == (s + 1) % n:
                assert outs[s].dtype == torch.int16 and outs[s].shape == () and int(outs[s]) == s * 7
            else:
                assert outs[s].shape == (r + 1, s + 1) and bool((outs[s] == 10 * s + r).all())
        given = [torch.empty(tuple(o.shape), dtype=o.dtype) for o in outs]
        res = A.all_to_all(comm, given, ins)
        assert all(a is b for a, b in zip(res, given))
        assert all(torch.equal(a, b) for a, b in zip(given, outs))
        # numpy list form
        res = A.all_to_all(comm, None, [np.arange(d + r, dtype=np.int64) for d in range(n)])
        assert [x.tolist() for x in res] == [list(range(r + s)) for s in range(n)]


@world(2, timeout=60)
def test_argument_errors():
    with varcomm.init(bound=BOUND, timeout=30) as comm:
        n = comm.world_size
        x = torch.zeros(4, 2)
        # this rank's own errors name the call and the rank, as its peers' do (helper-66)
        with pytest.raises(varcomm.InvalidArgument,
                           match=f"^all_to_all_v on rank {comm.rank}: send_splits sums to 2 but dim 0 has 4 rows$"):
            A.all_to_all_v(comm, x, [1, 1])
        with pytest.raises(varcomm.InvalidArgument, match=f"^all_to_all_single on rank {comm.rank}: .*entries"):
            A.all_to_all_single(comm, torch.zeros(4, 2), x, [2, 2], [4])
        with pytest.raises(varcomm.InvalidArgument, match="entries"):
            A.all_to_all_v(comm, x, [4])
        with pytest.raises(varcomm.InvalidArgument, match="negative"):
            A.all_to_all_v(comm, x, [5, -1])
        for bad in ([2.5, 1.5], ["2", "2"], [True, 3], torch.tensor([2.0, 2.0])):  # not rounded or parsed
            with pytest.raises(varcomm.InvalidArgument, match="must hold ints"):
                A.all_to_all_v(comm, x, bad)
        assert A.all_to_all_v(comm, x, [np.int64(2), 2])[1] == [2, 2]  # numpy integers are ints
        with pytest.raises(varcomm.InvalidArgument, match="dimension"):
            A.all_to_all_v(comm, torch.tensor(1.0), [1, 0])
        with pytest.raises(varcomm.InvalidArgument, match="dtype"):
            A.all_to_all_v(comm, x, [2, 2], out=torch.zeros(100, dtype=torch.int32))
        # out's rows must be x's (or out 1-d): a [N, 7] out came back filled across its rows
        with pytest.raises(varcomm.InvalidArgument, match=r"rows of shape \(7,\) but x's rows are \(2,\)"):
            A.all_to_all_v(comm, x, [2, 2], out=torch.zeros(10, 7))
        got, rs = A.all_to_all_v(comm, x + 1, [2, 2], out=torch.zeros(10, 2))  # x's row shape
        assert got.shape == (4, 2) and bool((got == 1).all())
        # out too small: every rank consumed its messages, so the next call works
        with pytest.raises(varcomm.MessageTooLarge, match="out holds"):
            A.all_to_all_v(comm, x, [2, 2], out=torch.zeros(3))
        got, rs = A.all_to_all_v(comm, torch.arange(n) + 10 * comm.rank, [1] * n)
        assert got.tolist() == [10 * s + comm.rank for s in range(n)]
        # strided input is fine (copied once)
        y = torch.arange(8).reshape(2, 4).t()
        got, rs = A.all_to_all_v(comm, y, [2, 2])
        assert got.shape == (4, 2)


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90)
def test_timeout_names_the_late_peer_and_leaves_the_communicator_usable(transport):
    """Rank 1 joins late: ranks 0 and 2 raise TimeoutError naming it, within
    about their timeout; what they had not started is cancelled and what rank
    1 sends them later is dropped, so the next collective is right everywhere."""
    with _init(transport, bound=BOUND, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        x = torch.arange(n, dtype=torch.float32) + 10 * r
        comm.barrier()  # ranks 0 and 2 start together: only rank 1 is late
        if r != 1:
            t0 = time.monotonic()
            with pytest.raises(varcomm.TimeoutError,
                               match="all_to_all_v on rank [02] timed out after 2 s: rank 1 has not sent its part"):
                A.all_to_all_v(comm, x, [1] * n, timeout=2.0)
            assert time.monotonic() - t0 < 15
            comm.barrier()
        else:
            comm.barrier()
            if "two-phase" in transport:  # the others will not send payloads after their timeout
                with pytest.raises(varcomm.TimeoutError):
                    A.all_to_all_v(comm, x, [1] * n, timeout=2.0)
            else:  # their chunks were written before they gave up
                got, rs = A.all_to_all_v(comm, x, [1] * n, timeout=10)
                assert rs == [1] * n and got.tolist() == [10.0 * s + r for s in range(n)]
        comm.barrier()
        y = torch.arange(2 * n, dtype=torch.int64).reshape(n, 2) + 100 * r
        got, rs = A.all_to_all_v(comm, y, [1] * n)
        assert rs == [1] * n and got.tolist() == [[100 * s + 2 * r, 100 * s + 2 * r + 1] for s in range(n)]


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90, expect_exit={2: None})
def test_dead_peer_raises_peer_failure(transport):
    comm = _init(transport, bound=BOUND, slots=4, timeout=60)
    r, n = comm.rank, comm.world_size
    comm.barrier()  # every rank is set up (rank 2 gone earlier failed the others' gloo set-up instead)
    if r == 2:
        os._exit(3)  # dies without closing
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="^all_to_all_v: .*rank 2"):
        A.all_to_all_v(comm, torch.zeros(n, 3), [1] * n)
    assert time.monotonic() - t0 < 10, "dead peer took too long to detect"
    other = 1 - r  # the survivors' channel still works
    comm.send(torch.tensor([r]), dst=other)
    assert comm.recv(src=other).item() == other


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90, expect_exit={1: None})
def test_dead_peer_fails_the_call_while_another_peer_is_late(transport):
    """Rank 1 dies, rank 2 joins the all-to-all 8 s late: rank 0 waited for
    rank 2's chunk first and raised PeerFailure naming rank 1 only once rank
    2 turned up (with rank 2 later still, at its timeout). Now it fails
    within seconds, naming rank 1; rank 2's call fails the same way."""
    comm = _init(transport, bound=BOUND, slots=4, timeout=60)
    r, n = comm.rank, comm.world_size
    comm.barrier()
    if r == 1:
        os._exit(3)
    if r == 2:
        time.sleep(8)
    t0 = time.monotonic()
    with pytest.raises(varcomm.PeerFailure, match="^all_to_all_v: .*rank 1"):
        A.all_to_all_v(comm, torch.zeros(n, 3), [1] * n)
    if r == 0:
        assert time.monotonic() - t0 < 5, f"took {time.monotonic() - t0:.1f} s: the late rank held the error back"
    comm.send(torch.tensor([r]), dst=2 - r)  # the survivors' channel still works
    assert comm.recv(src=2 - r).item() == 2 - r


def _send_its_part_and_die(comm, x: torch.Tensor, splits: list[int]) -> None:
    """This rank's part of an all-to-all goes out; then the rank dies in the call."""
    A.all_to_all_v(comm, x, splits, async_op=True)
    comm._c.progress()
    time.sleep(0.5)
    os._exit(3)


def _three_ranks_and_rank_2_dies(transport: str):
    """Every pair connected by one all-to-all of [2] rows each; then rank 2 sends its part of the next
    and dies. Returns (comm, rank, world size, x) on the survivors."""
    comm = _init(transport, bound=BOUND, slots=4, timeout=30)
    r, n = comm.rank, comm.world_size
    x = torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3) + 100 * r
    A.all_to_all_v(comm, x, [2] * n)
    if r == 2:
        _send_its_part_and_die(comm, x, [2] * n)
    return comm, r, n, x


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90, expect_exit={2: None})
def test_a_rank_that_knows_a_peer_died_still_sends_its_part_to_the_others(transport):
    """Rank 2 sends its part of an all-to-all and dies; rank 1 enters the call
    knowing it: its send to rank 2 failed first and it raised at once, never
    sending rank 0 its part, so rank 0 (rank 2's part already in) waited for
    its whole timeout and then blamed live rank 1. Now rank 1 still sends the
    live ranks their parts and raises PeerFailure naming rank 2: rank 0
    finishes with every row (rank 2's had arrived), and the survivors' channel
    works."""
    comm, r, n, x = _three_ranks_and_rank_2_dies(transport)
    if r == 1:
        time.sleep(2)  # rank 2's end is known here by now
    t0 = time.monotonic()
    if r == 1:
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            A.all_to_all_v(comm, x, [2] * n)
    else:
        try:
            out, got = A.all_to_all_v(comm, x, [2] * n)
        except varcomm.PeerFailure as e:  # also honest (rank 2's part may not have landed): but not rank 1
            assert "rank 2" in str(e), e
        else:
            want = torch.cat([torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3)[2 * r:2 * r + 2]
                              + 100 * s for s in range(n)])
            assert torch.equal(out, want) and list(got) == [2] * n
    took = time.monotonic() - t0
    assert took < 10, f"rank {r} took {took:.1f} s: it waited for a part that a live rank never sent"
    comm.send(torch.tensor([r]), dst=1 - r)  # the survivors' channel still works
    assert comm.recv(src=1 - r).item() == 1 - r


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90, expect_exit={2: None})
def test_parts_still_queued_when_a_dead_peer_fails_the_call_go_from_a_copy(transport):
    """As above, with rank 1's ring to rank 0 full (8 messages to its 4
    slots), so its part for rank 0 is still queued when the call raises
    PeerFailure: it went later from rank 1's input, which rank 1, told the call
    had failed, had overwritten with -1s, and rank 0 took those rows with no
    error. Now the queued part goes from a copy taken when the call raised."""
    comm, r, n, x = _three_ranks_and_rank_2_dies(transport)
    if r == 1:
        works = [comm.isend(torch.tensor([k]), dst=0) for k in range(8)]  # more than rank 0's slots for it
        time.sleep(2)  # rank 2's end is known here by now
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            A.all_to_all_v(comm, x, [2] * n)
        x.fill_(-1.0)  # the call failed: its input is the caller's again
        for w in works:
            w.wait()
        assert comm.recv(src=0).item() == 7
        return
    work = A.all_to_all_v(comm, x, [2] * n, async_op=True)  # started before rank 2's end is known
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # rank 2's part lands; rank 1's is queued behind its 8 messages
        work.is_completed()
        time.sleep(0.05)
    assert [comm.recv(src=1).item() for _ in range(8)] == list(range(8))
    if transport.endswith("two-phase"):  # rank 2 died before its payload phase: the call fails here too
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            work.wait()
    else:
        out, got = work.wait()
        want = torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n * 2, 3)[0:2] + 100
        assert torch.equal(out[2:4], want), f"rank 1's rows: {out[2:4].tolist()}"
    comm.send(torch.tensor([7]), dst=1)


@world(3, timeout=120, expect_exit={2: None})
def test_a_queued_part_sent_from_a_copy_is_withdrawn_at_close_not_read_after_free():
    """As above, with rank 1's part for rank 0 a rendezvous (48 KiB, read by
    rank 0 out of rank 1's memory), still queued when the call raised: it went
    from the copy, and rank 1's close(), with rank 0 not reading, could not
    withdraw its head (the copy looked like data moved after the head went
    out), freed the copy and left the head offered. Rank 0 then read freed
    memory (-7s rank 1 had reused it for) as rank 1's rows, with no error. Now
    the head is withdrawn: rank 0 raises PeerFailure instead."""
    W, BIG = 16, 768
    comm = varcomm.init(transport="shm", bound=64 * 1024, slots=4, timeout=60, cma="on", landing=0)
    r, n = comm.rank, comm.world_size
    splits = [BIG if (r == 1 and d == 0) else 1 for d in range(n)]
    x = torch.arange(sum(splits) * W, dtype=torch.float32).reshape(-1, W) + 1000 * r
    A.all_to_all_v(comm, torch.zeros(n, W), [1] * n)  # every pair connected
    if r == 2:
        _send_its_part_and_die(comm, x, splits)
    if r == 1:
        works = [comm.isend(torch.tensor([k]), dst=0) for k in range(8)]  # more than rank 0's slots for it
        time.sleep(2)
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            A.all_to_all_v(comm, x, splits)
        for w in works:
            w.wait()
        comm.close()  # its flush waits ~10 s for rank 0 (asleep), then withdraws what rank 0 did not take
        junk = [torch.full((BIG * W,), -7.0) for _ in range(8)]  # reuses freed memory
        time.sleep(12)
        del junk
        return
    work = A.all_to_all_v(comm, x, splits, async_op=True)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        work.is_completed()
        time.sleep(0.05)
    assert [comm.recv(src=1).item() for _ in range(8)] == list(range(8))
    time.sleep(16)  # no progress here while rank 1 closes
    with pytest.raises(varcomm.PeerFailure, match="rank 1"):
        out, _ = work.wait()
        assert not torch.equal(out[1:2], torch.full((1, W), -7.0)), "rank 1's rows are freed memory"


# Chunks over 32 KiB to a peer this rank can read straight out of (CMA) go by
# rendezvous: the receiver copies each one from its sender into the output it
# places once every count is in (Engine::rendezvous `held`, Request::hold).
# cma=on forces that pair on hosts whose probe prefers two memcpys.
HELD = ["shm", "shm/two-phase"] if "shm" in TRANSPORTS else []


@pytest.mark.parametrize("transport", HELD)
@pytest.mark.parametrize("n", [3, 4])
def test_chunks_copied_once_from_their_sender_match_reference(transport, n):
    @world(n, timeout=120)
    def body():
        seed = seeded()
        with _init(transport, bound=1 << 20, slots=2, timeout=60, cma="on") as comm:
            assert comm.route_info((comm.rank + 1) % n)["cma"] == "on"
            r = comm.rank
            for it in range(16):
                g = np.random.default_rng([seed, it])
                dt, trailing = [(torch.float32, (256,)), (torch.bfloat16, (3, 171))][it % 2]
                row = (2 if dt == torch.bfloat16 else 4) * int(np.prod(trailing))
                splits = g.integers(0, (1 << 20) // row // n + 1, size=(n, n))
                splits[g.random((n, n)) < 0.2] = 0
                if it == 7:
                    splits[:] = 0
                    splits[:, 1] = (1 << 20) // row  # all to one, each chunk at the bound
                x = _x(seed, it, r, int(splits[r].sum()), trailing, dt)
                want = _reference(seed, it, splits, r, trailing, dt)
                if it % 3 == 2:  # async, the sender's buffer dropped by the caller meanwhile
                    work = A.all_to_all_v(comm, x, splits[r].tolist(), async_op=True)
                    del x
                    got, rs = work.wait()
                else:
                    got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
                _check(got, want, rs, splits, r, f"seed {seed} iteration {it}")

    body()


@pytest.mark.parametrize("transport", HELD)
def test_cma_chunks_copies_collective_chunks_from_128k_once(transport):
    """cma=chunks (what auto picks where the set-up probe prefers two memcpys,
    e.g. AMD EPYC, but CMA is allowed): a collective's chunks from 128 KiB are
    copied once: written by their sender into an output in the landing area
    (pushed_bytes), else read out of the sender (pulled_bytes, also where a
    sender is slow to write). Smaller chunks and point-to-point messages take
    two memcpys, and every result matches the reference."""
    n = 3

    @world(n, timeout=120)
    def body():
        seed = seeded()
        with _init(transport, bound=1 << 20, slots=2, timeout=60, cma="chunks") as comm:
            r = comm.rank
            info = comm.route_info((r + 1) % n)
            if info["cma_refused"]:
                pytest.skip(f"CMA is not allowed here: {info['cma_refused']}")
            assert info["cma"] == "chunks", info
            assert "a collective's chunks from 128 KiB" in comm.describe_transport((r + 1) % n)
            trailing, row = (1024,), 4096  # float32 rows: 32 rows = 128 KiB
            pushed0 = comm._c.pushed_bytes
            for it in range(8):
                g = np.random.default_rng([seed, it])
                # outputs of 0-2.3 MiB: some under the landing threshold (256 KiB), most over
                splits = g.choice([0, 3, 31, 32, 40, 127, 200], size=(n, n))
                x = _x(seed, it, r, int(splits[r].sum()), trailing, torch.float32)
                want = _reference(seed, it, splits, r, trailing, torch.float32)
                before = comm._c.pulled_bytes + comm._c.pushed_bytes
                got, rs = A.all_to_all_v(comm, x, splits[r].tolist())
                _check(got, want, rs, splits, r, f"seed {seed} iteration {it}")
                large = sum(int(splits[s, r]) * row for s in range(n) if s != r and splits[s, r] >= 32)
                once = comm._c.pulled_bytes + comm._c.pushed_bytes - before
                assert once == large, (it, splits[:, r], once)
            assert comm._c.pushed_bytes > pushed0, "no chunk was written into a landing-area output by its sender"
            # point to point over eager_max into an ordinary out: not a chunk, so not copied once
            before = comm._c.pulled_bytes + comm._c.pushed_bytes
            dst, src = (r + 1) % n, (r - 1) % n
            w = comm.isend(torch.full((900 << 8,), float(r)), dst)
            out = torch.empty(1 << 18)
            got = comm.recv(src, out=out)
            w.wait()
            assert got.shape == (900 << 8,) and got[-1].item() == src
            assert comm._c.pulled_bytes + comm._c.pushed_bytes == before

    body()


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@world(3, timeout=90)
def test_a_sender_that_gave_up_still_delivers_its_held_chunks():
    """Ranks 0 and 2 time out waiting for rank 1; the chunks they sent it by
    rendezvous are moved into memory of the core's own (the caller may reuse
    its input), and rank 1, late, still receives exactly what they sent."""
    with _init("shm", bound=1 << 20, slots=4, timeout=30, cma="on") as comm:
        r, n = comm.rank, comm.world_size
        rows = 64  # 64 KiB chunks: over the 32 KiB threshold
        x = torch.full((rows * n, 256), float(r))
        comm.barrier()
        if r != 1:
            with pytest.raises(varcomm.TimeoutError, match="rank 1"):
                A.all_to_all_v(comm, x, [rows] * n, timeout=2.0)
            x.fill_(-1.0)  # reused at once: rank 1 must not see it
            comm.barrier()
        else:
            comm.barrier()
            got, rs = A.all_to_all_v(comm, x, [rows] * n, timeout=10)
            assert rs == [rows] * n
            assert torch.equal(got, torch.repeat_interleave(torch.arange(n, dtype=torch.float32), rows)[:, None]
                               .expand(-1, 256)), "rank 1 got data changed after its sender gave up"
        comm.barrier()
        got, rs = A.all_to_all_v(comm, x[: rows * n] * 0 + r, [rows] * n)  # the channel still works
        assert torch.equal(got[::rows, 0], torch.arange(n, dtype=torch.float32))


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@pytest.mark.parametrize("cma,width", [("on", 256), ("chunks", 1024)])  # chunks: 256 KiB, outputs in the landing area
def test_a_sender_that_dies_before_its_held_chunk_is_read_fails_its_receivers(cma, width):
    """Rank 2's chunks are written as rendezvous heads and it dies before ranks
    0 and 1 read them (or, with outputs in the landing area, ask it to write
    them there): they raise PeerFailure naming rank 2 within seconds."""
    @world(3, timeout=90, expect_exit={2: None})
    def body():
        comm = _init("shm", bound=1 << 20, slots=4, timeout=60, cma=cma)
        r, n = comm.rank, comm.world_size
        x = torch.full((64 * n, width), float(r))
        if r == 2:
            work = A.all_to_all_v(comm, x, [64] * n, async_op=True)  # heads out, then gone
            time.sleep(0.2)
            assert not work.is_completed()
            os._exit(3)
        time.sleep(1.0)
        t0 = time.monotonic()
        with pytest.raises(varcomm.PeerFailure, match="rank 2"):
            A.all_to_all_v(comm, x, [64] * n)
        assert time.monotonic() - t0 < 10, "a dead sender took too long to detect"
        other = 1 - r
        comm.send(torch.tensor([r]), dst=other)
        assert comm.recv(src=other).item() == other

    body()


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@world(2, timeout=90)
def test_a_sender_that_does_not_progress_is_read_instead_of_waited_for():
    """Rank 1's output is in its landing area, so it asks rank 0 to write its
    chunk there; rank 0 started its all-to-all asynchronously and sleeps
    without calling into varcomm. Rank 1 stops waiting for the write after a
    grace of milliseconds and reads the chunk itself: its call returns long
    before rank 0 wakes, with rank 0's data."""
    with _init("shm", bound=1 << 20, slots=4, timeout=20, cma="chunks") as comm:
        r, n = comm.rank, comm.world_size
        if comm.route_info(1 - r)["cma_refused"]:
            pytest.skip("CMA is not allowed here")
        rows = 128  # 512 KiB chunks, 1 MiB outputs: from the landing area
        x = torch.full((rows * n, 1024), float(r))
        comm.barrier()
        if r == 0:
            work = A.all_to_all_v(comm, x, [rows] * n, async_op=True)
            time.sleep(1.5)
            got, rs = work.wait()
        else:
            time.sleep(0.1)  # rank 0's head is in
            pulled = comm._c.pulled_bytes
            t0 = time.monotonic()
            got, rs = A.all_to_all_v(comm, x, [rows] * n)
            took = time.monotonic() - t0
            assert took < 0.7, f"rank 1 waited {took:.2f} s for a sender that was not progressing"
            assert comm._c.pulled_bytes - pulled == rows * 4096, "rank 0's chunk was not read by rank 1"
        assert rs == [rows] * n
        assert torch.equal(got[::rows, 0], torch.arange(n, dtype=torch.float32))
        assert torch.equal(got, got[::rows].repeat_interleave(rows, 0))
        comm.barrier()
        pushed = comm._c.pushed_bytes
        got, rs = A.all_to_all_v(comm, x, [rows] * n)  # both progressing: written by the sender
        assert torch.equal(got[::rows, 0], torch.arange(n, dtype=torch.float32))
        assert comm._c.pushed_bytes - pushed == rows * 4096


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@world(2, timeout=90)
def test_a_held_chunk_does_not_wait_for_its_receiver_to_finish():
    """Rank 1 starts an async all-to-all, then waits for a message rank 0
    sends only after its own (blocking) all-to-all returns. Rank 0's chunk
    for rank 1 went by rendezvous, and rank 1 copies it only at wait(): rank
    0 must not wait for that (it moves the chunk past a grace time), or both
    ranks hang until their timeout."""
    with _init("shm", bound=1 << 20, slots=4, timeout=20, cma="on") as comm:
        r, n = comm.rank, comm.world_size
        rows = 64  # 256 KiB chunks
        x = torch.full((rows * n, 1024), float(r))
        comm.barrier()
        t0 = time.monotonic()
        if r == 0:
            got, rs = A.all_to_all_v(comm, x, [rows] * n)
            x.fill_(-1.0)  # reused at once: rank 1 must still get the values sent
            comm.send(torch.tensor([7]), dst=1)
        else:
            work = A.all_to_all_v(comm, x, [rows] * n, async_op=True)
            assert comm.recv(src=0).item() == 7
            got, rs = work.wait()
        assert time.monotonic() - t0 < 5, "a held chunk waited for its receiver's wait()"
        assert rs == [rows] * n
        assert torch.equal(got[::rows, 0], torch.arange(n, dtype=torch.float32))
        assert torch.equal(got, got[::rows].repeat_interleave(rows, 0))


@pytest.mark.parametrize("transport", HELD)
@world(3, timeout=90)
def test_all_to_all_into_comm_empty_outputs(transport):
    """Outputs from comm.empty (the landing area), given by the caller: every
    chunk is in place when the call returns, on every rank and offset."""
    with _init(transport, bound=1 << 20, slots=4, timeout=30, cma="on") as comm:
        r, n = comm.rank, comm.world_size
        rows = 48  # 192 KiB chunks
        base = torch.arange(rows * n * 1024, dtype=torch.float32).reshape(rows * n, 1024)
        mine = base[r * rows:(r + 1) * rows]  # what each source sends this rank, less 1e6 * (source + it)
        for it in range(6):
            x = base + 1e6 * (r + it)
            out = comm.empty((rows * n, 1024), "float32", "torch")
            A.all_to_all_single(comm, out, x)
            for s in range(n):
                assert torch.equal(out[s * rows:(s + 1) * rows], mine + 1e6 * (s + it)), (it, s)
            outs = [comm.empty((rows, 1024), "float32", "torch") for _ in range(n)]
            A.all_to_all(comm, outs, list(x.split(rows)))
            for s in range(n):
                assert torch.equal(outs[s], mine + 1e6 * (s + it)), (it, s)


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@world(4, timeout=90)
def test_held_chunks_to_several_busy_receivers_let_go_at_the_grace():
    """Rank 0's all-to-all while ranks 1-3 first wait for a message rank 0
    sends after it: every held chunk of rank 0 is moved at the grace (a few
    ms), not one per 100 ms slice."""
    with _init("shm", bound=1 << 20, slots=4, timeout=20, cma="on") as comm:
        r, n = comm.rank, comm.world_size
        rows = 64  # 256 KiB chunks
        x = torch.full((rows * n, 1024), float(r))
        comm.barrier()
        if r == 0:
            t0 = time.monotonic()
            got, rs = A.all_to_all_v(comm, x, [rows] * n, timeout=10)  # rank 0 alone: times out on nothing
            took = time.monotonic() - t0
            for d in range(1, n):
                comm.send(torch.tensor([7]), dst=d)
        else:
            work = A.all_to_all_v(comm, x, [rows] * n, async_op=True)
            assert comm.recv(src=0).item() == 7
            got, rs = work.wait()
        assert torch.equal(got[::rows, 0], torch.arange(n, dtype=torch.float32))
        if r == 0:
            assert took < 0.15, f"rank 0's all-to-all took {took * 1e3:.0f} ms: its held chunks waited a slice each"


@pytest.mark.skipif(not HELD, reason="no shm transport in this build")
@world(2, timeout=90)
def test_large_torch_outputs_come_from_half_the_landing_area():
    """A torch output from 256 KiB is a block of the landing area (peers write
    their chunks there; pages kept hot from one call to the next), freed when dropped; outputs kept alive
    take at most half the area, then come from torch, and every result is
    right either way. Only lent blocks count against that half: a received
    message held in the area (or a chunk of the same call landing there
    meanwhile, which made the choice depend on timing) does not."""
    with _init("shm", bound=8 << 20, slots=2, timeout=30, landing=16 << 20) as comm:
        r, n = comm.rank, comm.world_size
        # a 4 MiB point-to-point message received into a new tensor lands in the area and is kept
        w = comm.isend(torch.full((1 << 20,), float(r)), 1 - r)
        kept = comm.recv(1 - r)
        w.wait()
        assert kept[0].item() == 1 - r
        assert comm._c.landing_stats()[1:] == (1, 0), comm._c.landing_stats()
        rows = 768  # 3 MiB chunks: 6 MiB outputs
        held = []
        for it in range(3):
            x = torch.full((rows * n, 1024), float(10 * it + r))
            got, rs = A.all_to_all_v(comm, x, [rows] * n)
            assert rs == [rows] * n
            assert torch.equal(got[::rows, 0], torch.tensor([10.0 * it + s for s in range(n)]))
            held.append(got)
            # the first fits in half of 16 MiB; the second would not leave half free
            free, blocks, lent = comm._c.landing_stats()
            assert (blocks, lent) == (2, (6 << 20) + 4096), (it, comm._c.landing_stats())
        del held, got
        assert comm._c.landing_stats()[1:] == (1, 0), "a dropped output kept its block"
        del kept
        assert comm._c.landing_stats()[1:] == (0, 0), "a dropped result kept its block"


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90)
def test_a_call_one_rank_refuses_fails_on_every_rank_and_the_next_is_right(transport):
    """Rank 1's send_splits do not add up: it raises InvalidArgument before
    anything is sent, and its peers fail that same call at once, naming rank 1,
    instead of pairing their call with rank 1's next one; the next call is
    right everywhere (it was silently shifted by one before)."""
    with _init(transport, bound=BOUND, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        for it in range(3):  # rank 1 refuses, then ranks 1 and 2, then rank 1 again: nothing left behind
            x = torch.full((2 * n, 4), float(10 * it + r))
            refusing = {1} if it != 1 else {1, 2}
            t0 = time.monotonic()
            if r in refusing:
                with pytest.raises(varcomm.InvalidArgument, match="sums to"):
                    A.all_to_all_v(comm, x, [2] * (n - 1) + [3])
            else:
                with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused"):
                    A.all_to_all_v(comm, x, [2] * n)
            assert time.monotonic() - t0 < 10, "a refused call took its peers to their timeout"
            y = torch.full((2 * n, 4), float(100 + 10 * it + r))
            got, rs = A.all_to_all_v(comm, y, [2] * n)
            assert rs == [2] * n
            assert got[::2, 0].tolist() == [100.0 + 10 * it + s for s in range(n)], "the next call was paired wrongly"


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=120)
def test_an_in_place_all_to_all_is_refused_on_every_rank_not_answered_with_wrong_rows(transport):
    """all_to_all_single(x, x), all_to_all_v(x, out=x) and all_to_all(parts,
    parts) returned wrong rows with no error once chunks went by rendezvous
    (peers read x after its owner had written what it received over it).
    Now each is InvalidArgument where it was made, refused to the peers
    (MessageMismatch naming it), with x left as it was; outputs next to the
    input in one buffer are not overlaps; and the next call is right."""
    with _init(transport, bound=1 << 20, slots=4, timeout=30) as comm:  # (two-phase holds chunks to it)
        r, n = comm.rank, comm.world_size
        rows = 64  # 64 x 1024 float32: 256 KiB chunks, over the eager size (rendezvous)

        def fresh() -> torch.Tensor:
            return torch.arange(n * rows * 1024, dtype=torch.float32).reshape(n * rows, 1024) + 1e6 * r

        want = torch.cat([(torch.arange(n * rows * 1024, dtype=torch.float32).reshape(n * rows, 1024)
                           + 1e6 * s)[r * rows:(r + 1) * rows] for s in range(n)])
        for form in ("single", "v", "list", "v, out shifted one row"):
            for culprit in (None, 1):  # every rank in place, then rank 1 only
                in_place = culprit is None or r == culprit
                x = fresh()
                if form == "v, out shifted one row":
                    buf = torch.empty(n * rows + 1, 1024)
                    buf[1:] = x
                    x = buf[1:]
                before = x.clone()
                with pytest.raises(varcomm.InvalidArgument if in_place else varcomm.MessageMismatch,
                                   match="overlaps .*in-place all-to-all" if in_place else "rank 1 refused"):
                    if form == "single":
                        A.all_to_all_single(comm, x if in_place else torch.empty_like(x), x)
                    elif form == "v":
                        A.all_to_all_v(comm, x, [rows] * n, out=x if in_place else None)
                    elif form == "list":
                        parts = list(x.chunk(n))
                        A.all_to_all(comm, parts if in_place else [torch.empty_like(p) for p in parts], parts)
                    else:
                        A.all_to_all_v(comm, x, [rows] * n, out=buf[:n * rows] if in_place else None)
                assert torch.equal(x, before), f"{form}: the refused call changed the input"
        # Outputs right next to the input (one buffer) are no overlap
        buf = torch.empty(2 * n * rows, 1024)
        x, out = buf[:n * rows], buf[n * rows:]
        x.copy_(fresh())
        A.all_to_all_single(comm, out, x)
        assert torch.equal(out, want) and torch.equal(x, fresh())
        parts = list(buf.chunk(2 * n))
        outs, ins = parts[:n], parts[n:]
        for k in range(n):
            ins[k].copy_(fresh()[k * rows:(k + 1) * rows])
        A.all_to_all(comm, outs, ins)
        assert torch.equal(torch.cat(outs), want)


@pytest.mark.parametrize("transport", MODES)
@world(3, timeout=90)
def test_a_list_form_call_that_fails_writes_none_of_its_outputs(transport):
    """all_to_all(outs, ins) with one output too small on rank 1: it raised
    MessageMismatch with its other outputs already filled, where
    all_to_all_v with a bad out writes nothing. Now neither does the list
    form; the peers' calls go through, and the next call is right."""
    with _init(transport, bound=BOUND, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        ins = [torch.full((3, 4), float(r + 1)) for _ in range(n)]
        outs = [torch.full((2 if (r == 1 and q == 0) else 3, 4), -7.0) for q in range(n)]
        if r == 1:
            with pytest.raises(varcomm.MessageMismatch, match="output_tensor_list\\[0\\]"):
                A.all_to_all(comm, outs, ins)
            assert all(bool((o == -7.0).all()) for o in outs), [o[:, 0].tolist() for o in outs]
        else:
            A.all_to_all(comm, outs, ins)
            assert [o[0, 0].item() for o in outs] == [q + 1.0 for q in range(n)]
        outs = [torch.empty(3, 4) for _ in range(n)]
        A.all_to_all(comm, outs, ins)
        assert [o[0, 0].item() for o in outs] == [q + 1.0 for q in range(n)]


@world(1, timeout=60)
def test_in_place_is_fine_where_no_peer_reads_the_input():
    """One rank (no peers), and the list form's own part into its own output:
    a local copy onto itself, not refused as in-place (what a peer reads is)."""
    with varcomm.init(timeout=10) as comm:
        x = torch.arange(6.0).reshape(3, 2)
        A.all_to_all_single(comm, x, x)
        parts = list(x.chunk(1))
        A.all_to_all(comm, parts, parts)
        assert torch.equal(x, torch.arange(6.0).reshape(3, 2))


@pytest.mark.parametrize("transport", MODES)
@world(2, timeout=120)
def test_a_tag_that_differs_between_ranks_is_named_at_the_timeout(transport):
    """Rank 1 passes tag=5, rank 0 none: each waited its timeout and was told
    the other "has not sent its part", though it had, under another tag. Now
    the timeout says whose part waits under which tag, and that every rank
    must pass the same one; the next call (same tags) pairs up."""
    with _init(transport, bound=BOUND, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        x = torch.full((2 * n, 3), float(r))
        mine, theirs = (0, 5) if r == 0 else (5, 0)
        # (the tags: [3, 5] where the other rank gave up first and made its next call)
        with pytest.raises(varcomm.TimeoutError, match=rf"timed out after 2 s: rank {1 - r}'s part of a collective "
                                                         rf"with tag [^:]*\b{theirs}\b[^:]* waits here unreceived, "
                                                         rf"where rank {r} called with tag {mine}: every rank must "
                                                         r"pass the same tag"):
            A.all_to_all_v(comm, x, [2] * n, tag=mine, timeout=2)
        got, rs = A.all_to_all_v(comm, x, [2] * n, tag=3)
        assert rs == [2] * n and got[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("transport", MODES)
@world(2, timeout=120)
def test_a_dropped_async_call_does_not_block_the_line_that_dropped_it(transport):
    """Rank 1 starts an all-to-all with async_op, drops the Work, then sends
    rank 0 what rank 0 waits for before it joins the call: the drop returns at
    once (it waited for every peer to join, to the timeout, and rank 0's recv
    timed out meanwhile), the dropped call still completes with the right
    data, and the next call pairs up."""
    with _init(transport, timeout=20) as comm:
        r = comm.rank
        x = torch.arange(4, dtype=torch.float32) + 10 * r
        if r == 1:
            t0 = time.monotonic()
            A.all_to_all_v(comm, x, [2, 2], async_op=True)  # dropped at once
            assert time.monotonic() - t0 < 5
            comm.send(torch.tensor([1]), 0, tag=3)
        else:
            assert comm.recv(1, tag=3, timeout=10).item() == 1
            got, rs = A.all_to_all_v(comm, x, [2, 2])
            assert rs == [2, 2] and got.tolist() == [0, 1, 10, 11]
        got, rs = A.all_to_all_v(comm, x + 100, [2, 2])
        assert got.tolist() == [100 + r * 2, 101 + r * 2, 110 + r * 2, 111 + r * 2], got


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_is_completed_finishes_an_async_call_without_wait(transport):
    """A loop that polls is_completed() (as torch users poll a Work) ends once
    every pair's data is in, and wait() then returns the result at once; it
    stayed False until wait() was called, so such a loop never ended. A
    small message and a rendezvous-sized one; every entry point."""
    with varcomm.init(transport=transport, bound=1 << 20, slots=4, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        for rows in (2, 3000):  # 3000 rows x 64 float32: 750 KiB chunks, over the eager size
            x = torch.full((n * rows, 64), float(r))
            works = [
                ("all_to_all_v", comm.all_to_all_v(x, [rows] * n, async_op=True)),
                ("all_to_all_v numpy", comm.all_to_all_v(x.numpy(), [rows] * n, async_op=True)),
                ("all_to_all_single", comm.all_to_all_single(torch.empty_like(x), x, async_op=True)),
                ("all_to_all", comm.all_to_all(None, list(x.chunk(n)), async_op=True)),
            ]
            for name, w in works:
                deadline = time.monotonic() + 15
                while not w.is_completed():
                    assert time.monotonic() < deadline, f"{name}: is_completed() stayed False"
                    time.sleep(0.001)
                t0 = time.monotonic()
                got = w.wait()
                assert time.monotonic() - t0 < 0.5, name
                if name == "all_to_all_single":
                    continue
                parts = got if name == "all_to_all" else [got[0][s * rows:(s + 1) * rows] for s in range(n)]
                for s, part in enumerate(parts):
                    assert np.all(np.asarray(part) == s), (name, s)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_more_pending_calls_than_slots_finish_in_any_wait_order(transport):
    """slots + 4 async all-to-alls held, then waited newest first (every
    entry point), and a blocking call made while slots + 1 are held: each
    waited out its timeout ("rank X has not sent its part of this call"), as
    the later call's messages queued behind the earlier ones' unconsumed
    slots. Earlier calls now finish first; their wait() returns their own
    result, and is_completed() of a later one polls them too."""
    slots = 2
    with _init(transport, slots=slots, timeout=20) as comm:
        r, n = comm.rank, comm.world_size
        made = {"all_to_all_v": lambda k: comm.all_to_all_v(torch.full((n, 3), 10.0 * k + r), [1] * n, async_op=True),
                "all_to_all_single": lambda k: comm.all_to_all_single(outs[k], torch.full((n, 3), 10.0 * k + r),
                                                                      async_op=True),
                "all_to_all": lambda k: comm.all_to_all(None, [torch.full((1, 3), 10.0 * k + r)] * n, async_op=True)}
        outs = [torch.empty(n, 3) for _ in range(slots + 4)]  # all_to_all_single's
        for name, make in made.items():
            works = [make(k) for k in range(slots + 4)]
            for k in reversed(range(len(works))):
                t0 = time.monotonic()
                got = works[k].wait(timeout=10)
                assert time.monotonic() - t0 < 5, (name, k)
                rows = torch.cat(got) if name == "all_to_all" else got[0] if name == "all_to_all_v" else outs[k]
                assert rows[:, 0].tolist() == [10.0 * k + s for s in range(n)], (name, k, rows)
        works = [made["all_to_all_v"](k) for k in range(slots + 1)]
        got, _ = comm.all_to_all_v(torch.full((n, 3), -1.0 - r), [1] * n, timeout=10)
        assert got[:, 0].tolist() == [-1.0 - s for s in range(n)]
        assert all(w.is_completed() for w in works)  # (finished by the blocking call)
        works = [made["all_to_all_v"](k) for k in range(slots + 2)]
        deadline = time.monotonic() + 10
        while not works[-1].is_completed():
            assert time.monotonic() < deadline, "is_completed() of the newest stayed False"
            time.sleep(0.001)
        for k, w in enumerate(works):
            assert w.wait(timeout=1)[0][:, 0].tolist() == [10.0 * k + s for s in range(n)], k


@world(2, timeout=120)
def test_earlier_pending_calls_are_neither_cancelled_nor_misread_by_a_later_wait():
    """helper-58 on finishing pending calls in order: (1) a thread's wait()
    on a pending call that a blocking call was finishing returned None at
    once (the finish was taken before it ran); (2) wait(timeout=0.05) on a
    later call cancelled the earlier ones with its timeout, losing their data
    (and took 0.05 s per call). Now (1) waits and returns the result; (2) is
    a TimeoutError saying earlier calls are unfinished, every call stays
    pending, and each later returns its own data."""
    import threading

    with varcomm.init(transport="shm", slots=4, timeout=20) as comm:
        r, n = comm.rank, comm.world_size
        xs = [torch.full((n, 3), 10.0 * k + r) for k in range(4)]
        if r == 1:
            time.sleep(1.5)  # rank 0's calls wait for this rank
        ws = [comm.all_to_all_v(xs[k], [1] * n, async_op=True) for k in range(3)]
        if r == 0:
            t0 = time.monotonic()
            said = "an earlier all-to-all .* has not finished; it stays pending, and this one stays pending too"
            with pytest.raises(varcomm.TimeoutError, match=said):
                ws[2].wait(timeout=0.05)
            assert time.monotonic() - t0 < 0.5
            got: dict[str, Any] = {}

            def waiter():
                time.sleep(0.3)  # the main thread is in the blocking call below, finishing ws[0] first
                got["w0"] = ws[0].wait()

            t = threading.Thread(target=waiter)
            t.start()
            last, _ = comm.all_to_all_v(xs[3], [1] * n)
            t.join()
            assert got["w0"][0][:, 0].tolist() == [0.0, 1.0], got
        else:
            last, _ = comm.all_to_all_v(xs[3], [1] * n)
        assert last[:, 0].tolist() == [30.0, 31.0]
        for k in range(3):
            assert ws[k].wait()[0][:, 0].tolist() == [10.0 * k, 10.0 * k + 1], k


@pytest.mark.parametrize("transport", ["shm", "rdma"])
@world(3, timeout=120)
def test_many_dropped_calls_with_one_slot_finish_at_once(transport):
    """300 async calls dropped unwaited, 1 slot: each finished on a thread of
    its own, which woke in turn; the calls after them timed out at 30 s
    (helper-58). One thread finishes the dropped calls of a communicator, in
    order: point-to-point messages behind theirs (which finish no pending
    all-to-all) flow within seconds."""
    with varcomm.init(transport=transport, slots=1, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        for k in range(300):
            comm.all_to_all_v(torch.full((n, 3), 10.0 * k + r), [1] * n, async_op=True)
        t0 = time.monotonic()
        for _ in range(3):  # a ring of sends, behind the dropped calls' messages in the 1-slot rings
            w = comm.isend(torch.tensor([r]), (r + 1) % n)
            assert comm.recv((r - 1) % n, timeout=15).item() == (r - 1) % n
            w.wait(timeout=15)
        assert time.monotonic() - t0 < 15
        got, _ = comm.all_to_all_v(torch.full((n, 3), -1.0 - r), [1] * n)
        assert got[:, 0].tolist() == [-1.0 - s for s in range(n)]


@world(2, timeout=120)
def test_a_dropped_call_finishes_after_an_earlier_held_one():
    """Rank 0 holds call 1, drops call 2 and computes for longer than the
    timeout before waiting call 1 (1 slot): the drainer finished call 2 alone,
    newest first; it waited behind call 1's slot, timed out, and rank 1's
    wait of call 2 failed ("rank 0 has not taken its part"). Dropped calls
    finish after every earlier one now, whose results their own wait()
    returns."""
    with varcomm.init(transport="shm", slots=1, timeout=3) as comm:
        r, n = comm.rank, comm.world_size
        w1 = comm.all_to_all_v(torch.full((n, 3), 10.0 + r), [1] * n, async_op=True)
        w2 = comm.all_to_all_v(torch.full((n, 3), 20.0 + r), [1] * n, async_op=True)
        if r == 0:
            del w2
            time.sleep(4.5)
            assert w1.wait()[0][:, 0].tolist() == [10.0, 11.0]
        else:  # (both within the 3 s timeout, while rank 0 sleeps: its drainer must take call 1's message first)
            assert w1.wait()[0][:, 0].tolist() == [10.0, 11.0]
            assert w2.wait()[0][:, 0].tolist() == [20.0, 21.0]
        got, _ = comm.all_to_all_v(torch.full((n, 3), -1.0 - r), [1] * n, timeout=10)  # (rank 0 sleeps)
        assert got[:, 0].tolist() == [-1.0, -2.0]


@world(2, timeout=60)
def test_a_row_count_mismatch_says_so_not_the_dtype_rule():
    """all_to_all_single whose output_split_sizes disagree with what a peer
    sends: the error names the rows and the split to fix, and no longer ends
    with "every rank must pass the same dtype and trailing shape" (which both
    ranks did); a real shape mismatch still says it."""
    with varcomm.init(bound=BOUND, timeout=30) as comm:
        r = comm.rank
        x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
        out = torch.zeros(5 if r == 0 else 4, 2)
        if r == 0:
            with pytest.raises(varcomm.MessageMismatch) as ei:
                A.all_to_all_single(comm, out, x, [2, 3], [2, 2])
            msg = str(ei.value)
            assert "rank 1 sent 2 rows, but output_split_sizes[1] on rank 0 is 3" in msg, msg
            assert "input_split_sizes[0]" in msg and "dtype and trailing shape" not in msg, msg
        else:
            A.all_to_all_single(comm, out, x, [2, 2], [2, 2])
        with pytest.raises(varcomm.MessageMismatch, match="same dtype and trailing shape"):
            A.all_to_all_single(comm, torch.zeros(4, 2 + r), torch.zeros(4, 2 + r))


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(3, timeout=60)
def test_all_to_all_v_is_differentiable_and_refuses_the_forms_that_would_drop_the_graph(transport):
    """x requiring grad: the result carries the graph, and each row's gradient
    comes back to its sender (the result was a fresh tensor with no grad_fn:
    the gradient silently stopped at the all-to-all). With out= or async_op,
    which cannot carry it, InvalidArgument, refused to the peers too."""
    with varcomm.init(transport=transport, bound=BOUND, timeout=30) as comm:
        r, n = comm.rank, comm.world_size
        seed = seeded()
        g = np.random.default_rng(seed)
        splits = _random_splits(g, n, 6)  # the same on every rank: [n, n], rows from s to d
        x = torch.nn.Parameter(torch.randn(int(splits[r].sum()), 3, generator=torch.Generator().manual_seed(seed + r)))
        y, rs = A.all_to_all_v(comm, x, splits[r].tolist())
        assert rs == splits[:, r].tolist() and y.requires_grad
        ((y * y).sum() / 2 * (r + 1)).backward()  # dL/dy = (r + 1) * y: each row back to its sender
        dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(splits[r]))
        want = x.detach() * (dst + 1).to(x.dtype)[:, None]
        assert torch.allclose(x.grad, want), (seed, x.grad, want)
        for kw in (dict(out=torch.zeros(100, 3)), dict(async_op=True)):
            with pytest.raises(varcomm.InvalidArgument, match="x requires grad"):
                A.all_to_all_v(comm, x, splits[r].tolist(), **kw)
        with torch.no_grad():  # no graph wanted: the plain forms
            got, _ = A.all_to_all_v(comm, x, splits[r].tolist(), out=torch.zeros(100, 3))
        assert torch.equal(got, y.detach())


@pytest.mark.parametrize("algorithm", ["one-phase", "two-phase"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_a_chunk_over_the_senders_max_message_is_named_on_both_ranks_then_usable(transport, algorithm):
    """A 24000-byte chunk under the receiver's 64 KiB bound but over the
    sender's max_message (16 KiB): the receiver blamed its own bound (which
    is not the limit), and under two-phase it waited for a payload that never
    came until its timeout. Both ranks now raise MessageTooLarge at once, the
    receiver naming the sender's max_message, and the next call is right."""
    with varcomm.init(transport=transport, bound=BOUND, max_message=16384, timeout=20,
                      a2a_algorithm=algorithm) as comm:
        r = comm.rank
        sp = [1, 6000] if r == 0 else [1, 1]
        t0 = time.monotonic()
        with pytest.raises(varcomm.MessageTooLarge) as ei:
            A.all_to_all_v(comm, torch.zeros(sum(sp)), sp)
        assert time.monotonic() - t0 < 10
        if r == 0:
            assert "over this rank's max_message of 16384" in str(ei.value)
        else:
            assert "over rank 0's max_message" in str(ei.value) and "bound" not in str(ei.value), str(ei.value)
        assert ei.value.peer == 1 - r
        got, rs = A.all_to_all_v(comm, torch.arange(2) + 10 * r, [1, 1])
        assert got.tolist() == [r, 10 + r] and rs == [1, 1]


@world(3, timeout=60)
def test_senders_over_different_limits_are_each_named_with_theirs():
    """Two-phase (held to the bound): rank 1's chunk for rank 0 is over rank 1's
    own max_message, rank 2's over rank 0's bound. Rank 0 named rank 1's
    max_message for both ("so did ranks [2]"), so nothing said its own bound
    was also too small."""
    mm = 16384 if varcomm.testing.rank() == 1 else 0
    with varcomm.init(bound=BOUND, max_message=mm, timeout=20, a2a_algorithm="two-phase") as comm:
        r = comm.rank
        sp = {0: [1, 1, 1], 1: [6000, 1, 1], 2: [20000, 1, 1]}[r]  # float32 rows: 24000 and 80000 bytes
        with pytest.raises(varcomm.MessageTooLarge) as ei:
            A.all_to_all_v(comm, torch.zeros(sum(sp)), sp)
        if r == 0:
            msg = str(ei.value)
            assert "rank 1 could not send its chunk to rank 0: over rank 1's max_message" in msg, msg
            assert f"rank 2 could not send its chunk to rank 0: over rank 0's receive bound of {BOUND}" in msg, msg
            assert ei.value.peer == 1
        got, _ = A.all_to_all_v(comm, torch.arange(3.0) + 10 * r, [1, 1, 1])
        assert got.tolist() == [r, 10 + r, 20 + r]


@pytest.mark.parametrize("algorithm", ["one-phase", "two-phase"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_a_backward_that_meets_a_peers_forward_fails_both_and_the_next_pairs_up(transport, algorithm):
    """Rank 0's x requires grad, rank 1's does not (so rank 1 runs no
    backward): rank 0's backward all-to-all met rank 1's next forward, of the
    same shapes, and each took the other's data (rank 0's x.grad held rank 1's
    next input, no error). Chunks carry their call's kind: both raise
    MessageMismatch saying the ranks are out of step, and the next call pairs
    up right. The same for a rows over the bound (rendezvous)."""
    with varcomm.init(transport=transport, bound=BOUND, timeout=20, a2a_algorithm=algorithm) as comm:
        r = comm.rank
        for rows in (1, 3 * BOUND // 8):  # float32 rows of 2: 8 bytes, then chunks over the bound (host: rendezvous)
            if algorithm == "two-phase" and rows > 1:
                continue  # two-phase is held to the bound
            x = torch.arange(4.0 * rows).reshape(2 * rows, 2) + 10 * r
            if r == 0:
                x.requires_grad_()
            y, _ = A.all_to_all_v(comm, x, [rows, rows])
            with pytest.raises(varcomm.MessageMismatch, match="out of step") as ei:
                if r == 0:
                    y.sum().backward()
                else:
                    A.all_to_all_v(comm, torch.full((2 * rows, 2), 99.0), [rows, rows])
            assert ei.value.peer == 1 - r and ("a forward" in str(ei.value)), str(ei.value)
            assert "its input requires grad, so that must agree across ranks" in str(ei.value), str(ei.value)
            got, rs = A.all_to_all_v(comm, torch.arange(2) + 10 * r, [1, 1])
            assert got.tolist() == [r, 10 + r] and rs == [1, 1]


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_out_of_step_is_said_before_a_chunk_that_did_not_fit(transport):
    """Two-phase: rank 1 ran no backward, and its next forward's chunk for
    rank 0 is over rank 0's bound. Rank 1 was told to raise the bound
    (MessageTooLarge), where the cause is that the ranks are out of step:
    both ranks now say that, and the next call pairs up."""
    with varcomm.init(transport=transport, bound=BOUND, timeout=20, a2a_algorithm="two-phase") as comm:
        r = comm.rank
        x = torch.zeros(2, 2, requires_grad=r == 0)
        y, _ = A.all_to_all_v(comm, x, [1, 1])
        big = 3 * BOUND // 8  # rows of 8 bytes: 3 * BOUND
        with pytest.raises(varcomm.MessageMismatch, match="out of step"):
            if r == 0:
                y.sum().backward()
            else:
                A.all_to_all_v(comm, torch.full((1 + big, 2), 99.0), [big, 1])
        got, rs = A.all_to_all_v(comm, torch.arange(2) + 10 * r, [1, 1])
        assert got.tolist() == [r, 10 + r] and rs == [1, 1]
