"""MoE dispatch/combine (varcomm.collectives.moe) against single-process references, and
the examples/moe.py layer's forward/backward equivalence, in-harness."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import varcomm
from conftest import TRANSPORTS
from varcomm.collectives import alltoall as A
from varcomm.collectives.moe import combine, dispatch
from varcomm.testing import seeded, world

ROOT = Path(__file__).resolve().parent.parent


def _example():
    spec = importlib.util.spec_from_file_location("varcomm_example_moe", ROOT / "examples" / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    # Not torch.testing.assert_close: its first call costs seconds in every forked rank.
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    diff = (a - b).abs()
    assert bool((diff <= tol + tol * b.abs()).all()), f"largest |diff| {float(diff.max()):.3g} > tol {tol}"


def _inputs(seed: int, rank: int, it: int, E: int, K: int, H: int, skew: str):
    g = torch.Generator().manual_seed(hash((seed, rank, it)) & 0x7FFFFFFF)
    T = int(torch.randint(0, 40, (), generator=g)) if skew != "empty" or rank != 1 else 0
    tokens = torch.randn(T, H, generator=g)
    if skew == "one":  # every token to expert E-1 (first choice) and expert 0
        ids = torch.stack([torch.full((T,), E - 1), torch.zeros(T, dtype=torch.int64)], 1)[:, :K]
    elif skew == "zipf":
        rng = np.random.default_rng([seed, rank, it])
        ids = torch.from_numpy(np.stack([np.argsort(rng.zipf(1.5, size=E))[:K] for _ in range(T)])
                               if T else np.zeros((0, K), dtype=np.int64)).to(torch.int64)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.int64)
    if skew == "masked":  # DeepEP's -1: a dropped (token, k) pair, about a third of them
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.35, -1, ids)
    weights = torch.rand(T, K, generator=g)
    return tokens, ids.reshape(T, K), weights


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_dispatch_combine_match_reference(transport, n):
    E, K, H = 2 * n, 2, 8

    @world(n, timeout=120)
    def body():
        seed = seeded()
        with varcomm.init(transport=transport, bound=1 << 20, timeout=60) as comm:
            r = comm.rank
            per = E // n
            for it, skew in enumerate(["uniform", "zipf", "one", "empty", "masked", "uniform"]):
                tokens, ids, w = _inputs(seed, r, it, E, K, H, skew)
                et, tpe, handle = dispatch(comm, tokens, ids, w, E)
                # reference: rows for local expert e, by source rank, then (token, k) order
                want, counts = [], []
                for e in range(r * per, (r + 1) * per):
                    c = 0
                    for s in range(n):
                        ts, ids_s, _ = _inputs(seed, s, it, E, K, H, skew)
                        t_idx, k_idx = (ids_s == e).nonzero(as_tuple=True)  # row-major = (t, k) order
                        want.append(ts[t_idx])
                        c += len(t_idx)
                    counts.append(c)
                assert tpe.tolist() == counts, (skew, tpe.tolist(), counts)
                assert torch.equal(et, torch.cat(want).reshape(-1, H)), f"seed {seed} {skew}: dispatch rows differ"
                # experts: a per-expert deterministic map, so the combined result is checkable
                scale = torch.repeat_interleave(torch.arange(r * per, (r + 1) * per, dtype=torch.float32) + 1, tpe)
                y = combine(comm, et * scale[:, None], handle)
                ref = (w[..., None] * tokens[:, None, :] * (ids[..., None].float() + 1)).sum(1)  # -1 adds 0
                _close(y, ref, 1e-6)

    body()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("skew", ["uniform", "masked"])
@world(3, timeout=120)
def test_autograd_through_dispatch_and_combine(transport, skew):
    """Gradients wrt tokens, weights and expert outputs equal those of the same
    computation done locally (fp64, so they must agree to 1e-12); a masked
    (-1) pair is not sent and takes no gradient."""
    seed = seeded()
    E, K, H = 6, 2, 5
    with varcomm.init(transport=transport, bound=1 << 20, timeout=60) as comm:
        r, n = comm.rank, comm.world_size
        per = E // n
        tokens, ids, w = _inputs(seed, r, 0, E, K, H, skew)
        tokens = tokens.double().requires_grad_(True)
        w = w.double().requires_grad_(True)
        scale = torch.arange(1, E + 1, dtype=torch.float64)
        et, tpe, handle = dispatch(comm, tokens, ids, w, E)
        mine = torch.repeat_interleave(scale[r * per:(r + 1) * per], tpe)
        y = combine(comm, torch.tanh(et) * mine[:, None], handle)
        (y ** 2).sum().backward()
        # local reference: same function, no communication
        t2 = tokens.detach().clone().requires_grad_(True)
        w2 = w.detach().clone().requires_grad_(True)
        ref = (w2[..., None] * torch.tanh(t2)[:, None, :] * torch.where(ids >= 0, scale[ids], 0)[..., None]).sum(1)
        (ref ** 2).sum().backward()
        _close(y.detach(), ref.detach(), 1e-12)
        _close(tokens.grad, t2.grad, 1e-12)
        _close(w.grad, w2.grad, 1e-12)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 4])
def test_example_moe_layer_equals_single_process(transport, n):
    """examples/moe.py: outputs, loss and every gradient of an expert-parallel
    layer equal the single-process layer for 3 SGD steps (fp32, atol=rtol=1e-5)."""
    mod = _example()

    @world(n, timeout=120)
    def body():
        with varcomm.init(transport=transport, bound=1 << 20, timeout=60) as comm:
            worst = mod.run(comm)
            assert worst <= mod.ATOL

    body()


@world(2, timeout=60)
def test_bf16_tokens_and_argument_errors():
    with varcomm.init(bound=1 << 20, timeout=30) as comm:
        r = comm.rank
        tokens = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4) + 100 * r
        ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1], [0, 2]])
        w = torch.ones(6, 2, dtype=torch.bfloat16)
        et, tpe, h = dispatch(comm, tokens, ids, w, 4)
        assert et.dtype == torch.bfloat16 and et.shape == (int(tpe.sum()), 4)
        y = combine(comm, et, h)
        assert torch.equal(y, 2 * tokens)
        with pytest.raises(varcomm.InvalidArgument, match="multiple"):
            dispatch(comm, tokens, ids, w, 3)
        with pytest.raises(varcomm.InvalidArgument, match=r"\[0, 4\), or be -1 .*got 4 \(2 such\)"):
            dispatch(comm, tokens, ids.index_put((torch.tensor([0, 1]), torch.tensor([0, 0])), torch.tensor([4, 7])),
                     w, 4)
        with pytest.raises(varcomm.InvalidArgument, match=r"got -2 \(1 such\)"):
            dispatch(comm, tokens, ids.index_put((torch.tensor([2]), torch.tensor([1])), torch.tensor([-2])), w, 4)
        # Integer outputs would take the weights in their dtype (0.5 -> 0: every sum 0).
        with pytest.raises(varcomm.InvalidArgument, match="floating-point expert outputs"):
            combine(comm, et.to(torch.int64), h)
        assert torch.equal(combine(comm, et, h), 2 * tokens)  # the handle is still good
        # bf16 outputs with float32 weights: weighted and summed in float32, then
        # rounded once (the weights were cast to bf16 first: 0.3 -> 0.30078125).
        wf = torch.rand(6, 2, generator=torch.Generator().manual_seed(7))
        et, _, h = dispatch(comm, tokens, ids, wf, 4)
        want = (tokens.float()[:, None, :] * wf[:, :, None]).sum(dim=1).to(torch.bfloat16)
        y = combine(comm, et, h)
        assert y.dtype == torch.bfloat16 and torch.equal(y, want), (y - want).abs().max()
        # A masked pair's weight is not read: a NaN (or inf) there is not a NaN in y.
        wn = wf.clone()
        wn[0, 1], wn[3, 0] = float("nan"), float("inf")
        masked = ids.clone()
        masked[0, 1] = masked[3, 0] = -1
        et, _, h = dispatch(comm, tokens, masked, wn, 4)
        keep = (masked >= 0).float()
        want = (tokens.float()[:, None, :] * (wf * keep)[:, :, None]).sum(dim=1).to(torch.bfloat16)
        assert torch.equal(combine(comm, et, h), want)


@world(2, timeout=60)
def test_a_call_one_rank_refuses_is_refused_to_its_peer_and_the_next_pairs_up():
    """One rank's dispatch (bad topk_ids) or combine (wrong row count) fails
    its argument check before any all-to-all: the peer fails that same call
    (MessageMismatch naming the rank) instead of pairing it with the refusing
    rank's next call and taking its data (silently wrong tokens)."""
    with varcomm.init(timeout=30) as comm:
        r, E, T = comm.rank, 4, 3
        for step in range(3):
            tokens = torch.full((T, 4), float(100 * step + r))
            ids = torch.full((T, 1), E - 1 if r == 0 else 0)  # each rank's tokens go to the other's expert
            if r == 1 and step == 0:
                with pytest.raises(varcomm.InvalidArgument, match=r"\[0, 4\)"):
                    dispatch(comm, tokens, ids + E, torch.ones(T, 1), E)
                continue
            if r == 0 and step == 0:
                with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused"):
                    dispatch(comm, tokens, ids, torch.ones(T, 1), E)
                continue
            et, _, h = dispatch(comm, tokens, ids, torch.ones(T, 1), E)
            assert set(et[:, 0].tolist()) == {float(100 * step + 1 - r)}, (step, et)
            if step == 1 and r == 1:
                with pytest.raises(varcomm.InvalidArgument, match=r"^moe.combine on rank 1: expert_outputs has \d+ "
                                                                  r"rows; dispatch delivered \d+"):
                    combine(comm, et[:-1], h)
                continue
            if step == 1 and r == 0:
                with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused"):
                    combine(comm, et, h)
                continue
            assert torch.equal(combine(comm, et, h), tokens)


