"""The torch adapter of the fast paths (csrc/adapters/torch_hooks.cpp,
arrays.use_torch_hooks): torch tensors described and made in C. It must give
exactly what the Python paths give, for every tensor it takes or hands on, and
stand aside where it was built for another torch."""
from __future__ import annotations

import sys

import pytest
import torch

import varcomm
from conftest import TRANSPORTS, make_tensor, same_bytes
from varcomm import arrays, dtypes
from varcomm.testing import seeded, world

BOUND = 4096


def _cases(seed: int) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor to send): every dtype varcomm carries, in shapes from 0-d
    to 3-d, and the tensor forms the adapter must take or hand on."""
    out = []
    for i, dt in enumerate(dtypes.torch_words()):
        for j, shape in enumerate([(), (0,), (5,), (2, 3, 4)]):
            out.append((f"{dt}{shape}", make_tensor(dt, shape, seed=hash((seed, i, j)) & 0x7FFFFFFF)))
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out += [("transposed", base.t()), ("neg view", torch._neg_view(base)),
            ("conj view", torch.arange(4.0).mul(1 + 2j).to(torch.complex64).conj()),
            ("parameter", torch.nn.Parameter(base.clone())), ("requires grad", base.clone().requires_grad_()),
            ("offset view", torch.arange(10, dtype=torch.int32)[3:8])]
    with torch.inference_mode():
        out.append(("inference", torch.arange(6, dtype=torch.float64)))
    return out


def _values(x: torch.Tensor) -> torch.Tensor:
    """What a message of x carries: its values' bytes (a neg or conj view resolved)."""
    return x.detach().resolve_neg().resolve_conj()


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=120)
def test_adapter_gives_what_the_python_paths_give(transport):
    """Each case is sent and received once with the adapter and once without,
    in every receive form: recv(), recv(out=) into a larger and into an exact
    buffer, irecv(out=), recv(copy=False), recv(out=) into a leaf that
    requires grad. The results agree in values, dtype,
    shape and type, and for out= in storage, offset, autograd and version.
    Catches: a wrong dtype word or shape, a view that is a copy or lacks out's
    version counter, a subclass or conj/neg view taken as plain bytes."""
    seed = seeded()
    assert arrays.torch_hooks() == "in use", arrays.torch_hooks()
    cases = _cases(seed)
    results = {}
    for on in (True, False):
        arrays.use_torch_hooks(on)
        with varcomm.init(transport=transport, bound=BOUND, slots=4, timeout=30) as comm:
            if comm.rank == 0:
                for _name, x in cases:
                    for _form in range(6):
                        comm.send(x, 1)
                comm.barrier()
                continue
            got = []
            for name, x in cases:
                want = _values(x)
                r0 = comm.recv(0)
                big = torch.full((BOUND,), 7, dtype=torch.uint8).view(x.dtype)
                r1 = comm.recv(0, out=big)
                exact = torch.empty(x.shape, dtype=x.dtype)
                r2 = comm.recv(0, out=exact)
                big3 = torch.zeros(BOUND, dtype=torch.uint8).view(x.dtype)
                r3 = comm.irecv(0, out=big3).wait()
                r4 = comm.recv(0, copy=False)
                # An out autograd tracks: the view is torch's own (the adapter declines it).
                leaf = torch.zeros(BOUND, dtype=torch.uint8).view(x.dtype).requires_grad_(x.dtype.is_floating_point)
                r5 = comm.recv(0, out=leaf)
                assert r5.requires_grad == leaf.requires_grad and (r5.grad_fn is not None) == (
                    leaf.requires_grad and tuple(r5.shape) != tuple(leaf.shape)), name
                for form, r in enumerate([r0, r1, r2, r3, r4, r5]):
                    assert type(r) is torch.Tensor, (name, form, type(r))
                    assert same_bytes(r, want), (name, form, on, r, want)
                assert r1.numel() == 0 or r1.data_ptr() == big.data_ptr(), name
                assert r2 is exact, name
                assert r3.numel() == 0 or r3.data_ptr() == big3.data_ptr(), name
                got.append((r0.dtype, tuple(r0.shape), r1.requires_grad, r1._version, r4.shape))
                del r4  # its slot back to the sender
            comm.barrier()
            results[on] = got
    if results:
        assert results[True] == results[False]
    arrays.use_torch_hooks(True)


