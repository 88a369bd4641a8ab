"""The core's set-up surface: its options dict, route answers, the region
check that refuses a descriptor naming another region, and Status."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import varcomm
from varcomm import _C
from varcomm.testing import world


def core_options(**kw):
    """The core's dict as init() builds it, for a rank alone with no GPU."""
    return varcomm.Options.resolve(**kw).placed(1).core(-1)


def _setup_alone(c: _C.Comm, forge=None) -> None:
    out = c.setup_begin()
    rnd = 0
    while out is not None:
        if forge is not None and rnd == 1:
            out = forge(out)
        out = c.setup_step([out])
        rnd += 1


@world(1)
def test_options_dict_must_have_exactly_the_core_keys():
    o = core_options()
    _C.Comm(0, 1, o)
    with pytest.raises(varcomm.InvalidArgument, match="unknown core option 'colour'"):
        _C.Comm(0, 1, {**o, "colour": "blue"})
    with pytest.raises(varcomm.InvalidArgument, match="core option 'slots' is missing"):
        _C.Comm(0, 1, {k: v for k, v in o.items() if k != "slots"})
    with pytest.raises(varcomm.InvalidArgument, match="'bound' has the wrong type"):
        _C.Comm(0, 1, {**o, "bound": "8M"})
    with pytest.raises(varcomm.InvalidArgument, match="nvlink_flags='gpu': use device, host"):
        _C.Comm(0, 1, {**o, "nvlink_flags": "gpu"})


@world(1)
def test_routes_after_setup():
    c = _C.Comm(0, 1, core_options())
    with pytest.raises(varcomm.InvalidArgument, match="set-up is not complete"):
        c.transport_for(0)
    _setup_alone(c)
    assert c.routes == ["shm"] and c.device_routes == [None]
    assert not c.needs_fallback_group and not c.close_waits_for_peers
    assert c.describe_transport(0).startswith("shm (same host")
    # A forced fallback carries the other ranks; self stays in local memory.
    f = _C.Comm(0, 1, core_options(transport="fallback"))
    _setup_alone(f)
    assert f.routes == ["shm"] and not f.needs_fallback_group
    cs = [_C.Comm(r, 2, core_options(transport="fallback")) for r in range(2)]
    outs = [x.setup_begin() for x in cs]
    while outs[0] is not None:
        outs = [x.setup_step(outs) for x in cs]
    for r, x in enumerate(cs):
        assert x.routes == (["shm", "fallback"] if r == 0 else ["fallback", "shm"])
        assert x.needs_fallback_group and not x.close_waits_for_peers
        assert "VARCOMM_TRANSPORT=fallback" in x.describe_transport(1 - r)
        x.close()


@world(1)
def test_shm_refuses_a_descriptor_that_names_another_region():
    """The mapped region's control block must match what the descriptor says:
    here the published bound is halved, as a stale or recycled descriptor would."""
    o = core_options(bound=1 << 16)
    c = _C.Comm(0, 1, o)
    with pytest.raises(varcomm.PeerFailure, match="bound 65536 where its descriptor says 32768"):
        _setup_alone(c, lambda blob: blob.replace(b"65536", b"32768"))


@world(1)
def test_status_of_a_received_message():
    comm = varcomm.init(timeout=10, array="numpy")
    with comm:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        comm.send(x, 0, tag=7)
        st = comm._f.recv(0, 7, np.zeros(16, np.float32), 10.0)  # a 2-d message into a 1-d out: its Status
        assert isinstance(st, varcomm.Status)
        assert (st.src, st.tag, st.nbytes, st.shape, st.device) == (0, 7, 24, (2, 3), False)
        assert "float32" in repr(st) and "shape=(2, 3)" in repr(st)


@world(1)
def test_setup_refuses_ranks_started_with_different_transports():
    """Routes are chosen on each rank alone: with different transport= the two
    ends of a pair chose different routes (and only one rank waited for the
    fallback's group, until its rendezvous timed out). Both ranks now refuse
    at set-up, naming the option."""
    cs = [_C.Comm(0, 2, core_options(transport="fallback")), _C.Comm(1, 2, core_options())]
    outs = [x.setup_begin() for x in cs]
    outs = [x.setup_step(outs) for x in cs]
    for x in cs:
        with pytest.raises(varcomm.InvalidArgument, match="every rank must pass the same transport="):
            x.setup_step(outs)
        x.close()


@world(1)
def test_setup_refuses_ranks_started_with_different_a2a_algorithms():
    """A one-phase rank took a two-phase rank's descriptors for chunks: the
    first all-to-all failed with a wrong MessageTooLarge and every later one
    timed out (the ranks out of step for good). Refused at set-up now; auto is
    one-phase, so it pairs with one-phase."""
    pairs = [("two-phase", "auto", True), ("one-phase", "two-phase", True), ("auto", "one-phase", False)]
    for a, b, refused in pairs:
        cs = [_C.Comm(0, 2, core_options(a2a_algorithm=a)), _C.Comm(1, 2, core_options(a2a_algorithm=b))]
        outs = [x.setup_begin() for x in cs]
        outs = [x.setup_step(outs) for x in cs]
        for x in cs:
            if refused:
                with pytest.raises(varcomm.InvalidArgument, match="every rank must pass the same a2a_algorithm="):
                    x.setup_step(outs)
            else:  # (two communicators of one process cannot go on to map each other: only the check is asked)
                with contextlib.suppress(varcomm.PeerFailure):
                    x.setup_step(outs)
            x.close()


@world(1)
def test_setup_refuses_a_garbled_record():
    c = _C.Comm(0, 1, core_options())
    with pytest.raises(varcomm.InvalidArgument, match="bad set-up record from rank 0"):
        _setup_alone(c, lambda blob: blob.replace(b"1:1", b"1:x", 1))
    c.close()