@world(2, timeout=60)
def test_tokens_of_another_dtype_or_width_on_a_peer_raise_mismatch_not_reinterpret():
    """Rank 1's tokens are float16 [T, 8] where rank 0's are float32 [T, 4]:
    the same 16 bytes per row. Both ranks raise MessageMismatch naming the
    other (as all_to_all_v does), instead of each reading the other's bytes
    as its own dtype (rows were packed as uint8, so only their byte counts
    were compared); the next dispatch pairs up right. Float topk_ids are
    refused, not truncated to an expert index."""
    with varcomm.init(timeout=30) as comm:
        r, E, T = comm.rank, 2, 3
        ids = torch.full((T, 1), 1 - r)  # each rank's tokens go to the other's expert
        for bad in ((torch.float32, 4, torch.float16, 8), (torch.float32, 4, torch.float64, 2),
                    (torch.float32, 4, torch.float32, 5)):
            dt, H = bad[2 * r], bad[2 * r + 1]
            pdt, pH = bad[2 - 2 * r], bad[3 - 2 * r]
            name = str(dt).removeprefix("torch.")
            with pytest.raises(varcomm.MessageMismatch) as e:
                dispatch(comm, torch.ones(T, H, dtype=dt), ids, torch.ones(T, 1), E)
            # in the tokens' terms: not the packed rows' width, which adds the expert index (helper-66)
            assert str(e.value) == (f"moe.dispatch on rank {r}: rank {1 - r}'s tokens are "
                                    f"{str(pdt).removeprefix('torch.')} [T, {pH}] where rank {r}'s are {name} "
                                    f"[T, {H}]; every rank must pass tokens of one dtype and hidden size H"), e.value
            assert e.value.peer == 1 - r
        with pytest.raises(varcomm.InvalidArgument, match="integer"):
            dispatch(comm, torch.ones(T, 4), ids.double() + 0.7, torch.ones(T, 1), E)
        for dt in (torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.complex128, torch.bool):
            tokens = (torch.arange(T * 6).reshape(T, 6) % 2 + 10 * r).to(dt)
            et, tpe, h = dispatch(comm, tokens, ids, torch.ones(T, 1), E)
            assert et.dtype == dt and torch.equal(et, (torch.arange(T * 6).reshape(T, 6) % 2 + 10 * (1 - r)).to(dt))
            assert tpe.tolist() == [T]  # one expert per rank
            if dt.is_floating_point:
                assert torch.equal(combine(comm, et, h), tokens)


