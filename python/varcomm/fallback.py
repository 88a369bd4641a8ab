"""Point-to-point over torch.distributed (gloo): for peers no native transport
reaches, or everywhere with VARCOMM_TRANSPORT=fallback. Also the baseline the
benchmarks beat.

Wire format, as Megatron's ``variable_seq_lengths`` path does it: a fixed-size
int64 header (kind, nbytes, dtype word, ndim, shape[8], tag, flags), then the
payload as raw bytes (a uint8 view, so gloo never needs to know the dtype).

How it works, and why this shape:

* Our own ``ProcessGroupGloo`` over ``PrefixStore("fallback/", store)``: the
  user's default process group is never touched. Creating it is collective:
  every rank of the job must create its Fallback.
* gloo's send/recv works cannot be polled: ``is_completed()`` only turns true
  inside ``wait()``, and a ``wait(timeout)`` that expires poisons every pair
  of the group ("Application timeout caused pair closure"). So the group is
  made with an effectively infinite timeout, only blocking ``wait()`` (which
  releases the GIL) is ever called, on helper threads or once a message is
  known to be on its way, and callers wait on a ``threading.Event`` with
  varcomm's own timeout.
* Receiving is eager: one thread per peer always has a header recv posted
  (gloo tag 0). For each header it posts the payload recv (gloo tag 1; both
  sides post in the same order, so payloads pair with their headers) straight
  into the ``out`` of the first pending ``irecv`` for that (src, tag) when it
  fits, else into a fresh buffer, and hands the message over by (src, user
  tag); the receiver of the message waits for its bytes. User tags travel in
  the header, so any int64 tag works and different tags never block each
  other; no send waits for the receiver to call recv, so rings, all-pairs,
  and even "everyone sends first, then receives" cannot deadlock, whatever
  order works are waited in. (Unlike the native path there is no slot limit:
  unclaimed messages are buffered in memory on the receiver.)
* Sending posts header and payload under a per-peer lock (so they pair up on
  the wire) and hands the gloo works to a per-peer waiter thread. A send that
  times out cannot be withdrawn from gloo: it stays queued.
* A dead peer closes its TCP connections: the always-posted header recv fails
  at once, and every pending and later op with that rank raises PeerFailure.
  close() sends each peer a goodbye, which its receiver thread answers, so all
  helper threads end (needed before interpreter exit; see close()).
* Self-sends never touch gloo: the payload is copied into the local queue.
* CUDA tensors are STAGED THROUGH HOST MEMORY (device -> host copy on send,
  host -> device on receive; a message sent from CUDA is returned on the
  current CUDA device when no ``out`` is given). Correct but slow, and NOT
  TESTED ON A GPU. A ProcessGroupNCCL path is not implemented: NCCL p2p must be
  issued in matching order on both sides of a pair, which the eager receiver
  threads here do not guarantee. GPU baselines should use torch.distributed
  NCCL directly.
"""
from __future__ import annotations

import atexit
import collections
import threading
import time
from datetime import timedelta
from typing import Any
import weakref

import numpy as np

from . import arrays, dtypes
from .errors import (ClosedError, InvalidArgument, MessageMismatch, MessageTooLarge, PeerFailure, TimeoutError,
                     VarcommError)

# Header layout (int64 words).
_KIND, _NBYTES, _WORD, _NDIM, _SHAPE, _TAG, _FLAGS = 0, 1, 2, 3, 4, 12, 13
_HDR_LEN = 14
_MAX_DIMS = 8
_DATA, _CLOSE = 0x7663_0001, 0x7663_0002  # 'vc' + kind: a stray message cannot look like ours
_F_CUDA = 1  # the sender's tensor was on a CUDA device

# gloo tags of our private group.
_HDR_TAG, _DATA_TAG = 0, 1

#: close() waits at most this long for each live peer to answer its goodbye.
_CLOSE_WAIT_S = 10.0

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_FOREVER = timedelta(days=3650)  # gloo's own timeout must never fire (it poisons the whole group)