@world(2, timeout=60)
def test_prefix_view_shares_storage_and_version():
    """recv(out=) with the adapter returns a view of out's front: writes through
    either are seen by the other, and an in-place change of out bumps the
    view's version (torch refuses a backward through stale saved tensors by
    it). Catches: a copy, a view at the wrong offset, a fresh version counter."""
    with varcomm.init(bound=BOUND, slots=2, timeout=30) as comm:
        if comm.rank == 0:
            comm.send(torch.arange(6.0).reshape(2, 3), 1)
            comm.send(torch.arange(3.0), 1)
            comm.barrier()
            return
        out = torch.zeros(100)
        v = comm.recv(0, out=out)
        assert v.shape == (2, 3) and torch.equal(v, torch.arange(6.0).reshape(2, 3))
        before = v._version
        out.add_(1)
        assert v._version == before + 1
        assert float(v[0, 0]) == 1.0
        v[1, 2] = -5.0
        assert float(out[5]) == -5.0
        base = torch.zeros(10)[2:]  # an out with an offset into its storage
        w = comm.recv(0, out=base)
        assert w.data_ptr() == base.data_ptr() and torch.equal(w, torch.arange(3.0))
        comm.barrier()


def _torch_calls(fn) -> set[str]:
    """The names of the C functions Python calls while fn runs."""
    names: set[str] = set()

    def prof(frame, event, arg):
        if event == "c_call":
            names.add(getattr(arg, "__name__", "?"))

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


@world(1, timeout=60)
def test_the_adapter_leaves_python_out_of_small_messages():
    """With the adapter, send, recv(out=) and recv() of a plain CPU tensor call
    no torch method from Python (each is one call into the core); without it
    they read the tensor through Python (the test's own check that it sees
    those calls). Catches: the fast path not taking torch tensors, so every
    small message pays ~1 us of Python attribute reads and torch.empty."""
    torch_methods = {"is_contiguous", "is_neg", "data_ptr", "empty", "as_strided", "frombuffer", "reshape"}
    x, out = torch.arange(4.0), torch.zeros(16)
    for on in (False, True):
        arrays.use_torch_hooks(on)
        with varcomm.init(transport="shm", bound=BOUND, slots=2, timeout=30) as comm:
            def ops() -> None:
                comm.send(x, 0)
                comm.recv(0, out=out)
                comm.send(x, 0)
                comm.recv(0)
                comm.send(x, 0)
                r = comm.recv(0, copy=False)
                del r

            ops()  # warm: first-call set-up is not the steady state
            seen = _torch_calls(ops) & torch_methods
            assert (not seen) if on else seen, (on, seen)
    arrays.use_torch_hooks(True)


@world(1, timeout=60)
def test_an_adapter_built_for_another_torch_stands_aside(monkeypatch):
    """The adapter's C++ ABI is one torch version's: under another it is never
    installed, the doctor says why and what to do, and tensors still go (by
    the Python paths). Catches: calling into a module built against another
    torch (a crash or silent corruption)."""
    from varcomm import _torch_hooks

    monkeypatch.setattr(_torch_hooks, "torch_version", "1.0.0+other")
    try:
        assert arrays.use_torch_hooks() is False
        why = arrays.torch_hooks()
        assert "built for torch 1.0.0+other" in why and torch.__version__ in why and "make build" in why, why
        with varcomm.init(transport="shm", bound=BOUND, timeout=30) as comm:
            comm.send(torch.arange(3.0), 0)
            assert torch.equal(comm.recv(0), torch.arange(3.0))
    finally:
        monkeypatch.undo()
        assert arrays.use_torch_hooks() is True