@world(2, timeout=60)
def test_a_peer_with_another_num_experts_is_named_not_carried_on():
    """Rank 0 thinks there are 4 experts (2 per rank), rank 1 thinks 2 (1 per
    rank): rank 0's tokens for its expert 3 arrive at rank 1 as local expert
    1, which rank 1 does not have, and rank 1's arrive at rank 0 from a rank
    of another num_experts. Each raises MessageMismatch naming the other
    (rank 1 returned tokens_per_expert [4, 2] for its one expert, rank 0 went
    on into combine alone, where it waited for its timeout)."""
    with varcomm.init(timeout=30) as comm:
        r = comm.rank
        E = 4 if r == 0 else 2
        ids = torch.tensor([[3], [2], [3], [2]]) if r == 0 else torch.tensor([[0], [0], [1], [1]])
        other, theirs = 1 - r, 2 if r == 0 else 4
        with pytest.raises(varcomm.MessageMismatch,
                           match=f"rank {other} passed num_experts {theirs} where rank {r} passed {E}: every rank "
                                 "must pass the same num_experts") as ei:
            dispatch(comm, torch.ones(4, 3), ids, torch.ones(4, 1), E)
        assert ei.value.peer == other
        comm.barrier()


@world(3, timeout=60)
def test_another_num_experts_is_told_to_a_rank_it_sends_no_rows():
    """Rank 1 passes num_experts=6 where the others pass 3; it routes every
    token to rank 0, so rank 2 gets no rows from it. num_experts travelled in
    the rows only: ranks 0 and 1 raised, rank 2 returned as if nothing were
    wrong and went on alone into combine. Now every dispatch chunk carries it,
    a chunk of no rows too: every rank raises, naming the difference, and the
    next call pairs up."""
    with varcomm.init(timeout=30) as comm:
        r = comm.rank
        E = 6 if r == 1 else 3
        ids = torch.zeros((4, 1), dtype=torch.int64)  # every token to expert 0 (rank 0)
        with pytest.raises(varcomm.MessageMismatch, match=r"passed num_experts [36] where rank \d passed [36]: every "
                                                          r"rank must pass the same num_experts"):
            dispatch(comm, torch.ones(4, 3), ids, torch.ones(4, 1), E)
        got, rows = A.all_to_all_v(comm, torch.arange(3.0) + 10 * r, [1, 1, 1])
        assert rows == [1, 1, 1] and got.tolist() == [r, 10.0 + r, 20.0 + r]