def _torch() -> Any:
    import torch

    return torch


def _peer_str(peer: int) -> str:
    return f"rank {peer}"


def _gloo_reason(e: BaseException) -> str:
    """gloo's message without its source-path prefix and first line only."""
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if s.startswith("[") and "] " in s:
        s = s.split("] ", 1)[1]
    return s.split(" This is typically", 1)[0]


def _err(cls: type, msg: str, peer: int | None) -> VarcommError:
    e = cls(msg)
    e.peer = peer
    return e


class _Msg:
    """A received (or self-sent) message: header fields and its bytes."""

    __slots__ = ("src", "tag", "nbytes", "word", "shape", "flags", "raw", "work")

    def __init__(self, src: int, tag: int, nbytes: int, word: int, shape: tuple[int, ...], flags: int):
        self.src, self.tag, self.nbytes, self.word, self.shape, self.flags = src, tag, nbytes, word, shape, flags
        self.raw: Any = None  # 1-d uint8 CPU tensor of nbytes (None: received straight into an out)
        self.work: Any = None  # the posted gloo payload recv, until someone waited on it

    def landed(self) -> None:
        """Wait for the payload bytes (the header is here, so they are on their
        way: the sender posts both at once). gloo's error if the peer is lost."""
        w, self.work = self.work, None
        if w is not None:
            w.wait()  # releases the GIL


class _SendWork:
    """A pending fallback isend. wait() returns None once the input may be reused."""

    def __init__(self, fb: "Fallback", dst: int, tag: int, keep: Any):
        self._fb = fb
        self._ev = threading.Event()
        self._error: BaseException | None = None
        self._keep = keep  # the input (and its byte view) outlive the transfer
        self.peer = dst
        self.tag = tag
        self.op = "send"

    def _done(self, error: BaseException | None = None) -> None:
        self._error = error
        self._keep = None
        self._ev.set()

    def wait(self, timeout: float | None = None) -> None:
        t = self._fb._timeout if timeout is None else timeout
        if not self._ev.wait(t):
            raise _err(TimeoutError,
                       f"send to {_peer_str(self.peer)} (tag {self.tag}) timed out after {t:.3g} s; the receiver "
                       "has not taken the message (is it alive and in varcomm.init?). [fallback] A gloo send "
                       "cannot be cancelled: it stays queued and may still be delivered", self.peer)
        if self._error is not None:
            raise self._error
        return None

    def is_completed(self) -> bool:
        return self._ev.is_set()

    def result(self) -> None:
        return self.wait()

    def __repr__(self) -> str:
        return f"<fallback send to rank {self.peer} tag {self.tag} {'done' if self._ev.is_set() else 'pending'}>"


