"""rdma transport options over loopback (transport="rdma" on one host):
VARCOMM_RDMA_STRICT=1 (the FI_MR_LOCAL registration path of verbs/efa, taken
on tcp too) and VARCOMM_RDMA_EAGER_CREDITS=1 (each credit posted at once
instead of held until the transport's next call); see transport/rdma/rdma.cpp."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import varcomm
from conftest import make_tensor, same_bytes
from varcomm.testing import seeded, world

pytestmark = pytest.mark.skipif("rdma" not in varcomm.build_info()["transports"],
                                reason="varcomm was built without the rdma transport")

BOUND = 256 * 1024  # well above the ~8 KiB copied inline: large payloads go in place (registered under STRICT)
DTS = [torch.uint8, torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float16]
OPTIONS = ["VARCOMM_RDMA_STRICT", "VARCOMM_RDMA_EAGER_CREDITS"]


@pytest.fixture(params=OPTIONS)
def rdma_option(request, monkeypatch) -> str:
    """The option, set to 1 for every rank of the test (before they fork)."""
    monkeypatch.setenv(request.param, "1")
    return request.param


def _check_describe(comm: varcomm.Communicator, option: str) -> None:
    for peer in range(comm.world_size):
        if peer == comm.rank:
            continue
        assert comm.transport_for(peer) == "rdma"
        desc = comm.describe_transport(peer)
        if option == "VARCOMM_RDMA_STRICT":  # the transport reports the mode
            assert "VARCOMM_RDMA_STRICT=1" in desc, desc
        else:  # not reported; test_eager_credits_go_out_at_once checks its effect
            assert "VARCOMM_RDMA_STRICT" not in desc, desc


def _cases(seed: int, n: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        dt = DTS[int(g.integers(len(DTS)))]
        isz = torch.empty((), dtype=dt).element_size()
        r = g.random()
        numel = BOUND // isz if i == 1 else 0 if i == 2 else int(g.integers(0, BOUND // isz + 1)) if r < 0.4 \
            else int(g.integers(8000 // isz, 8400 // isz)) if r < 0.55 else int(g.integers(0, 2000))
        out.append((dt, (numel,)))
    return out


@world(2, timeout=90)
def test_option_variable_size_stream(rdma_option):
    """200 messages of random dtype and size (0 to exactly the bound, and
    around the inline limit), alternately into a new array and into a
    bound-sized out=, then the same back: every byte checked.
    Catches: under STRICT, a payload sent in place without its registration
    (or with a stale one) or a staging-slot descriptor missing; under
    EAGER_CREDITS, a credit posted twice or out of order (slots=3 recycle many
    times), or corrupting a staging slot a message still uses."""
    seed = seeded(int(os.environ.get("VARCOMM_TEST_SEED", "0")) or None)
    cases = _cases(seed, 200)
    with varcomm.init(transport="rdma", bound=BOUND, slots=3, timeout=30) as comm:
        _check_describe(comm, rdma_option)
        peer = 1 - comm.rank
        out = torch.empty(BOUND, dtype=torch.uint8)
        for direction in (0, 1):
            for i, (dt, shape) in enumerate(cases):
                want = make_tensor(dt, shape, seed=seed + i + 1000 * direction)
                if comm.rank == direction:
                    comm.send(want, dst=peer, tag=i % 2)
                    continue
                if i % 2:
                    got = comm.recv(src=peer, tag=1)
                else:
                    got = comm.recv(src=peer, tag=0, out=out.view(dt))
                assert same_bytes(got, want), f"seed {seed} direction {direction} message {i} ({dt} {shape})"
        comm.barrier()


@world(3, timeout=90)
def test_option_ring_of_three(rdma_option):
    """A ring of 3 ranks with batch_isend_irecv, 30 steps of variable size,
    every rank sending and receiving at once.
    Catches: credits of several peers mixed up (each rank gets credits from
    one peer and returns them to another), a held or eager credit lost when
    writes to two peers interleave."""
    seed = seeded(int(os.environ.get("VARCOMM_TEST_SEED", "0")) or None)
    with varcomm.init(transport="rdma", bound=BOUND, slots=2, timeout=30) as comm:
        _check_describe(comm, rdma_option)
        r, n = comm.rank, comm.world_size
        nxt, prv = (r + 1) % n, (r - 1) % n
        for step in range(30):
            def size(src: int, step: int = step) -> int:
                return int(np.random.default_rng([seed, src, step]).integers(0, BOUND // 4 + 1))

            mine = make_tensor(torch.float32, (size(r),), seed=seed + 100 * step + r)
            works = comm.batch_isend_irecv([varcomm.P2POp(comm.irecv, None, prv, tag=step),
                                            varcomm.P2POp(comm.isend, mine, nxt, tag=step)])
            got = works[0].wait()
            works[1].wait()
            want = make_tensor(torch.float32, (size(prv),), seed=seed + 100 * step + prv)
            assert same_bytes(got, want), f"seed {seed} step {step}: from rank {prv}"
        comm.barrier()


@pytest.mark.parametrize("eager", [False, True])
@world(2, timeout=60)
def test_a_freed_slots_credit_reaches_a_sender_out_of_slots(eager):
    """slots=1: the receiver takes a message, then sleeps 0.6 s without calling
    varcomm. The freed slot's credit reaches the sender at once: with
    VARCOMM_RDMA_EAGER_CREDITS=1 it is posted at once; by default it is held
    to ride along with a reply, but not while the ring is half full or more
    (here: the sender has no other slot), nor for more than a few ms (the
    transport's credit thread; test_semantics has slots=2). It was held until
    the receiver's next call, so the sender's next send waited out the sleep."""
    if eager:
        os.environ["VARCOMM_RDMA_EAGER_CREDITS"] = "1"
    with varcomm.init(transport="rdma", bound=4096, slots=1, timeout=30) as comm:
        waits = []
        for _ in range(3):
            if comm.rank == 0:
                comm.send(torch.ones(10), dst=1)
                t0 = time.monotonic()
                comm.send(torch.full((10,), 2.0), dst=1)
                waits.append(time.monotonic() - t0)
            else:
                assert comm.recv(src=0).tolist() == [1.0] * 10
                time.sleep(0.6)
                assert comm.recv(src=0).tolist() == [2.0] * 10
            comm.barrier()
        if comm.rank == 0:
            assert min(waits) < 0.3, waits  # min: a scheduling hiccup on a loaded machine is not a held credit
