"""Pipeline-parallel training on packed variable-length sequences, with no padding
and no shape messages.

A small transformer (default: 4 layers, hidden 64, 2 heads) is split into one
stage per rank and trained with a 1F1B schedule. Each micro-batch is a few
sequences of random lengths packed into one [T] token row, described by
``cu_seqlens`` (cumulative lengths, as flash-attention uses them); attention is
causal within each sequence (a block-diagonal mask built from cu_seqlens). T
changes on every micro-batch.

Between stages, activations [T, hidden] go forward and their gradients come
back through varcomm: ``comm.send(y, dst)`` / ``comm.recv(src)``. The receiver
does not know T in advance and does not need to: the shape travels with the
data. cu_seqlens go along as their own small message.

``--backend fallback`` runs the same code on varcomm's fallback transport
(``varcomm.init(transport="fallback")``): over torch.distributed gloo, a shape
header then the payload, the way Megatron's ``variable_seq_lengths`` path moves
variable-size tensors. ``--backend megatron`` spells that path out here with
plain torch.distributed calls: a shape message, a blocking ``.tolist()``,
allocate, receive the payload. ``--compare`` trains with all three (same
model, same data: the losses must agree) and prints the step time of each.

    python -m varcomm.run -n 2 examples/pipeline_varlen.py --steps 5
    python -m varcomm.run -n 4 examples/pipeline_varlen.py --steps 5 --compare
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import varcomm

TAG_ACT, TAG_CU, TAG_GRAD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 96
    hidden: int = 64
    heads: int = 2
    layers: int = 4
    max_len: int = 64  # longest sequence (and learned positions)
    max_seqs: int = 4  # sequences per micro-batch: 1..max_seqs, lengths 2..max_len


# ---------------------------------------------------------------------------
# the model


def seq_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, position within its sequence) of every token of a packed row."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[:-1].long()[seg]
    return seg, pos


def attention_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: token i may attend to token j iff same sequence and j <= i."""
    seg, pos = seq_layout(cu_seqlens)
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        h = cfg.hidden
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [heads, T, head_dim]
        x = x + self.proj(a.transpose(0, 1).reshape(t, h))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)


class Stage(nn.Module):
    """Stage `index` of `n` of a TinyLM (its modules, shared with the model):
    the first embeds tokens, the last ends in the LM head's logits."""

    def __init__(self, model: TinyLM, index: int, n: int):
        super().__init__()
        nl = len(model.blocks)
        lo, hi = index * nl // n, (index + 1) * nl // n
        self.first, self.last = index == 0, index == n - 1
        self.embed = model.embed if self.first else None
        self.pos = model.pos if self.first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.ln_f = model.ln_f if self.last else None
        self.head = model.head if self.last else None

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: token ids [T]
            x = self.embed(x) + self.pos(seq_layout(cu_seqlens)[1])
        mask = attention_mask(cu_seqlens)
        for b in self.blocks:
            x = b(x, mask)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def build_model(cfg: Config, seed: int, dtype: torch.dtype) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(cfg).to(dtype)


# ---------------------------------------------------------------------------
# data: packed micro-batches, a different total length every time


@dataclasses.dataclass
class MicroBatch:
    tokens: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64: the next token, -100 at the end of each sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32