class _RecvWork:
    """A pending fallback irecv. wait() returns the received array."""

    def __init__(self, fb: "Fallback", src: int, tag: int, out: Any):
        self._fb = fb
        self._ev = threading.Event()
        self._error: BaseException | None = None
        self._msg: _Msg | None = None
        self._direct = False  # the payload is received straight into out
        self._result: Any = None
        self._finished = False
        self._wait_lock = threading.Lock()  # two threads waiting: one waits on gloo, once
        self.peer = src
        self.tag = tag
        self.op = "recv"
        self._out = out
        self._out_word = 0
        self._out_cap = 0
        self._out_flat: Any = None  # uint8 CPU tensor over out's bytes (for direct receives)
        if out is not None:
            self._prepare_out(out)

    def _prepare_out(self, out: Any) -> None:
        torch = arrays.torch
        if arrays.is_torch(out) and out.device.type != "cpu":
            if out.device.type != "cuda":
                raise InvalidArgument(f"out on {out.device}: the fallback handles CPU and CUDA tensors only")
            if not out.is_contiguous():
                raise InvalidArgument("out must be contiguous: the message is written into its prefix")
            self._out_word, self._out_cap = dtypes.from_torch(out.dtype), out.nbytes
            return  # staged: copied host -> device in wait()
        _ptr, self._out_cap, self._out_word = arrays.describe_out(out)
        if arrays.is_torch(out):
            self._out_flat = out.detach().reshape(-1).view(torch.uint8)
        else:
            self._out_flat = _torch().from_numpy(out.reshape(-1).view(np.uint8))

    # ---- matching (called with fb._mu held) ----------------------------------

    def _check(self, m: _Msg) -> VarcommError | None:
        """Why this recv cannot take message m (the message is then kept), or None."""
        where = f"recv from {_peer_str(m.src)} tag {m.tag}"
        if self._out is not None:
            if self._out_word != m.word:
                return _err(MessageMismatch,
                            f"{where}: message dtype {dtypes.describe(m.word)} does not match out's dtype "
                            f"{dtypes.describe(self._out_word)}; the message was kept for the next recv", m.src)
            if m.nbytes > self._out_cap:
                return _err(MessageTooLarge,
                            f"{where}: message of {m.nbytes} bytes does not fit out ({self._out_cap} bytes); "
                            "the message was kept for the next recv", m.src)
            return None
        try:
            if self._fb._array == "numpy":
                dtypes.to_numpy(m.word)
            else:
                dtypes.to_torch(m.word)
        except InvalidArgument as e:
            e.peer = m.src
            return e
        return None

    def _complete(self, m: _Msg, direct: bool = False) -> None:
        self._msg = m
        self._direct = direct
        self._ev.set()

    def _fail(self, e: BaseException) -> None:
        if not self._ev.is_set():
            self._error = e
            self._ev.set()

    # ---- user side ------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> Any:
        if self._finished:
            return self._result
        t = self._fb._timeout if timeout is None else timeout
        if not self._ev.wait(t):
            with self._fb._mu:
                if not self._ev.is_set():
                    self._fb._cancel(self)
                    self._fail(_err(TimeoutError,
                                    f"recv from {_peer_str(self.peer)} (tag {self.tag}) timed out after {t:.3g} s; "
                                    "nothing arrived (is the peer sending with this tag?)", self.peer))
        if self._error is not None:
            raise self._error
        with self._wait_lock:
            if self._finished:
                return self._result
            if self._error is not None:
                raise self._error
            try:
                # Not bounded by the timeout: the header is here, the payload was
                # posted with it; a lost peer still fails it at once.
                self._msg.landed()
            except Exception as e:
                why = self._fb._peer_lost(self.peer, e)
                self._error = _err(PeerFailure, f"recv from {_peer_str(self.peer)} failed: {why}", self.peer)
                raise self._error from None
            self._result = self._finish()
            self._finished = True
            self._msg = None
            self._out_flat = None
            return self._result

    def _finish(self) -> Any:
        m = self._msg
        assert m is not None
        out = self._out
        if out is not None:
            if not self._direct and m.nbytes:
                if arrays.is_torch(out):
                    out.detach().reshape(-1).view(arrays.torch.uint8)[:m.nbytes].copy_(m.raw)
                else:
                    self._out_flat[:m.nbytes].copy_(m.raw)
            return arrays.prefix_view(out, m.nbytes, m.shape)
        if self._fb._array == "numpy":
            return m.raw.numpy().view(dtypes.to_numpy(m.word)).reshape(m.shape)
        t = m.raw.view(dtypes.to_torch(m.word)).reshape(m.shape)
        if m.flags & _F_CUDA and arrays.torch.cuda.is_available():
            t = t.to(arrays.torch.cuda.current_device())
        return t

    def is_completed(self) -> bool:
        return self._ev.is_set()

    def result(self) -> Any:
        return self.wait()

    def __repr__(self) -> str:
        return f"<fallback recv from rank {self.peer} tag {self.tag} {'done' if self._ev.is_set() else 'pending'}>"