@world(2, timeout=60)
def test_a_handle_of_an_earlier_dispatch_is_told_even_where_the_row_counts_agree():
    """Rank 0 combines with the handle of the step before, whose row counts
    equal this step's: rank 0 got its tokens back in the wrong order and
    rank 1's combine went through, with no error anywhere. Now the combine's
    chunks say which dispatch they undo: both ranks raise MessageMismatch
    naming the stale handle, and the next call pairs up."""
    with varcomm.init(timeout=30) as comm:
        r, E, T = comm.rank, 2, 4
        ids = torch.tensor([[0], [1], [0], [1]])
        tok = torch.arange(T * 3, dtype=torch.float32).reshape(T, 3) + 100 * r
        et, _, old = dispatch(comm, tok, ids, torch.ones(T, 1), E)
        assert torch.equal(combine(comm, et, old), tok)
        et, _, new = dispatch(comm, tok.flip(0), ids, torch.ones(T, 1), E)  # the same counts, other rows
        with pytest.raises(varcomm.MessageMismatch, match=r"passed the handle of dispatch call \d+ where rank \d "
                                                          r"passed \d+: a rank combined with the handle of another "
                                                          r"dispatch"):
            combine(comm, et, old if r == 0 else new)
        et, _, h = dispatch(comm, tok, ids, torch.ones(T, 1), E)
        assert torch.equal(combine(comm, et, h), tok)


