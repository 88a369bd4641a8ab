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
