"""A long mixed stream leaves memory flat: nothing is kept per message."""
from __future__ import annotations

import varcomm
from varcomm.testing import rank, seeded, world
from varcomm_bench.rss import growth, stream


@world(2, timeout=120, requires=("torch",))
def test_rss_stays_flat_over_a_mixed_stream() -> None:
    seed = seeded()
    comm = varcomm.init(bound=256 << 10, slots=4)
    try:
        pts = stream(comm, 20_000, 256 << 10, seed, marks=4)
    finally:
        comm.close()
    # After the first half the stream has met every size and receive way many
    # times: growth past it is per-message memory (52 bytes a message would
    # already show as 512 KiB).
    late = growth(pts[1:])
    assert late < 512 << 10, f"rank {rank()}: RSS grew {late} bytes over the last 10k messages: {pts} (seed {seed})"


def _huge_advised(addr: int) -> bool:
    """Whether the mapping holding addr has MADV_HUGEPAGE ("hg" in smaps' VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@world(2, timeout=60, requires=("torch",))
def test_large_fresh_torch_results_get_huge_pages_like_numpy() -> None:
    # torch's CPU allocator leaves 4 KiB pages: a 44 MiB all-to-all output took 16-19 ms to fault in against 4.4 ms
    # (csrc/hostmem.h). Both ways a fresh torch result is made: a collective's output too big for the landing area,
    # and a blocking recv's new tensor (no landing area).
    import torch

    from varcomm.collectives import alltoall as A

    mib = 1 << 20
    for landing in (0, 8 * mib):
        comm = varcomm.init(bound=16 * mib, slots=2, landing=landing)
        try:
            x = torch.full((2 * 1024, 1024), float(rank()), dtype=torch.float32)  # 8 MiB: 4 MiB to each rank
            out, splits = A.all_to_all_v(comm, x, [1024, 1024])
            assert splits == [1024, 1024] and out[1024:].eq(1.0).all() and out[:1024].eq(0.0).all()
            mid = (out.data_ptr() + 3 * mib) & ~(2 * mib - 1)
            assert _huge_advised(mid), f"landing={landing}: an 8 MiB all-to-all output is not advised"
            if rank() == 0:
                comm.send(x, dst=1)
                comm.recv(src=1)
            else:
                y = comm.recv(src=0)
                assert y.eq(0.0).all()
                if landing == 0:  # the blocking recv's new tensor (else it is a landing block)
                    assert _huge_advised((y.data_ptr() + 3 * mib) & ~(2 * mib - 1)), "an 8 MiB recv is not advised"
                comm.send(torch.ones(4), dst=0)
        finally:
            comm.close()