@world(1, timeout=60)
def test_what_review_found_behaves_as_the_python_paths():
    """Each of these differed between the adapter and the Python paths
    (helper-63), or crashed the latter:
    - copy=False of empty messages held a slot each, and the sender of the
      third stalled (slots=2): an empty tensor holds none;
    - a prefix view of out= was no autograd view: an in-place op with a tensor
      that requires grad did not reach out, and no_grad's rule was skipped;
    - a dtype word torch lacks printed "%#x" in its error;
    - under torch.set_default_device("meta") the Python path made a meta
      tensor and wrote the message at its address (a segfault)."""
    w = torch.ones(4, requires_grad=True)
    seen = {}
    for on in (True, False):
        arrays.use_torch_hooks(on)
        with varcomm.init(transport="shm", bound=BOUND, slots=2, timeout=5) as comm:
            kept = []
            for _ in range(6):
                comm.send(torch.empty(0, 3), 0)
                kept.append(comm.recv(0, copy=False))
            assert all(k.shape == (0, 3) for k in kept)
            out = torch.zeros(8)
            comm.send(torch.arange(4.0), 0)
            v = comm.recv(0, out=out)
            v.mul_(w)
            with torch.no_grad():
                comm.send(torch.arange(4.0), 0)
                v2 = comm.recv(0, out=torch.zeros(8))
            with pytest.raises(RuntimeError, match="no_grad"):
                v2.mul_(w)
            seen[on] = (v._is_view(), v._base is out, out.requires_grad, type(out.grad_fn).__name__,
                        type(v.grad_fn).__name__)
            torch.set_default_device("meta")
            try:
                comm.send(torch.arange(3.0, device="cpu"), 0)
                r = comm.recv(0)
                comm.send(torch.arange(3.0, device="cpu"), 0)
                ri = comm.irecv(0).wait()
            finally:
                torch.set_default_device(None)
            for x in (r, ri):
                assert x.device.type == "cpu" and torch.equal(x, torch.arange(3.0)), x
            word = dtypes.word(dtypes.FLOAT, 8)  # an 8-bit "float": no torch dtype (dropped at close)
            raw = torch.arange(4, dtype=torch.uint8)
            assert comm._f.send_ptr(raw, 0, 0, raw.data_ptr(), word, (4,), None, 2)
            with pytest.raises(varcomm.InvalidArgument, match=f"dtype word {word:#x} has no torch equivalent"):
                comm.recv(0)
    assert seen[True] == seen[False] == (True, True, True, "CopySlices", "AsStridedBackward0"), seen
    arrays.use_torch_hooks(True)


@world(1, timeout=60)
def test_what_the_adapter_attack_found_is_refused_or_counted():
    """helper-65, adapter on and off alike:
    - recv(out=) into a tensor whose storage was freed (FSDP's
      untyped_storage().resize_(0): data_ptr 0) or shrunk wrote the message
      past it (over a 1-byte object: a segfault later); now InvalidArgument,
      and the message is kept;
    - recv and irecv without out= under FakeTensorMode wrote the message at
      the data pointer 0 of a FakeTensor; now InvalidArgument, message kept;
    - recv(out=) did not count as a write: a backward that saved out used the
      message's values silently; now it raises, as after out.copy_()."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for on in (True, False):
        arrays.use_torch_hooks(on)
        with varcomm.init(transport="shm", bound=BOUND, slots=4, timeout=5) as comm:
            for left in (0, 400):
                out = torch.zeros(1000)
                out.untyped_storage().resize_(left)
                comm.send(torch.full((1000,), 3.0), 0)
                for blocking in (True, False):
                    with pytest.raises(varcomm.InvalidArgument, match=f"out's storage holds {left} bytes but out "
                                                                      "spans 4000: it was freed or shrunk"):
                        comm.recv(0, out=out) if blocking else comm.irecv(0, out=out).wait()
                assert torch.equal(comm.recv(0), torch.full((1000,), 3.0)), (on, left)
            comm.send(torch.arange(6.0), 0)
            with FakeTensorMode():
                # (recv with the adapter: its torch.empty kernel takes no mode, and makes a real tensor)
                for recv in [lambda: comm.irecv(0).wait()] + ([] if on else [lambda: comm.recv(0)]):
                    with pytest.raises(varcomm.InvalidArgument, match="without memory for the message .*"
                                                                      "FakeTensorMode.* the message is kept"):
                        recv()
            assert torch.equal(comm.recv(0), torch.arange(6.0)), on
            w = torch.ones(6, requires_grad=True)
            out = torch.zeros(6)
            y = (out * w).sum()  # saves out for w's gradient
            comm.send(torch.arange(6.0), 0)
            comm.recv(0, out=out)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
    arrays.use_torch_hooks(True)
