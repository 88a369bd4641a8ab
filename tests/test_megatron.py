"""VarcommP2PCommunicator against the real megatron-core (optional: skipped when
megatron-core is not installed; it imports on CPU, `pip install megatron-core`).

Megatron's non-interleaved 1F1B calling pattern (the calls
forward_backward_pipelining_without_interleaving makes, in its order), on
packed microbatches of different lengths in Megatron's [s, b, h] layout,
against the same model in one process; with torch.cuda.synchronize and
current_device made to fail (no host sync, no CUDA), and every message
recorded (no shape messages). Float32, rtol 1e-6, atol 1e-7."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core.pipeline_parallel.p2p_communication", reason="megatron-core is not installed")

import varcomm.torch
from varcomm.testing import world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pipeline_varlen as pv

CFG = pv.Config(vocab=48, hidden=32, heads=2, layers=4, max_len=24, max_seqs=3)
N_MICRO = 5


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the varcomm communicator must not touch CUDA (synchronize, current_device)")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "current_device", refuse)
    with pytest.raises(AssertionError, match="must not touch CUDA"):
        torch.cuda.synchronize()


def _communicator():
    from megatron.core.model_parallel_config import ModelParallelConfig

    from varcomm.integrations.megatron import VarcommP2PCommunicator

    config = ModelParallelConfig(pipeline_model_parallel_size=dist.get_world_size(), variable_seq_lengths=True,
                                 pipeline_dtype=torch.float32)
    return VarcommP2PCommunicator(dist.distributed_c10d._get_default_group(), config)


@world(2, timeout=120)
def test_megatron_1f1b_pattern_matches_one_process(monkeypatch):
    dist.init_process_group("varcomm")
    try:
        _no_cuda(monkeypatch)
        rank, pp = dist.get_rank(), dist.get_world_size()
        first, last = rank == 0, rank == pp - 1
        p2p = _communicator()
        sent: list[torch.Tensor] = []
        real = p2p.comm.isend
        p2p.comm.isend = lambda t, *a, **k: sent.append(t) or real(t, *a, **k)

        model = pv.build_model(CFG, 0, torch.float32)
        stage = pv.Stage(model, rank, pp)
        batches = pv.make_batches(CFG, 0, N_MICRO, seed=4)
        assert len({int(mb.cu_seqlens[-1]) for mb in batches}) > 1
        total = pv.n_tokens(batches)
        losses: list[float] = []
        fwd_i = 0

        def forward_step(input_tensor):  # [s, b=1, h] in, [s, 1, h] out (last: the loss)
            nonlocal fwd_i
            mb = batches[fwd_i]
            fwd_i += 1
            y = stage(mb.tokens if first else input_tensor.squeeze(1), mb.cu_seqlens)
            if last:
                loss = pv.loss_of(y, mb, total)
                losses.append(float(loss.detach()))
                return loss
            return y.unsqueeze(1)

        def backward_step(input_tensor, output_tensor, output_tensor_grad):
            torch.autograd.backward(output_tensor, grad_tensors=None if last else output_tensor_grad)
            return None if first else input_tensor.grad

        shape = [CFG.max_len, 1, CFG.hidden]  # what Megatron passes; ignored: the data has its own
        warmup = min(pp - rank - 1, N_MICRO)
        remaining = N_MICRO - warmup
        inputs, outputs = [], []
        for _ in range(warmup):
            x = p2p.recv_forward(shape, first)
            y = forward_step(x)
            p2p.send_forward(y, last)
            inputs.append(x)
            outputs.append(y)
        x = p2p.recv_forward(shape, first) if remaining > 0 else None
        for i in range(remaining):
            y = forward_step(x)
            dy = p2p.send_forward_recv_backward(y, shape, last)
            inputs.append(x)
            outputs.append(y)
            x, y = inputs.pop(0), outputs.pop(0)
            dx = backward_step(x, y, dy)
            if i == remaining - 1:
                x = None
                p2p.send_backward(dx, first)
            else:
                x = p2p.send_backward_recv_forward(dx, shape, first)
        for _ in range(warmup):
            x, y = inputs.pop(0), outputs.pop(0)
            dy = p2p.recv_backward(shape, last)
            p2p.send_backward(backward_step(x, y, dy), first)

        # the same in one process
        ref = pv.build_model(CFG, 0, torch.float32)
        whole = pv.Stage(ref, 0, 1)
        want = []
        for mb in batches:
            loss = pv.loss_of(whole(mb.tokens, mb.cu_seqlens), mb, total)
            loss.backward()
            want.append(float(loss.detach()))
        if last:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-7)
        ref_params = dict(ref.named_parameters())
        mine = {id(p) for p in stage.parameters()}
        checked = 0
        for name, p in model.named_parameters():
            if id(p) in mine:
                torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, n=name: f"gradient of {n}: {m}")
                checked += 1
        assert checked
        # only activations [T, 1, H] and their gradients went out: no shape messages
        lengths = sorted(int(mb.cu_seqlens[-1]) for mb in batches)
        assert all(t.dim() == 3 and t.dtype == torch.float32 for t in sent), [(t.shape, t.dtype) for t in sent]
        assert sorted(t.shape[0] for t in sent) == lengths
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_megatron_overlapped_and_combined_calls(monkeypatch):
    dist.init_process_group("varcomm")
    try:
        _no_cuda(monkeypatch)
        r = dist.get_rank()
        p2p = _communicator()
        mine = torch.full((3 + r, 1, 4), float(r))  # each rank's own length
        theirs = (3 + (1 - r), 1, 4)
        got, handles = p2p.send_forward_recv_forward(mine, recv_prev=True, tensor_shape=[1, 1, 4],
                                                     overlap_p2p_comm=True)
        assert set(handles) == {"send_next", "recv_prev"}
        for h in handles.values():
            h.wait()
        assert got.shape == theirs and bool((got == 1 - r).all()) and got.requires_grad and got.is_leaf
        grad, handles = p2p.send_backward_recv_backward(mine * 10, recv_next=True, tensor_shape=None,
                                                        overlap_p2p_comm=True)
        for h in handles.values():
            h.wait()
        assert grad.shape == theirs and bool((grad == 10.0 * (1 - r)).all())
        # both directions at once (a 2-rank ring: prev and next are the same peer)
        x, dy = p2p.send_forward_backward_recv_forward_backward(mine, mine + 100, recv_prev=True, recv_next=True,
                                                                 tensor_shape=[9])
        assert x.shape == theirs and dy.shape == theirs
        assert {float(x.flatten()[0]), float(dy.flatten()[0])} == {float(1 - r), 100.0 + (1 - r)}
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_megatron_communicator_needs_a_varcomm_group():
    from megatron.core.model_parallel_config import ModelParallelConfig

    from varcomm.integrations.megatron import VarcommP2PCommunicator

    dist.init_process_group("varcomm")
    try:
        gloo = dist.new_group(backend="gloo")
        with pytest.raises(ValueError, match="not on the varcomm backend"):
            VarcommP2PCommunicator(gloo, ModelParallelConfig(pipeline_dtype=torch.float32))
        assert isinstance(varcomm.torch.comm_of(), varcomm.Communicator)
    finally:
        dist.destroy_process_group()