@world(2, timeout=60)
def test_one_received_row_of_1_or_2_byte_tokens_whose_width_is_not_4_aligned():
    """A rank that receives exactly one row of uint8 / float8 / bfloat16 tokens
    whose H * itemsize is not a multiple of 4: the expert index sat at byte
    H * itemsize of the received row, and contiguous() kept the one-row slice
    in place, so view(int32) raised RuntimeError (storage_offset not divisible
    by 4) on that rank only, after the exchange. H = 0 rows come back [R, 0]
    (reshape(-1, 0) raised). Each is as a reference computes it."""
    with varcomm.init(timeout=30) as comm:
        r = comm.rank
        ids = torch.tensor([[1 - r]])  # one token, to the other rank's one expert
        for dt, H in ((torch.uint8, 1), (torch.float8_e4m3fn, 3), (torch.bfloat16, 5), (torch.bool, 2),
                      (torch.float16, 0), (torch.float32, 0)):
            base = torch.arange(H).reshape(1, H) % 2 + (0 if dt == torch.bool else 3 * r)
            tokens = base.to(torch.float32).to(dt)
            want = (torch.arange(H).reshape(1, H) % 2 + (0 if dt == torch.bool else 3 * (1 - r))).float().to(dt)
            et, tpe, h = dispatch(comm, tokens, ids, torch.ones(1, 1), 2)
            assert et.dtype == dt and et.shape == (1, H) and tpe.tolist() == [1], (dt, H, et.shape, tpe)
            assert torch.equal(et.view(torch.uint8), want.view(torch.uint8)), (dt, H, et, want)
            if dt in (torch.bfloat16, torch.float16, torch.float32):
                assert torch.equal(combine(comm, et, h), tokens), (dt, H)
        t = torch.randn(1, 5, dtype=torch.float64).to(torch.bfloat16).requires_grad_(True)  # backward too
        et, _, h = dispatch(comm, t, ids, torch.ones(1, 1), 2)
        (combine(comm, et * 2, h) ** 2).sum().backward()
        assert torch.equal(t.grad, 8 * t.detach())


@world(2, timeout=60)
def test_a_dtype_or_width_mismatch_in_dispatch_is_told_in_the_tokens_terms():
    """float32 [T, 4] on rank 0, float16 [T, 4] on rank 1: the same H. The
    error came from the packed rows' all_to_all_v ("rank 1 is float16 of shape
    (3, 6), but rank 0's x is float32 with rows of shape (5,)"), naming widths
    that include the expert index's extra elements, as if the H differed; it
    says moe.dispatch, and both ranks' tokens' dtype and H."""
    with varcomm.init(timeout=30) as comm:
        r = comm.rank
        dt = torch.float32 if r == 0 else torch.float16
        with pytest.raises(varcomm.MessageMismatch, match=f"rank {1 - r}") as ei:
            dispatch(comm, torch.ones(3, 4, dtype=dt), torch.full((3, 1), 1 - r), torch.ones(3, 1), 2)
        msg = str(ei.value)
        name, other = str(dt).removeprefix("torch."), "float16" if r == 0 else "float32"
        assert msg.startswith(f"moe.dispatch on rank {r}: rank {1 - r}'s tokens are {other} [T, 4] where rank "
                              f"{r}'s are {name} [T, 4]"), msg
        assert ei.value.peer == 1 - r
        et, _, h = dispatch(comm, torch.ones(3, 4), torch.full((3, 1), 1 - r), torch.ones(3, 1), 2)  # pairs up
        assert torch.equal(combine(comm, et, h), torch.ones(3, 4))