def make_batches(cfg: Config, step: int, n_micro: int, seed: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    out = []
    for _ in range(n_micro):
        n_seq = int(torch.randint(1, cfg.max_seqs + 1, (), generator=g))
        lengths = torch.randint(2, cfg.max_len + 1, (n_seq,), generator=g)
        cu = torch.zeros(n_seq + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        # a learnable stream: mostly t -> (5 t + 1) mod vocab within each sequence, some noise
        t_all = int(cu[-1])
        tokens = torch.randint(0, cfg.vocab, (t_all,), generator=g)
        noise = torch.rand(t_all, generator=g) < 0.1
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            for k in range(a + 1, b):
                if not noise[k]:
                    tokens[k] = (5 * tokens[k - 1] + 1) % cfg.vocab
        labels = torch.roll(tokens, -1).clone()
        labels[cu[1:].long() - 1] = -100
        out.append(MicroBatch(tokens, labels, cu))
    return out


def loss_of(logits: torch.Tensor, mb: MicroBatch, total_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's mean token loss."""
    return F.cross_entropy(logits.float(), mb.labels, ignore_index=-100, reduction="sum") / total_tokens


def n_tokens(batches: list[MicroBatch]) -> int:
    return sum(int((mb.labels != -100).sum()) for mb in batches)


# ---------------------------------------------------------------------------
# how tensors move between stages


class Channel(Protocol):
    def send(self, t: torch.Tensor, dst: int, tag: int) -> None: ...

    def recv(self, src: int, tag: int, dtype: torch.dtype) -> torch.Tensor: ...

    def flush(self) -> None: ...


class VarcommChannel:
    """One message per tensor; the receiver learns shape and dtype from it."""

    name = "varcomm"

    def __init__(self, comm: varcomm.Communicator):
        self.comm = comm
        self.pending: list[Any] = []

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        # Posted, completed at flush: a large activation goes by rendezvous
        # (done only once received), and in 1F1B both neighbours send before
        # they receive.
        self.pending.append(self.comm.isend(t, dst, tag))

    def recv(self, src: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
        return self.comm.recv(src, tag)

    def flush(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending.clear()


class MegatronChannel:
    """Megatron's variable_seq_lengths way, over torch.distributed: the shape as
    its own message, a blocking .tolist() on the receiver, then the payload
    into a tensor allocated for it. Sends are posted (isend) and completed at
    the end of the step, as Megatron's batched p2p does."""

    name = "megatron"
    MAX_DIMS = 4

    def __init__(self, group: Any = None):
        self.group = group
        self.pending: list[Any] = []

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        header = torch.zeros(1 + self.MAX_DIMS, dtype=torch.int64)
        header[0] = t.dim()
        header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        t = t.contiguous()
        self.pending += [(dist.isend(header, dst, self.group, tag), header),
                         (dist.isend(t, dst, self.group, tag), t)]

    def recv(self, src: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
        header = torch.empty(1 + self.MAX_DIMS, dtype=torch.int64)
        dist.recv(header, src, self.group, tag)
        h = header.tolist()  # the host sync Megatron pays (a D2H copy on GPU)
        out = torch.empty(h[1:1 + h[0]], dtype=dtype)
        dist.recv(out, src, self.group, tag)
        return out

    def flush(self) -> None:
        for w, _keep in self.pending:
            w.wait()
        self.pending.clear()


# ---------------------------------------------------------------------------
# 1F1B


def train_step(stage: Stage, chan: Channel, rank: int, n_stages: int, batches: list[MicroBatch],
               dtype: torch.dtype) -> float | None:
    """One optimizer step's forward and backward passes over the micro-batches,
    1F1B: warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards. Returns the step's loss on the last stage."""
    prev, nxt = rank - 1, rank + 1
    m = len(batches)
    total = n_tokens(batches)
    warmup = min(n_stages - rank - 1, m)
    inputs: list[Any] = [None] * m
    outputs: list[Any] = [None] * m
    loss = 0.0

    def forward(i: int) -> None:
        nonlocal loss
        mb = batches[i]
        if stage.first:
            x, cu = mb.tokens, mb.cu_seqlens
        else:
            x = chan.recv(prev, TAG_ACT, dtype).requires_grad_()
            cu = chan.recv(prev, TAG_CU, torch.int32)
        y = stage(x, cu)
        if stage.last:
            y = loss_of(y, mb, total)
            loss += float(y.detach())
        else:
            chan.send(y.detach(), nxt, TAG_ACT)
            chan.send(cu, nxt, TAG_CU)
        inputs[i], outputs[i] = x, y

    def backward(i: int) -> None:
        y = outputs[i]
        if stage.last:
            y.backward()
        else:
            y.backward(chan.recv(nxt, TAG_GRAD, dtype))
        if not stage.first:
            chan.send(inputs[i].grad, prev, TAG_GRAD)
        inputs[i] = outputs[i] = None

    for i in range(warmup):
        forward(i)
    for j in range(m - warmup):
        forward(warmup + j)
        backward(j)
    for j in range(m - warmup, m):
        backward(j)
    chan.flush()
    return loss if stage.last else None


class Trainer:
    """This rank's stage, its optimizer and its channel; `step(i)` trains on step i's data."""

    def __init__(self, chan: Channel, rank: int, n_stages: int, cfg: Config, *, n_micro: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, lr: float = 0.5, barrier: Any = None):
        self.chan, self.rank, self.n_stages, self.cfg = chan, rank, n_stages, cfg
        self.n_micro, self.seed, self.dtype, self.barrier = n_micro, seed, dtype, barrier
        self.model = build_model(cfg, seed, dtype)
        self.stage = Stage(self.model, rank, n_stages)
        mine = {id(p) for p in self.stage.parameters()}
        self.names = [n for n, p in self.model.named_parameters() if id(p) in mine]
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=lr)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, step: int) -> None:
        batches = make_batches(self.cfg, step, self.n_micro, self.seed)
        if self.barrier is not None:
            self.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = train_step(self.stage, self.chan, self.rank, self.n_stages, batches, self.dtype)
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if n in self.names}
        self.opt.step()
        if self.barrier is not None:
            self.barrier()
        self.times.append(time.perf_counter() - t0)
        if loss is not None:
            self.losses.append(loss)

    def result(self) -> dict[str, Any]:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in self.names}
        return {"losses": self.losses, "grads": self.grads, "params": params, "times": self.times}


def train(chan: Channel, rank: int, n_stages: int, cfg: Config, *, steps: int, n_micro: int, seed: int = 0,
          dtype: torch.dtype = torch.float32, lr: float = 0.5, barrier: Any = None) -> dict[str, Any]:
    """Train this rank's stage for `steps` steps. Returns its losses (last stage),
    the gradients of its parameters at the last step and its parameters after
    training (both by the full model's parameter names), and the step times."""
    t = Trainer(chan, rank, n_stages, cfg, n_micro=n_micro, seed=seed, dtype=dtype, lr=lr, barrier=barrier)
    for step in range(steps):
        t.step(step)
    return t.result()


def train_reference(cfg: Config, *, steps: int, n_micro: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                    lr: float = 0.5) -> dict[str, Any]:
    """The same training in one process: the whole model as one stage."""
    model = build_model(cfg, seed, dtype)
    whole = Stage(model, 0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batches = make_batches(cfg, step, n_micro, seed)
        total = n_tokens(batches)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in batches:
            y = loss_of(whole(mb.tokens, mb.cu_seqlens), mb, total)
            y.backward()
            loss += float(y.detach())
        losses.append(loss)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


# ---------------------------------------------------------------------------
# set-up


BACKENDS = ("varcomm", "fallback", "megatron")


def setup(backends: tuple[str, ...] = ("varcomm",), timeout: float = 300.0) -> tuple[dict[str, Channel], int, int]:
    """torch.distributed (gloo: barriers, and the megatron channel) and a varcomm
    Communicator per varcomm backend (auto transport; transport="fallback"),
    all meeting through one TCPStore at MASTER_ADDR:MASTER_PORT. Returns a
    channel per backend, this rank and the number of ranks."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    chans: dict[str, Channel] = {}
    for b in backends:
        if b == "megatron":
            chans[b] = MegatronChannel()
        else:
            transport = "fallback" if b == "fallback" else None
            chans[b] = VarcommChannel(varcomm.init(rank=rank, world_size=world, transport=transport, timeout=timeout,
                                                   store=dist.PrefixStore(f"pipeline_varlen/{b}/", store)))
    return chans, rank, world


def teardown(chans: dict[str, Channel]) -> None:
    for c in chans.values():
        if isinstance(c, VarcommChannel):
            c.comm.close()
    dist.barrier()  # the store lives in rank 0: nobody leaves before everyone closed
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--backend", choices=BACKENDS, default="varcomm")
    p.add_argument("--compare", action="store_true",
                   help="train with every backend (taking turns), print their step times")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    a = p.parse_args()
    cfg = Config(hidden=a.hidden, heads=a.heads, layers=max(a.layers, 1), max_len=a.max_len)
    dtype = getattr(torch, a.dtype)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    backends = BACKENDS if a.compare else (a.backend,)
    chans, rank, world = setup(backends)
    if cfg.layers < world:
        raise SystemExit(f"{cfg.layers} layers cannot make {world} stages")
    trainers = {b: Trainer(chans[b], rank, world, cfg, n_micro=a.micro_batches, seed=a.seed, dtype=dtype, lr=a.lr,
                           barrier=dist.barrier) for b in backends}
    for step in range(a.steps):  # backends take turns, step by step: a fair comparison on a busy machine
        for t in trainers.values():
            t.step(step)
    results = {b: t.result() for b, t in trainers.items()}
    if rank == world - 1:
        print(f"pipeline_varlen: {world} stages, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
              f"{a.micro_batches} micro-batches per step of 1-{cfg.max_seqs} packed sequences of 2-{cfg.max_len} "
              f"tokens, 1F1B, {a.dtype}, no padding", flush=True)
        for b, r in results.items():
            for s, (loss, t) in enumerate(zip(r["losses"], r["times"])):
                print(f"  {b:<8} step {s}  loss {loss:.6f}  {t * 1e3:8.2f} ms", flush=True)
        means = {b: sum(r["times"][1:]) / max(len(r["times"]) - 1, 1) for b, r in results.items()}
        line = ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in means.items())
        print(f"step time (mean of steps 1..{a.steps - 1}): {line}", flush=True)
        if a.compare:
            same = all(r["losses"] == results["varcomm"]["losses"] for r in results.values())
            ratios = ", ".join(f"{b} / varcomm {means[b] / means['varcomm']:.2f}x" for b in backends if b != "varcomm")
            print(f"{ratios}; losses identical: {same}", flush=True)
    teardown(chans)


if __name__ == "__main__":
    main()