class Fallback:
    """Variable-size send/recv over a private gloo process group (see module doc)."""

    def __init__(self, store: Any, rank: int, world_size: int, bound: int, timeout: float | None,
                 array: str = "torch"):
        torch = _torch()
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.bound = bound
        self._timeout = timeout
        self._array = array
        self._store = store
        self._mu = threading.Lock()
        self._closed = False
        self._gone: dict[int, str] = {}  # peer -> why it can no longer be reached
        self._lost: set[int] = set()  # peers whose connection failed (no goodbye possible)
        self._said_bye = [False] * world_size  # we sent the peer our one goodbye (close or reply)
        self._waiting: dict[tuple[int, int], collections.deque[_RecvWork]] = {}
        self._stash: dict[tuple[int, int], collections.deque[_Msg]] = {}
        self._send_locks = [threading.Lock() for _ in range(world_size)]
        self._send_q: dict[int, collections.deque[Any]] = {}
        self._send_cv: dict[int, threading.Condition] = {}
        self._senders: dict[int, threading.Thread] = {}
        self._bounds: dict[int, int] = {rank: bound}
        self._pg: Any = None
        self._receivers: list[threading.Thread] = []
        if world_size == 1:
            return
        # Rendezvous through the store under our own timeout first: the group
        # itself is made with a practically infinite one (see the module doc).
        store.set(f"fallback_meta/bound/{rank}", str(bound))
        keys = [f"fallback_meta/bound/{r}" for r in range(world_size)]
        wait_s = timeout if timeout is not None else 300.0
        try:
            store.wait(keys, timedelta(seconds=wait_s))
        except Exception as e:  # DistStoreError / RuntimeError, depending on the store
            raise VarcommError(
                f"fallback: timed out after {wait_s:.3g} s waiting for all {world_size} ranks to create the "
                "torch.distributed fallback (every rank must create it, even one that uses no fallback route) "
                f"({_gloo_reason(e)})") from None
        try:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("fallback/", store), rank, world_size, _FOREVER)
        except Exception as e:
            raise VarcommError(f"fallback: could not create the gloo process group: {_gloo_reason(e)} "
                               "(GLOO_SOCKET_IFNAME selects the interface)") from None
        _live.add(self)
        for src in range(world_size):
            if src != rank:
                th = threading.Thread(target=self._receive_loop, args=(self._pg, src, torch),
                                      name=f"varcomm-fallback-recv-{src}", daemon=True)
                th.start()
                self._receivers.append(th)

    # ---- sending --------------------------------------------------------------

    def _bound_of(self, dst: int) -> int:
        b = self._bounds.get(dst)
        if b is None:
            b = self._bounds[dst] = int(self._store.get(f"fallback_meta/bound/{dst}"))
        return b

    def _prepare(self, tensor: Any) -> tuple[Any, int, tuple[int, ...], int, bool]:
        """(payload: 1-d uint8 CPU tensor, dtype word, shape, flags, payload is a private copy)."""
        torch = _torch()
        if arrays.is_torch(tensor):
            t = tensor
            if t.layout != torch.strided:
                raise InvalidArgument(f"cannot send a {t.layout} tensor: only dense (strided) tensors")
            word = dtypes.from_torch(t.dtype)
            shape = tuple(t.shape)
            if t.requires_grad:
                t = t.detach()
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
            flat = t.reshape(-1).view(torch.uint8)
            if t.device.type == "cpu":
                return flat, word, shape, 0, False
            if t.device.type == "cuda":  # staged through host memory (see the module doc)
                return flat.cpu(), word, shape, _F_CUDA, True
            raise InvalidArgument(f"tensor on {t.device}: the fallback handles CPU and CUDA tensors only")
        if isinstance(tensor, np.ndarray):
            word = dtypes.from_numpy(tensor.dtype)
            shape = tuple(tensor.shape)
            a = tensor if tensor.flags.c_contiguous else np.ascontiguousarray(tensor)
            flat = a.reshape(-1).view(np.uint8)
            fresh = a is not tensor
            if not flat.flags.writeable:  # torch.from_numpy warns on read-only arrays
                flat, fresh = flat.copy(), True
            return torch.from_numpy(flat), word, shape, 0, fresh
        raise InvalidArgument(f"cannot send {type(tensor).__name__}: pass a torch.Tensor or numpy.ndarray")

    def isend(self, tensor: Any, dst: int, tag: int) -> _SendWork:
        """Start a send; returns a work whose wait() returns when `tensor` may be reused."""
        tag = _check_tag(tag)
        if self._closed:
            raise ClosedError("communicator is closed")
        if arrays.is_torch(tensor) or isinstance(tensor, np.ndarray):  # checks before any copy
            if tensor.ndim > _MAX_DIMS:
                raise InvalidArgument(f"tensors of more than {_MAX_DIMS} dimensions are not supported")
            bound = self._bound_of(dst)
            if tensor.nbytes > bound:
                raise _err(MessageTooLarge,
                           f"message of {tensor.nbytes} bytes exceeds the receive bound of {bound} bytes on "
                           f"{_peer_str(dst)}; raise it with varcomm.init(bound=...) or VARCOMM_BOUND on the "
                           "receiver", dst)
        payload, word, shape, flags, fresh = self._prepare(tensor)
        nbytes = int(payload.numel())
        work = _SendWork(self, dst, tag, (tensor, payload))
        if dst == self.rank:
            m = _Msg(dst, tag, nbytes, word, shape, flags)
            m.raw = payload if fresh else payload.clone()
            with self._mu:
                self._deliver((dst, tag), m)
            work._done()
            return work
        hdr = _header(_DATA, nbytes, word, shape, tag, flags)
        self._post(dst, hdr, payload if nbytes else None, work)
        return work

    def send(self, tensor: Any, dst: int, tag: int, timeout: float | None) -> None:
        """Returns when `tensor` may be reused."""
        self.isend(tensor, dst, tag).wait(timeout)

    def _post(self, dst: int, hdr: Any, payload: Any, work: _SendWork | None, bye: bool = False) -> None:
        torch_dist_works = []
        with self._send_locks[dst]:
            if bye:
                if self._said_bye[dst] or dst in self._lost:
                    return
                self._said_bye[dst] = True
            else:
                why = self._gone.get(dst)
                if why is None and self._said_bye[dst]:
                    why = "this communicator is closing"
                if why is not None:
                    raise _err(PeerFailure, f"send to {_peer_str(dst)} failed: {why}", dst)
            pg = self._pg
            if pg is None:
                raise ClosedError("communicator is closed")
            try:
                torch_dist_works.append(pg.send([hdr], dst, _HDR_TAG))
                if payload is not None:
                    torch_dist_works.append(pg.send([payload], dst, _DATA_TAG))
            except RuntimeError as e:
                why = self._peer_lost(dst, e)
                raise _err(PeerFailure, f"send to {_peer_str(dst)} failed: {why}", dst) from None
            cv = self._send_cv.get(dst)
            if cv is None:
                cv = self._send_cv[dst] = threading.Condition(threading.Lock())
                self._send_q[dst] = collections.deque()
                th = threading.Thread(target=self._send_loop, args=(dst, cv, self._send_q[dst]),
                                      name=f"varcomm-fallback-send-{dst}", daemon=True)
                self._senders[dst] = th
                th.start()
            with cv:
                self._send_q[dst].append((torch_dist_works, work, hdr, payload))
                cv.notify()

    def _send_loop(self, dst: int, cv: threading.Condition, q: collections.deque) -> None:
        """Waits on the gloo works of the sends to dst, in posting order."""
        while True:
            with cv:
                while not q:
                    cv.wait()
                item = q.popleft()
            if item is None:
                return
            gworks, work, _hdr, _payload = item
            why = None
            try:
                # Releases the GIL; never times out (see the module doc). A peer
                # that closed keeps draining what we send until we close too.
                for w in gworks:
                    w.wait()
            except Exception as e:
                why = self._peer_lost(dst, e)
            if work is not None:
                work._done(None if why is None else
                           _err(PeerFailure, f"send to {_peer_str(dst)} failed: {why}", dst))
            del item, gworks, work, _hdr, _payload

    # ---- receiving ------------------------------------------------------------

    def irecv(self, src: int, tag: int, out: Any) -> _RecvWork:
        tag = _check_tag(tag)
        work = _RecvWork(self, src, tag, out)
        key = (src, tag)
        with self._mu:
            if self._closed:
                raise ClosedError("communicator is closed")
            stash = self._stash.get(key)
            if stash:
                m = stash[0]
                e = work._check(m)
                if e is not None:
                    work._fail(e)  # the message stays first in line
                else:
                    stash.popleft()
                    if not stash:
                        del self._stash[key]
                    work._complete(m)
                return work
            why = self._gone.get(src)
            if why is not None:
                work._fail(_err(PeerFailure, f"recv from {_peer_str(src)} failed: {why}", src))
                return work
            self._waiting.setdefault(key, collections.deque()).append(work)
        return work

    def _deliver(self, key: tuple[int, int], m: _Msg) -> None:
        """Hand m to the first pending irecv that can take it, else keep it (mu held)."""
        q = self._waiting.get(key)
        while q:
            w = q.popleft()
            e = w._check(m)
            if e is None:
                w._complete(m)
                if not q:
                    del self._waiting[key]
                return
            w._fail(e)  # that recv fails; the message goes to the next one
        self._waiting.pop(key, None)
        if self._closed:
            return
        self._stash.setdefault(key, collections.deque()).append(m)

    def _cancel(self, work: _RecvWork) -> None:
        """A recv timed out before its message's header arrived (mu held): withdraw it."""
        q = self._waiting.get((work.peer, work.tag))
        if q is not None:
            try:
                q.remove(work)
            except ValueError:
                pass
            if not q:
                del self._waiting[(work.peer, work.tag)]

    def _receive_loop(self, pg: Any, src: int, torch: Any) -> None:
        """Always one header recv posted from src. For each header, the payload
        recv is posted (gloo tag 1; FIFO, like the sender's posts) and the
        message handed over at once: whoever receives it waits for its bytes,
        while this thread already waits for the next header."""
        hdr = torch.empty(_HDR_LEN, dtype=torch.int64)
        while True:
            try:
                pg.recv([hdr], src, _HDR_TAG).wait()
            except Exception as e:
                self._peer_lost(src, e)
                return
            h = hdr.tolist()
            if h[_KIND] == _CLOSE:
                # src closed (or answers our goodbye): nothing more comes from
                # it. Answer with our own goodbye, once, so that src's receiver
                # thread for us ends too, whether or not we close.
                self._peer_lost(src, None)
                try:
                    self._post(src, _header(_CLOSE, 0, 0, (), 0, 0), None, None, bye=True)
                except VarcommError:
                    pass
                return
            if h[_KIND] != _DATA:
                self._peer_lost(src, RuntimeError(f"garbled fallback header from rank {src}: {h}"))
                return
            ndim = h[_NDIM]
            m = _Msg(src, h[_TAG], h[_NBYTES], h[_WORD], tuple(h[_SHAPE:_SHAPE + ndim]), h[_FLAGS])
            key = (src, m.tag)
            broken: BaseException | None = None
            with self._mu:
                direct: _RecvWork | None = None
                q = self._waiting.get(key)
                if m.nbytes and q and q[0]._out_flat is not None and q[0]._check(m) is None:
                    direct = q.popleft()  # lands straight in its out
                    if not q:
                        del self._waiting[key]
                    target = direct._out_flat[:m.nbytes]
                else:
                    m.raw = target = torch.empty(m.nbytes, dtype=torch.uint8)
                if m.nbytes:
                    try:
                        m.work = pg.recv([target], src, _DATA_TAG)
                    except Exception as e:  # the pair is already broken
                        broken = e
                if broken is None:
                    if direct is not None:
                        direct._complete(m, direct=True)
                    else:
                        self._deliver(key, m)
            if broken is not None:
                why = self._peer_lost(src, broken)
                if direct is not None:
                    with self._mu:
                        direct._fail(_err(PeerFailure, f"recv from {_peer_str(src)} failed: {why}", src))
                return
            del m, direct, target, q

    def _peer_lost(self, peer: int, e: BaseException | None) -> str:
        """Mark peer unreachable (e None: it closed its communicator); fail what waits on it."""
        with self._mu:
            why = self._gone.get(peer)
            if why is None:
                if e is None:
                    why = f"{_peer_str(peer)} closed its communicator"
                else:
                    why = f"peer failure: lost the connection to {_peer_str(peer)} ({_gloo_reason(e)})"
                self._gone[peer] = why
                if e is not None:
                    self._lost.add(peer)
            failed = []
            for key in [k for k in self._waiting if k[0] == peer]:
                failed.extend(self._waiting.pop(key))
            for w in failed:
                w._fail(_err(PeerFailure, f"recv from {_peer_str(peer)} failed: {why}", peer))
        return why

    # ---- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Fails pending receives with ClosedError and tells every peer we are gone
        (their operations with us then raise PeerFailure). Waits only for each
        live peer's receiver thread to answer (milliseconds), not for peers to close."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            pending = [w for q in self._waiting.values() for w in q]
            self._waiting.clear()
            self._stash.clear()
            for w in pending:
                w._fail(ClosedError("communicator is closed"))
        if self._pg is None:
            return
        bye = _header(_CLOSE, 0, 0, (), 0, 0)
        for dst in range(self.world_size):
            if dst == self.rank:
                continue
            try:
                self._post(dst, bye, None, None, bye=True)
            except VarcommError:
                pass
            cv = self._send_cv.get(dst)
            if cv is not None:
                with cv:
                    self._send_q[dst].append(None)
                    cv.notify()
        # Let the goodbyes (and sends still queued) reach live peers, and wait
        # for every peer's goodbye (its own close, or its receiver thread's
        # answer to ours), which ends our receiver threads. This matters at
        # exit: a thread woken inside gloo while the interpreter finalizes is
        # killed with pthread_exit, which aborts the process ("terminate called
        # without an active exception"). Bounded, so a hung peer cannot hang close().
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for th in list(self._senders.values()) + self._receivers:
            th.join(max(0.0, deadline - time.monotonic()))
        # Threads still running hold their own reference to the group.
        self._pg = None
        _live.discard(self)


def _header(kind: int, nbytes: int, word: int, shape: tuple[int, ...], tag: int, flags: int) -> Any:
    torch = _torch()
    h = [0] * _HDR_LEN
    h[_KIND], h[_NBYTES], h[_WORD], h[_NDIM], h[_TAG], h[_FLAGS] = kind, nbytes, word, len(shape), tag, flags
    h[_SHAPE:_SHAPE + len(shape)] = shape
    return torch.tensor(h, dtype=torch.int64)


def _check_tag(tag: Any) -> int:
    if not isinstance(tag, (int, np.integer)) or not _INT64_MIN <= int(tag) <= _INT64_MAX:
        raise InvalidArgument(f"tag {tag!r} must be an int in the int64 range")
    return int(tag)


_live: "weakref.WeakSet[Fallback]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Communicators left open at exit: say goodbye to peers and let the receiver
    threads end before the interpreter finalizes (see Fallback.close)."""
    for fb in list(_live):
        try:
            fb.close()
        except Exception:
            pass


__all__ = ["Fallback"]