@world(3, timeout=90)
def test_a_width_mismatch_and_a_refusal_are_both_told():
    """3 ranks: rank 1 refuses its dispatch (an expert id out of range), rank
    2's tokens are float16. Rank 0's error kept only the first part the core
    named, in tokens' terms, and lost the refusal (helper-68): now each part
    is told, the width one in tokens' terms, and peer is the first named."""
    with varcomm.init(timeout=20) as comm:
        r = comm.rank
        dt = torch.float16 if r == 2 else torch.float32
        ids = torch.full((3, 1), 7 if r == 1 else (r + 1) % 3)
        with pytest.raises(varcomm.VarcommError) as e:
            dispatch(comm, torch.ones(3, 4, dtype=dt), ids, torch.ones(3, 1), 3)
        if r == 0:
            text = str(e.value)
            assert text.startswith("moe.dispatch on rank 0: ") and "rank 1 refused" in text, text
            assert "rank 2's tokens are float16 [T, 4] where rank 0's are float32 [T, 4]" in text, text
            assert e.value.peer == 1, (e.value.peer, text)
        comm.barrier()


@world(2, timeout=60)
def test_no_tokens_in_a_strided_tensor_dispatch_and_combine():
    """A rank with no tokens whose tensor is a column-strided view (x[:, ::2]
    of an empty batch): torch calls an empty tensor contiguous whatever its
    strides, and the byte view of it raised RuntimeError on that rank (its peer
    got a refusal). Now it dispatches nothing and gets back its peer's rows,
    and combine gives [0, H]. Catches: the RuntimeError."""
    with varcomm.init(timeout=30) as comm:
        r = comm.rank
        if r == 0:
            tokens = torch.randn(0, 16)[:, ::2]
            ids = torch.zeros(0, 1, dtype=torch.int64)
        else:
            tokens = torch.arange(8.0).reshape(1, 8)
            ids = torch.tensor([[0]])  # to rank 0's expert
        et, tpe, h = dispatch(comm, tokens, ids, torch.ones(ids.shape), 2)
        assert tpe.tolist() == ([1] if r == 0 else [0]), tpe
        if r == 0:
            assert torch.equal(et, torch.arange(8.0).reshape(1, 8)), et
        y = combine(comm, et, h)
        assert y.shape == tokens.shape and (r == 0 or torch.equal(y, tokens)), (r, y)


@world(2, timeout=60)
def test_mistaken_argument_types_are_refused_to_the_peer_too():
    """A float num_experts, numpy tokens, no topk_weights or numpy expert
    outputs on one rank raised torch's own error (NotImplementedError,
    AttributeError), which was not refused to the peer: its call paired with
    this rank's next and took that step's tokens, with no error. Now each is
    InvalidArgument naming the argument, the peer's same call fails naming
    this rank, and the next step pairs up."""
    with varcomm.init(timeout=30) as comm:
        r, E, T = comm.rank, 4, 2
        mistakes = [dict(num_experts=float(E)), dict(tokens="numpy"), dict(topk_weights=None), dict(outputs="numpy"),
                    dict(outputs="no handle")]
        for step, wrong in enumerate(mistakes + [{}]):
            tokens = torch.full((T, 3), float(100 * step + r))
            ids = torch.full((T, 1), E - 1 if r == 0 else 0)  # each rank's tokens go to the other's expert
            mine = wrong if r == 1 else {}
            args = (tokens.numpy() if mine.get("tokens") else tokens, ids,
                    None if "topk_weights" in mine else torch.ones(T, 1), mine.get("num_experts", E))
            if "outputs" not in wrong:
                if r == 1 and wrong:
                    with pytest.raises(varcomm.InvalidArgument, match="num_experts must be an int|torch.Tensor"):
                        dispatch(comm, *args)
                    continue
                if r == 0 and wrong:
                    with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused"):
                        dispatch(comm, *args)
                    continue
            et, _, h = dispatch(comm, *args)
            assert set(et[:, 0].tolist()) == {float(100 * step + 1 - r)}, (step, et)
            if "outputs" in wrong:
                if r == 1 and wrong["outputs"] == "numpy":
                    with pytest.raises(varcomm.InvalidArgument, match="expert_outputs must be a torch.Tensor"):
                        combine(comm, et.numpy(), h)
                elif r == 1:  # (it was taken for the device form's handle: AttributeError, not refused)
                    with pytest.raises(varcomm.InvalidArgument, match="handle must be the third value"):
                        combine(comm, et, None)
                else:
                    with pytest.raises(varcomm.MessageMismatch, match="rank 1 refused"):
                        combine(comm, et, h)
                continue
            assert torch.equal(combine(comm, et, h), tokens)


@pytest.mark.parametrize("transport", TRANSPORTS)
@world(2, timeout=60)
def test_routing_skewed_past_the_bound_still_dispatches_and_combines(transport):
    """Every (token, k) pair to rank 1's experts: rank 0's chunk for rank 1 is
    over 8x the bound. It travels by rendezvous (before: MessageTooLarge on every
    rank, so a MoE step failed once routing skewed), and y and the gradients
    are one process's."""
    E, K, H, T = 4, 2, 16, 250
    with varcomm.init(transport=transport, bound=8192, slots=4, timeout=30) as comm:
        r = comm.rank
        g = torch.Generator().manual_seed(5 + r)
        tokens = torch.randn(T, H, generator=g, dtype=torch.float64).requires_grad_(True)
        ids = torch.stack([torch.full((T,), 2), torch.full((T,), 3)], 1)
        w = torch.rand(T, K, generator=g, dtype=torch.float64).requires_grad_(True)
        et, tpe, h = dispatch(comm, tokens, ids, w, E)
        assert tpe.tolist() == ([0, 0] if r == 0 else [2 * T, 2 * T])
        assert T * K * (H + 1) * 8 > 8 * 8192  # rank 0's chunk for rank 1: H + 1 float64 per row
        per = torch.repeat_interleave(torch.arange(2 * r + 1.0, 2 * r + 3.0, dtype=torch.float64), tpe)
        y = combine(comm, et * per[:, None], h)
        (y ** 2).sum().backward()
        t2 = tokens.detach().clone().requires_grad_(True)
        w2 = w.detach().clone().requires_grad_(True)
        ref = (w2[..., None] * t2[:, None, :] * (ids[..., None] + 1.0)).sum(1)
        (ref ** 2).sum().backward()
        _close(y.detach(), ref.detach(), 1e-12)
        _close(tokens.grad, t2.grad, 1e-12)
        _close(w.grad, w2.grad, 1e-12)


@world(2, timeout=60)
def test_combine_checks_its_handle_the_rows_sent_back_and_names_moe_in_peers_errors():
    """A handle combined over another communicator (its ranks' rows would go
    to that one's ranks) is refused. Ranks out of step (rank 0 combines while
    rank 1 dispatches again) are named as such, with the rows that came back,
    where rank 0 raised torch's shape error; the peers of a refused or
    mismatched call are told moe.dispatch / moe.combine and expert_outputs,
    not the all_to_all_v underneath and its x."""
    with varcomm.init(timeout=30) as comm, varcomm.init(timeout=30) as other:
        r, E = comm.rank, 2
        T = 3 if r == 0 else 2
        ids = torch.full((T, 1), 1 - r)  # each rank's tokens to the other's expert
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        with pytest.raises(varcomm.InvalidArgument, match="another communicator"):
            combine(other, et, h)
        assert torch.equal(combine(comm, et, h), torch.ones(T, 4))  # the handle is still good
        # One rank alone passes the wrong communicator: the refusal reaches its
        # peer's combine on the handle's communicator (it went to the wrong one,
        # and the peer's combine took this rank's next call), and both stay in step.
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        if r == 0:
            with pytest.raises(varcomm.InvalidArgument, match="another communicator"):
                combine(other, et, h)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="^moe.combine on rank 1: rank 0 refused"):
                combine(comm, et, h)
        assert A.all_to_all_v(other, torch.arange(2) + 10 * r, [1, 1])[0].tolist() == [r, 10 + r]
        # ... also when its expert outputs are wrong too (that check came first,
        # and its refusal went to the communicator passed by mistake)
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        if r == 0:
            with pytest.raises(varcomm.InvalidArgument, match="another communicator"):
                combine(other, et.int(), h)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="^moe.combine on rank 1: rank 0 refused"):
                combine(comm, et, h)
        assert A.all_to_all_v(other, torch.arange(2) + 10 * r, [1, 1])[0].tolist() == [r, 10 + r]
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        # Rank 0 combines while rank 1 dispatches again: each chunk says which kind of call it belongs to
        # (A2APlan::agree), so both are told out of step, even where the rows' count and width agree
        if r == 0:
            with pytest.raises(varcomm.MessageMismatch, match=r"^moe.combine on rank 0: rank 1 ran another "
                                                              r"collective where rank 0 ran moe.combine: the ranks "
                                                              r"are out of step") as ei:
                combine(comm, torch.ones(et.shape[0], 6), h)
            assert ei.value.peer == 1
        else:
            with pytest.raises(varcomm.MessageMismatch, match=r"^moe.dispatch on rank 1: rank 0 ran another "
                                                              r"collective where rank 1 ran moe.dispatch: the ranks "
                                                              r"are out of step"):
                dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        # In step again: a width mismatch in combine names it in combine's terms.
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        with pytest.raises(varcomm.MessageMismatch, match=rf"^moe.combine on rank {r}: the chunk from rank {1 - r} "
                                                          rf".*rank {r}'s expert_outputs is float32"):
            combine(comm, torch.ones(et.shape[0], 4 + r), h)
        if r == 1:
            with pytest.raises(varcomm.InvalidArgument, match="topk_ids"):
                dispatch(comm, torch.ones(T, 4), ids + 5, torch.ones(T, 1), E)
        else:
            with pytest.raises(varcomm.MessageMismatch, match="^moe.dispatch on rank 0: rank 1 refused"):
                dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        et, _, h = dispatch(comm, torch.ones(T, 4), ids, torch.ones(T, 1), E)
        assert torch.equal(combine(comm, et, h), torch.ones(T, 4))


@world(2, timeout=60)
def test_a_rank_that_skips_backward_leaves_its_peer_a_timeout_that_says_the_rule():
    """Rank 1 runs no backward (its tokens do not require grad): rank 0's
    backward all-to-all times out naming moe.combine's backward and the rule
    that every rank runs backward through dispatch and combine."""
    import time

    with varcomm.init(timeout=1.5) as comm:
        r = comm.rank
        t = torch.ones(2, 4, requires_grad=r == 0)
        et, _, h = dispatch(comm, t, torch.full((2, 1), 1 - r), torch.ones(2, 1), 2)
        y = combine(comm, et, h)
        if r == 0:
            with pytest.raises(varcomm.TimeoutError, match=r"^moe.combine's backward on rank 0 timed out.*every rank "
                                                           r"must run backward through moe.dispatch and moe.combine"):
                y.sum().backward()
        else:
            time.sleep(3)


@world(2, timeout=60)
def test_a_rank_that_skips_backward_and_goes_on_is_named_out_of_step_on_both():
    """Rank 1 runs no backward and goes on to its next dispatch: rank 0's
    backward all-to-all met rank 1's forward. Rank 0 was told of a trailing
    shape, rank 1 that the tokens' hidden sizes differ (or, with shapes that
    agree, each took the other's data). Chunks carry their call's kind: both
    raise MessageMismatch saying the ranks are out of step."""
    with varcomm.init(timeout=20) as comm:
        r = comm.rank
        t = torch.ones(2, 4, requires_grad=r == 0)
        ids = torch.full((2, 1), 1 - r)
        et, _, h = dispatch(comm, t, ids, torch.ones(2, 1), 2)
        y = combine(comm, et, h)
        with pytest.raises(varcomm.MessageMismatch, match="out of step") as ei:
            if r == 0:
                y.sum().backward()
            else:
                dispatch(comm, torch.ones(2, 4), ids, torch.ones(2, 1), 2)
        assert ("moe.combine's backward" if r == 0 else "moe.dispatch") in str(ei.value), str(ei.value)
        et, _, h = dispatch(comm, torch.ones(2, 4), ids, torch.ones(2, 1), 2)  # in step again
        assert torch.equal(combine(comm, et, h), torch.ones(2, 4))
