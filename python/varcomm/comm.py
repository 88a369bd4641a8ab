"""The Communicator: variable-size point-to-point over whichever transport
reaches each peer. The core chooses and connects the routes (csrc/routes.cpp);
nothing here knows how a transport moves bytes or which one a pair uses."""
from __future__ import annotations

import atexit
import contextlib
import hmac
import itertools
import math
import operator
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, cast, overload

import numpy as np

from . import arrays, bootstrap, dtypes
from .arrays import NO_MEMORY_BELOW as _NO_MEMORY_BELOW
from .errors import InvalidArgument, MessageTooLarge, PeerFailure, VarcommError
from .errors import TimeoutError as _Timeout
from .options import Options
from .tools import run
from .work import Work

if TYPE_CHECKING:
    import torch
    from torch.distributed import Store

    from ._C import Status
    from .arrays import Array, Splits

_Tensor: Any = arrays.torch.Tensor if arrays.torch is not None else None
_STRIDED: Any = arrays.torch.strided if arrays.torch is not None else None  # sparse tensors take the general path
_Status: Any = None  # varcomm._C.Status, set at the first init (importing _C here would load the core on import)
_check_timeout: Any = None  # varcomm._C.check_timeout, set with _Status
_OUT_EXACT = 0  # varcomm._C.OUT_EXACT, set with _Status
_TORCH_WORDS: dict[torch.dtype, int] = {}  # filled at init: torch dtype -> dtype word, for the hot path
_CLOSE_FLUSH_S = 10.0  # close() writes queued sends for at most this long


def _order_after(s: Any) -> None:
    """Make the current CUDA stream wait for `s` (a device transfer's stream; None: nothing)."""
    if s is not None:
        cur = arrays.torch.cuda.current_stream(s.device)
        if cur != s:
            cur.wait_stream(s)


class P2PWork:
    """A pending isend or irecv (a varcomm.Work). `wait()` returns the received array (None for a send).

    For CUDA tensors the transfer is ordered on the CUDA stream that was current
    when the op was posted: `wait()` makes the current stream wait for it (no
    host block on GPU work), `synchronize()` also blocks the host until it ran."""

    __slots__ = ("_comm", "_id", "_done", "_result", "_error", "_finish", "_keep", "_stream", "_settle", "peer", "op")

    def __init__(self, comm: Communicator, rid: int, finish: Callable[[], Any] | None, peer: int, op: str,
                 keep: Any = None, stream: Any = None, settle: bool = False):
        self._comm = comm
        # finish copies the message on into its destination (from a host bounce
        # buffer, a contiguous stand-in): a dropped Work must still run it.
        self._settle = settle
        # The memory the core reads or writes (a send's source or its staged
        # copy, a recv's out or bounce buffer): it must outlive the transfer,
        # so a dropped Work hands it to the core (detach) until the core is done.
        self._keep = keep
        self._id = rid
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._finish = finish
        self._stream = stream  # torch.cuda.Stream ordering a device transfer, else None
        self.peer = peer
        self.op = op

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            t = self._comm._timeout if timeout is None else timeout
            if t is not None and not (type(t) is float and t >= 0):
                _check_timeout(t)  # a bad one is refused here, the Work still pending
            try:
                self._comm._c.wait(self._id, t)
            except InvalidArgument:
                raise  # refused before anything was done: still pending
            except BaseException as e:
                # The core cancelled or failed the request (and forgot it): this
                # Work is over, and every later wait says why.
                self._done, self._error, self._keep, self._finish = True, e, None, None
                raise
            self._done = True
            self._keep = None
            if self._comm._orphans:
                self._comm._settle_orphans()
            # Before finish: what finish does on the current stream (a strided
            # copy in, see _then) reads what the posting stream writes.
            if self._stream is not None:
                _order_after(self._stream)
            finish = self._finish
            if finish is not None:
                self._finish = None
                try:
                    self._result = finish()
                except BaseException as e:
                    self._error = e  # finish gave the message back first (or consumed it): nothing is held
                    raise
        elif self._error is not None:
            raise self._error
        return self._result

    def _then(self, after: Callable[[Any], Any]) -> P2PWork:
        """A receive whose result `after` copies on (into a strided tensor):
        wait() returns after(result), and a dropped Work still runs it."""
        inner = self._finish
        assert inner is not None and not self._done, "_then: a pending receive's Work"
        s = self._stream

        def finish() -> Any:
            got = inner()
            # The message lands on the stream the receive was posted on; a
            # dropped Work is settled from whatever stream is current then.
            _order_after(s)
            return after(got)

        self._finish = finish
        self._settle = True
        return self

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(), then block the host until the transfer's GPU work has run."""
        r = self.wait(timeout)
        if self._stream is not None:
            self._stream.synchronize()
        return r

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._comm._c.test(self._id):
            return False
        if self._settle:  # the copy on is part of it: a poller reads the destination next
            try:
                self.wait(0.0)
            except Exception:  # wait() raises it again
                pass
        return True

    def result(self) -> Any:
        return self.wait()

    def _cancel(self, why: BaseException) -> None:
        """Give up on it (batch_isend_irecv rolling back): a receive not matched
        leaves its message for the next one, a queued send is never written;
        one in flight finishes, its buffer kept. Later waits raise `why`."""
        if self._done:
            return
        try:
            self._comm._c.cancel(self._id, self._keep)
        except VarcommError:
            pass  # failed or closed already: nothing is left to give up
        self._done, self._error, self._keep, self._finish = True, why, None, None

    def __del__(self) -> None:
        # Dropped without wait(): the transfer still finishes (into or out of
        # the kept buffer), the slot is returned.
        if not getattr(self, "_done", True):  # (unset: a ^C inside __init__, which printed an AttributeError)
            if self._settle and self._finish is not None and not self._comm._closed:
                self._comm._orphans.append((self._id, self._finish))  # run once the message is in
                return
            try:
                self._comm._c.detach(self._id, self._keep)
            except Exception:
                pass


class P2POp(NamedTuple):
    """torch.distributed.P2POp's shape: op is comm.isend or comm.irecv; for irecv,
    tensor is None or a bound-sized output buffer. exact: an irecv's message
    must fill tensor exactly, as irecv(exact=True) asks."""

    op: Callable[..., Work]
    tensor: Array | None
    peer: int
    tag: int = 0
    exact: bool = False


# Open communicators in creation order (weak: a dropped one is not kept alive).
_open: dict[int, weakref.ref[Communicator]] = {}
_made = itertools.count()
# At exit after an uncaught exception (or ^C): how long close() waits for the
# peers to close too. A failing rank exits promptly, so that its launcher
# stops the job, rather than after up to 30 s.
_FAILING_EXIT_WAIT_S = 1.0
# Each store call of a close: a store host that stopped answering (frozen,
# behind a partition: a rank whose link was pulled) held it for the store's
# own timeout, or for good (torch's client does not shorten a call already
# made, nor one made after set_timeout, to a host that does not answer).
_CLOSE_STORE_S = 5.0


class _StoreSilent(RuntimeError):
    """A store call did not return in time (Communicator._bounded)."""


def _close_at_exit() -> None:
    """Communicators still open when the interpreter exits are closed as
    close() closes them: their queued sends are flushed first (an un-waited
    isend past a full ring was lost with the process), and the peers learn
    that this rank left rather than that it died. Latest first, as every rank
    made them in the same order: in different orders, rdma ranks each waited
    for the other to close another communicator (10 s a pair)."""
    # (last_value: set by an uncaught exception, not by sys.exit; at an interactive prompt it stays set after
    # any error shown there, so it says nothing about how the session ends)
    failing = getattr(sys, "last_value", None) is not None and not hasattr(sys, "ps1")
    for key in sorted(_open, reverse=True):
        c = _open.pop(key)()
        if c is None:
            continue
        try:
            c._end.at_exit = True
            if failing:
                c._end.peer_wait_cap = _FAILING_EXIT_WAIT_S
                c._end.failing = True
            c.close()
        except BaseException:  # (exiting anyway: one communicator's error must not keep the others open)
            pass


#: The note a rank whose set-up failed leaves in its communicator's store (Communicator._setup_failed).
_SETUP_FAILED = "setup/failed"


class _Ending:
    """How close() ends a communicator (kept apart: see Communicator's note on its attributes)."""

    __slots__ = ("at_exit", "failing", "peer_wait_cap", "store_down")

    def __init__(self) -> None:
        self.at_exit = False
        self.failing = False  # (closed at an exit after an uncaught exception: the peers' goodbyes say so)
        self.peer_wait_cap: float | None = None  # (close at a failing exit: _close_at_exit)
        self.store_down = False  # a call found the store's host gone: close() leaves the store alone


class Communicator:
    """Variable-size send/recv between ranks; see varcomm.init()."""

    # Fewer than 30 instance attributes (tests/test_fastpath.py checks): CPython 3.11 keeps an instance's
    # attributes inline only up to 29, and beyond that every self.x and comm.method on the hot path takes
    # a dict lookup (the small-message send+recv pair lost 0.08 us, about 9% of its instructions, when a
    # 30th was added). Group rarely used state in an object of its own (_Ending).

    def __init__(self, placement: bootstrap.Placement, store: Store, owner: Store | None, options: Options):
        global _Status, _check_timeout, _OUT_EXACT
        from . import _C

        _Status = _C.Status
        _check_timeout = _C.check_timeout
        _OUT_EXACT = _C.OUT_EXACT
        self.options = options  # resolved: every field set (see varcomm.options)
        self.rank = placement.rank
        self.world_size = placement.world_size
        self.local_rank = placement.local_rank
        self.local_world_size = placement.local_world_size
        self.bound: int = options.bound
        self.slots: int = options.slots
        self._timeout: float | None = options.timeout
        self._array = options.array
        self._alloc = arrays.allocators(options.array)  # recv's new arrays, by the sender's array kind
        self._store = store
        self._owner = owner
        self._pid = os.getpid()
        self._closed = False
        self._end = _Ending()
        self._barriers = 0
        # Dropped receives whose message still has to be copied on (P2PWork settle):
        # run by the calls that follow (recv, irecv, isend, any wait, barrier, close).
        self._orphans: list[tuple[int, Callable[[], Any]]] = []
        self._a2a: Any = None  # pending all-to-alls, in order (collectives/alltoall.py _Pendings), made on first use
        self._routes_ready = False
        self._fallback: Any = None
        try:
            self._c = _C.Comm(self.rank, self.world_size, options.core(_cuda_device(options)))
            self._f = self._c.fast()  # blocking send/recv, one core call each
            self._lend = arrays.lenders(options.array)  # copy=False: a slot's Loan as the array kind asked for
            self._setup()
        except BaseException as e:
            self._setup_failed(e)
            raise
        # Per peer, from the core: its route, and its device-memory route
        # (None: CUDA tensors are staged through host memory).
        self._routes: list[str] = self._c.routes
        self._device_routes: list[str | None] = self._c.device_routes
        # Bytes from which a collective's host output goes in the landing area, [other kinds, torch],
        # once the transports are connected
        self._landed_min = (self._c.landed_output_min(False), self._c.landed_output_min(True))
        # The GPU of our GPU transports (device receive slots, local device copies), else None.
        self._cuda_device: int | None = self._c.device_ordinal if self._c.device_ordinal >= 0 else None
        # The device-split all-to-all (collectives/alltoall_device.py), set up on first use.
        self._device_a2a: Any = None
        self._device_p2p: Any = None  # its point-to-point twin (alltoall_device.setup_p2p)
        self._routes_ready = True
        # The core says whether some pair in the job needs the mover; building
        # its gloo group is collective, so then every rank starts one.
        if self._c.needs_fallback_group:
            from .fallback import Fallback

            self._fallback = Fallback(self._store, self.rank, self.world_size, self._timeout,
                                      _C.fallback_mover(self._c))
        _open[next(_made)] = weakref.ref(self)
        # (Registered again, so that it runs before the fallback's own exit hook, registered at its import above:
        # atexit runs the latest first, and a flush through the fallback needs its mover.)
        atexit.unregister(_close_at_exit)
        atexit.register(_close_at_exit)

    # ---- set-up ---------------------------------------------------------------

    def _setup(self) -> None:
        """The core chooses and connects every route; this only carries its
        opaque per-round records between ranks through the store. A rank that
        fails its set-up says so in the store (_setup_failed): the others fail
        at once, naming it, rather than wait for its record. One that dies
        silently is named after the larger of init_timeout and timeout: a
        step waits for the slowest rank's part (CUDA and a provider's set-up
        take long on real clusters)."""
        out: bytes | None = self._c.setup_begin()
        rnd = 0
        limit = max(self.options.init_timeout or math.inf, self._timeout or math.inf)
        while out is not None:
            self._store_call(self._store.set, f"setup/{rnd}/{self.rank}", out)
            out = self._c.setup_step(self._gather(f"setup/{rnd}", rnd, limit))
            rnd += 1

    def _gather(self, name: str, rnd: int, limit: float) -> list[bytes]:
        """Every rank's record `name`/<rank>, once all are in the store."""
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        store, call = self._store, self._store_call
        deadline = time.monotonic() + limit
        pause, note_at, i = 0.001, 0.0, 0
        while i < len(keys):
            # The first missing rank's key only: one small request however many ranks there are.
            try:
                present = call(store.check, [keys[i]])
            except NotImplementedError:  # a store of the caller's without check(): wait in get, as torch does
                return [call(store.get, k) for k in keys]
            if present:
                i += 1
                continue
            now = time.monotonic()
            if now >= note_at:
                note_at = now + 0.1
                if call(store.check, [_SETUP_FAILED]):
                    why = bootstrap.open_note(self.options.job_key, call(store.get, _SETUP_FAILED))
                    if why is not None:
                        raise PeerFailure(f"rank {self.rank}: set-up failed on {why}")
            if now > deadline:
                missing = [r for r in range(i, len(keys)) if not call(store.check, [keys[r]])]
                raise _Timeout(f"rank {self.rank}: set-up: rank{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(map(str, missing))} did not finish set-up step {rnd} within {limit:.3g} s "
                               "(the larger of VARCOMM_INIT_TIMEOUT and VARCOMM_TIMEOUT): it died or hangs there; its "
                               "output says why")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        if hasattr(store, "multi_get"):
            return list(call(store.multi_get, keys))
        return [call(store.get, k) for k in keys]

    def _store_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A store call of set-up: torch's errors (DistNetworkError,
        DistStoreError) mean its host is gone; a store without the method
        raises NotImplementedError."""
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:
            if isinstance(e, VarcommError):
                raise
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "pure virtual" in text:
                raise NotImplementedError(text) from None
            raise PeerFailure(f"rank {self.rank}: the rendezvous store stopped answering during set-up ({text}): "
                              "the process that hosts it (rank 0, or torchrun's agent) failed or exited; its output "
                              "says why") from None

    def _setup_failed(self, e: BaseException) -> None:
        """Tell the other ranks, waiting in _setup, that this one's set-up failed (best effort)."""
        if self.world_size < 2 or isinstance(e, PeerFailure):  # (theirs, or the store is gone)
            return
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        note = f"rank {self.rank}: {type(e).__name__}: {text}"
        try:
            self._store.set(_SETUP_FAILED, bootstrap.seal_note(self.options.job_key, note))
            if self._owner is not None and self.rank == 0:
                time.sleep(bootstrap._LINGER_S)  # we host the store: a moment for the others to read it
        except Exception:
            pass

    def _publish(self, name: str) -> None:
        """Store record `name`/<our rank>, with its MAC (Setup::store_mac): the
        store answers anyone who reaches its port, so with a job key the
        others believe only a record that this rank wrote."""
        self._store.set(f"{name}/{self.rank}", self._c.store_mac(self.rank, name))

    def _published(self, ranks: list[int], name: str) -> list[int]:
        """Those of `ranks` whose record `name` (_publish) is in the store and
        verifies; a forged one counts as absent (the real one overwrites it)."""
        return [r for r in ranks if self._store.check([f"{name}/{r}"]) and self._genuine(r, name)]

    def _genuine(self, r: int, name: str) -> bool:
        """Whether rank r's record `name`, which is in the store, carries its MAC."""
        want = self._c.store_mac(r, name)
        return want == "none" or hmac.compare_digest(self._store.get(f"{name}/{r}"), want.encode())

    def _wait_all(self, name: str, timeout: float | None = None, given_up: threading.Event | None = None) -> None:
        """Until every rank published `name` (barrier arrivals). Rank 0 reads
        the records, one rank at a time, and then publishes `name`/done; the
        others wait for that one record: O(world) requests to the store per
        barrier, not O(world^2). A rank 0 that gives up (its timeout, a dead
        peer) publishes `name`/gaveup, and the others then read the records
        themselves. given_up: the caller stopped waiting (the loop ends)."""
        try:
            self._wait_all_records(name, timeout, given_up)
        except BaseException:
            if self.rank == 0:
                with contextlib.suppress(Exception):
                    self._publish(f"{name}/gaveup")
            raise

    def _wait_all_records(self, name: str, timeout: float | None, given_up: threading.Event | None) -> None:
        limit = timeout if timeout is not None else self._timeout or 300
        now = time.monotonic()
        deadline, check = now + limit, now + 0.2
        others = [r for r in range(self.world_size) if r != self.rank]
        scan = self.rank == 0  # (reading every rank's record: rank 0, or anyone once it gave up)
        missing = list(others) if scan else []
        done = f"{name}/done"
        while True:
            if scan:
                # The first missing rank's record only: one small request however many ranks there are.
                if missing and self._store.check([f"{name}/{missing[0]}"]) and self._genuine(missing[0], name):
                    missing.pop(0)
                    continue
                if not missing:
                    if self.rank == 0:
                        self._publish(done)
                    return
            elif self._store.check([f"{done}/0"]) and self._genuine(0, done):
                return
            if time.monotonic() > check:
                check = time.monotonic() + 0.2
                if not scan and self._published([0], f"{name}/gaveup"):
                    scan, missing = True, list(others)
                    continue
                if self._routes_ready:  # a rank that died never arrives: say so within seconds
                    for r in others:
                        if not (why := self._c.peer_error(r)):
                            continue
                        if r == 0 and self.rank != 0 and self._barrier_missing(name, others) is None:
                            return  # rank 0 died after every rank arrived, before it said so: complete
                        if not self._published([r], name):
                            # (one that arrived, then died, is not blamed: the others may still come)
                            raise PeerFailure(f"{self._barrier_text(name, others)}, and rank {r} failed: {why}")
            if self._routes_ready:
                self._c.progress()  # a rank in a barrier still serves incoming rdma writes
            if given_up is not None and given_up.is_set():
                raise _Timeout(f"{name}: given up")  # (nobody hears it: the caller raised already)
            if time.monotonic() > deadline:
                if scan and missing and not [q for q in missing if q not in self._published(missing, name)]:
                    continue  # (all in since the last look)
                raise _Timeout(f"{self._barrier_text(name, others)} within {limit:.3g} s (does every rank call it?); "
                               f"missing: {self._barrier_missing(name, others) or 'none, but rank 0 has not said so'}")
            time.sleep(0.002)

    def _barrier_text(self, name: str, others: list[int]) -> str:
        got = len(self._published(others, name))
        return f"{name.split('/')[0]}: {got + 1} of {self.world_size} ranks arrived"

    def _barrier_missing(self, name: str, others: list[int]) -> str | None:
        """The ranks whose arrival is not in the store, as text; None: none."""
        missing = [r for r in others if r not in self._published(others, name)]
        return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else None

    # ---- introspection --------------------------------------------------------

    def peer_bound(self, peer: int) -> int:
        """The bound of `peer`'s receive slots: the largest message it takes from us
        (ranks may choose different bounds)."""
        self._check_peer(peer, "peer")
        return self._c.peer_bound(int(peer))

    def transport_for(self, peer: int) -> str:
        """"shm", "rdma" or "fallback": what carries messages to and from `peer`."""
        self._check_peer(peer, "peer")
        return self._c.transport_for(peer)

    def describe_transport(self, peer: int) -> str:
        self._check_peer(peer, "peer")
        return self._c.describe_transport(peer)

    def route_info(self, peer: int) -> dict[str, str]:
        """describe_transport() as data for programs: "route", "device_route"
        ("" when CUDA tensors are staged through host memory) and the route's own
        facts (rdma: "provider", "fabric", "domain")."""
        self._check_peer(peer, "peer")
        return self._c.route_info(peer)

    @property
    def forged_headers(self) -> int:
        """Messages discarded since init because their header's pair tag was
        wrong: one-sided writes into this rank's slots that no rank of this job
        made (README, "Semantics and errors"). Each is reported on stderr too."""
        return self._c.forged_headers

    def device_transport_for(self, peer: int) -> str | None:
        """"nvlink" when CUDA tensors to and from `peer` travel GPU to GPU, else None."""
        self._check_peer(peer, "peer")
        return self._c.device_transport_for(peer)

    def _check_peer(self, peer: int, what: str) -> None:
        rank_int(peer, what)
        if not 0 <= peer < self.world_size:
            raise InvalidArgument(f"{what} {peer!r} out of range [0, {self.world_size})")
        if self._closed:
            from .errors import ClosedError

            raise ClosedError("communicator is closed")

    # ---- point-to-point -------------------------------------------------------

    def send(self, tensor: Array, dst: int, tag: int = 0, timeout: float | None = None) -> None:
        """Returns when `tensor` may be reused."""
        t = self._timeout if timeout is None else timeout
        kind = type(tensor)
        # One core call for a contiguous host array (the fast path answers False
        # for anything it does not take: then the general path below). The last
        # argument is the array kind the header names (arrays.NUMPY = 1, TORCH = 2).
        if kind is np.ndarray:
            if self._f.send(tensor, dst, tag, t, 1):
                return
        elif kind is _Tensor:
            # The torch adapter (arrays.use_torch_hooks) describes it in the core.
            if self._f.send(tensor, dst, tag, t, 2):
                return
            # Without the adapter, the description is read here. `kind is _Tensor`
            # narrows nothing for mypy and a cast() would be a call, hence the
            # ignores. Complex dtypes are not in _TORCH_WORDS (a conjugate view's
            # bits are not its values): they, and negative views, take describe_send.
            if (tensor.layout is _STRIDED and tensor.is_cpu  # type: ignore[union-attr]
                    and tensor.is_contiguous() and not tensor.is_neg()):  # type: ignore[union-attr]
                word = _TORCH_WORDS.get(tensor.dtype)
                try:
                    shape = tensor.shape
                except RuntimeError:  # (a nested tensor has none: the general path names it)
                    word = None
                if word is not None and self._f.send_ptr(tensor, dst, tag, tensor.data_ptr(),  # type: ignore[union-attr]
                                                         word, shape, t, 2):
                    return
        _check_timeout(t)
        if not (type(dst) is int and 0 <= dst < self.world_size):
            self._check_peer(dst, "dst")
            dst = int(dst)
        array = arrays.kind_of(tensor)
        tensor = arrays.native(tensor, "the array to send")
        ptr, nbytes, word, shape, _keep, stream = self._describe_send(tensor, dst)
        if stream >= 0:
            _check_capture()
        self._c.send(dst, tag, ptr, nbytes, word, shape, t, stream, _keep, array)

    def isend(self, tensor: Array, dst: int, tag: int = 0) -> Work:
        """Starts a send; `tensor` must not change until the work completes."""
        if self._orphans:
            self._settle_orphans()
        kind = type(tensor)
        if kind is np.ndarray:  # one core call (0: not taken there, e.g. strided: the general path)
            rid = self._f.isend(tensor, dst, tag, 1)
            if rid:
                return P2PWork(self, rid, None, dst, "send", tensor)
        elif kind is _Tensor and (rid := self._f.isend(tensor, dst, tag, 2)):  # the torch adapter, as in send
            return P2PWork(self, rid, None, dst, "send", tensor)
        elif (kind is _Tensor and tensor.layout is _STRIDED and tensor.is_cpu  # type: ignore[union-attr]
              and tensor.is_contiguous() and not tensor.is_neg()):  # type: ignore[union-attr]
            word = _TORCH_WORDS.get(tensor.dtype)
            ptr = tensor.data_ptr()  # type: ignore[union-attr]
            try:
                shape = tensor.shape
            except RuntimeError:  # (nested)
                word = None
            # (a zero tensor has no memory: describe_send materializes it)
            if (word is not None and type(dst) is int and 0 <= dst < self.world_size
                    and (ptr >= _NO_MEMORY_BELOW or not tensor.nbytes)):
                return P2PWork(self, self._c.isend(dst, tag, ptr, tensor.nbytes, word,
                                                   shape, -1, 2), None, dst, "send", tensor)
        self._check_peer(dst, "dst")
        if kind is _Tensor:
            array = arrays.TORCH
        elif kind is np.ndarray:
            array = arrays.NUMPY
        else:
            array = arrays.kind_of(tensor)
            tensor = arrays.native(tensor, "the array to send")
        return self._isend(tensor, int(dst), tag, self._describe_send(tensor, dst), array)

    def _describe_send(self, tensor: Array, dst: int) -> tuple[int, int, int, tuple[int, ...], Any, int]:
        """arrays.describe_send, staged through host memory where dst has no device route."""
        d = arrays.describe_send(tensor)
        if d[5] >= 0 and self._device_routes[dst] is None:
            return (*arrays.describe_host(_stage(tensor)), -1)
        if d[5] >= 0:
            arrays.check_device(tensor, self._cuda_device, "the tensor to send", "GPU transport")
        return d

    def _isend(self, tensor: Array, dst: int, tag: int, described: tuple[int, int, int, tuple[int, ...], Any, int],
               array: int) -> Work:
        ptr, nbytes, word, shape, keep, stream = described
        if stream < 0:
            return P2PWork(self, self._c.isend(dst, tag, ptr, nbytes, word, shape, -1, array), None, dst, "send", keep)
        _check_capture()
        return P2PWork(self, self._c.isend(dst, tag, ptr, nbytes, word, shape, stream, array), None, dst, "send",
                       keep, arrays.torch.cuda.current_stream(tensor.device))

    def recv(self, src: int, tag: int = 0, out: Any = None, timeout: float | None = None,
             copy: bool = True, array: str | None = None, *, exact: bool = False) -> Any:
        """Receive one message from `src`. With `out` (a bound-sized buffer: a
        torch tensor, numpy array, or any DLPack array such as cupy's), the
        message lands in its prefix and a view of out's kind with the sender's
        shape is returned; otherwise a new array of the sender's shape and dtype,
        of kind `array` ("auto": the sender's kind, "torch", "numpy" or "cupy";
        default: the communicator's `array` option).

        copy=False returns a zero-copy view of the receive slot instead: the slot
        goes back to the sender when the view is garbage collected, so do not hold
        more than `slots` of them per peer: the sender blocks until one returns.
        It excludes out= (InvalidArgument before the message is taken).

        exact=True: the message must fill `out` exactly (its dtype and size),
        else MessageMismatch (or MessageTooLarge) and the message is kept."""
        t = self._timeout if timeout is None else timeout
        if exact:
            if out is None:
                raise InvalidArgument("recv: exact=True checks the message against out: pass out= (a buffer of the "
                                      "expected dtype and size)")
            _check_timeout(t)
            return self.irecv(src, tag, out, copy=copy, array=array, exact=True).wait(t)
        # One core call where it can (None: the general path below decides).
        f = self._f
        if out is None:
            if copy:
                a = f.recv_new(src, tag, t, self._alloc if array is None else _allocators(array))
            else:
                a = f.recv_loan(src, tag, t, self._lend if array is None else arrays.lenders(_check_array(array)))
            if a is not None:
                if self._orphans:
                    self._settle_orphans()
                return a
        else:
            if not copy:
                raise _copy_and_out("recv")
            kind = type(out)
            r: Any = None
            if kind is np.ndarray or kind is _Tensor:  # (torch: through its adapter, as in send)
                r = f.recv(src, tag, out, t)
            # Inlined, as in send.
            if (r is None and kind is _Tensor and out.layout is _STRIDED and out.is_cpu and out.is_contiguous()
                    and not out.is_neg()):
                word = _TORCH_WORDS.get(out.dtype)
                try:
                    shape = out.shape
                except RuntimeError:  # (nested)
                    word = None
                if word is not None:
                    arrays.check_memory(out, "out")  # (its storage freed or shrunk: the write would go past it)
                    arrays.bump_version(out)
                    r = f.recv_ptr(src, tag, out, out.data_ptr(), out.nbytes, word, shape, t)
            if r is not None:
                if self._orphans:
                    self._settle_orphans()
                # out, a view of its front, or the message's Status (then the view is made here)
                return arrays.prefix_view(out, r.nbytes, r.shape) if type(r) is _Status else r
        _check_timeout(t)  # before anything is posted (t stays as given: inf is no limit, None the default)
        if not (type(src) is int and 0 <= src < self.world_size):
            self._check_peer(src, "src")
            src = int(src)
        if out is not None:
            kind = type(out)
            if kind is _Tensor and out.is_cuda and self._device_routes[src] is None:
                pass  # staged through host memory: irecv below
            elif not arrays.is_native(out):  # a DLPack array: received into a torch or numpy view of it
                nout = arrays.native(out, "out")
                return arrays.like(out, nout, self.recv(src, tag, nout, t, copy))
            else:
                ptr, cap, word, stream = arrays.describe_recv(out)
                if stream >= 0:
                    arrays.check_device(out, self._cuda_device, "out", "GPU transport")
                    _check_capture()
                r = self._c.recv_into(src, tag, ptr, cap, word, t, stream)
                if r is not None:
                    return arrays.prefix_view(out, r.nbytes, r.shape)
        return self.irecv(src, tag, out, copy=copy, array=array).wait(t)

    def empty(self, shape: int | Sequence[int], dtype: Any = "float32", array: str | None = None) -> Any:
        """An uninitialised host array (numpy or torch: `array`, default the
        communicator's; under "auto" a numpy dtype makes a numpy array) in
        this rank's landing area, to receive into: a large
        message received with ``out=`` it is written there by its sender, one
        copy in all, where an ordinary ``out`` takes two (or a kernel-mediated
        CMA copy). Allocate once and reuse, as for any ``out``. Freed when the
        array and its views are gone. With no room left in the area (option
        ``landing``) an ordinary array is returned, which works the same, with
        the extra copy."""
        try:  # (an int, numpy's too, or a sequence of them)
            dims = (operator.index(shape),) if not isinstance(shape, Sequence) else tuple(map(operator.index, shape))
        except TypeError:
            raise InvalidArgument(f"empty: shape must be an int or a sequence of ints, not {shape!r}") from None
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"empty: shape {dims} has a negative dimension")
        word = arrays.dtype_word(dtype)
        if math.prod(dims) * dtypes.itemsize(word) >= 1 << 63:
            raise InvalidArgument(f"empty: shape {dims} of {dtype} is more than 2**63 bytes")
        kind = _check_array(array) if array is not None else self._array
        if kind == "auto" and isinstance(dtype, (np.dtype, type)):
            kind = "numpy"  # a numpy dtype (np.int8, np.dtype("f4")) asks for a numpy array; torch's, torch
        kind = arrays.receive_kind(kind, 0)
        return self._landed_empty(kind, word, dims)[0]

    def _landed_empty(self, kind: str, word: int, dims: tuple[int, ...], lend_cap: int = 0) -> tuple[Any, int]:
        """empty() of a dtype word, and its data pointer (the collectives' outputs);
        an ordinary array where the area has no room, or where lent blocks would
        then hold over lend_cap bytes."""
        nbytes = dtypes.itemsize(word) * math.prod(dims)
        loan = self._c.landing_buffer(nbytes, lend_cap) if nbytes else None
        if loan is None:
            return arrays.empty(kind, word, dims)
        a: Any = arrays.lender(kind)(loan, word, dims, 0)
        return a, (a.data_ptr() if kind == "torch" else a.__array_interface__["data"][0])

    def isend_descriptor(self, dst: int, nbytes: int, dtype: int, shape: Sequence[int], tag: int = 0) -> Work:
        """Send a descriptor: a header describing `nbytes` of data (dtype word,
        shape) that travels in other messages; it carries none itself, so
        `nbytes` may exceed the bound. A recv of it returns its Status
        (``status.descriptor`` is True)."""
        self._check_peer(dst, "dst")
        return P2PWork(self, self._c.isend_descriptor(dst, tag, nbytes, dtype, tuple(shape)), None, dst, "send")

    def irecv(self, src: int, tag: int = 0, out: Any = None, copy: bool = True, array: str | None = None, *,
              exact: bool = False) -> Work:
        """Post a receive; wait() returns what recv() would. Receives from one
        source match its messages in posting order. A Work dropped without
        wait() still takes its message (and drops it, so later messages stay
        in order); with out=, the message still lands in out. exact=True: the
        message must fill out exactly (torch.distributed.recv's contract), else
        MessageMismatch (or MessageTooLarge) and the message is kept."""
        self._check_peer(src, "src")
        src = int(src)
        if out is not None and not copy:
            raise _copy_and_out("irecv")
        if self._orphans:
            self._settle_orphans()
        c = self._c
        if out is not None and not arrays.is_native(out):  # a DLPack array: received into a torch or numpy view
            nout = arrays.native(out, "out")
            w = cast(P2PWork, self.irecv(src, tag, nout, copy, exact=exact))
            inner = w._finish
            if inner is not None:
                w._finish = lambda: arrays.like(out, nout, inner())
            return w
        if out is not None:
            ptr, cap, word, stream = arrays.describe_recv(out)
            if exact:
                word |= _OUT_EXACT
            if stream >= 0 and self._device_routes[src] is None:
                # No GPU path to src (no nvlink or rdma-gpu for the pair): land in host
                # memory, then copy into out on the current stream.
                dout = cast("torch.Tensor", out)  # a CUDA tensor (stream >= 0)
                bounce = arrays.torch.empty(dout.shape, dtype=dout.dtype, device="cpu")
                bptr, bcap, bword = arrays.describe_out(bounce)
                rid = c.irecv(src, tag, bptr, bcap, bword | (word & _OUT_EXACT))

                def staged() -> Any:
                    st = c.info(rid)
                    view = arrays.prefix_view(dout, st.nbytes, st.shape)
                    view.copy_(arrays.prefix_view(bounce, st.nbytes, st.shape))
                    return view

                return P2PWork(self, rid, staged, src, "recv", bounce, settle=True)
            if stream < 0:
                rid = c.irecv(src, tag, ptr, cap, word)
                return P2PWork(self, rid, lambda: _prefix_of(out, c.info(rid)), src, "recv", out)
            arrays.check_device(out, self._cuda_device, "out", "GPU transport")
            _check_capture()
            # The core enqueues the copy into out on this stream when the message
            # arrives: if the Work is dropped, out is kept until then, and the
            # allocator must not reuse it for another stream before that copy ran.
            dout = cast("torch.Tensor", out)  # a CUDA tensor (stream >= 0)
            cur = arrays.torch.cuda.current_stream(dout.device)
            dout.record_stream(cur)
            rid = c.irecv(src, tag, ptr, cap, word, stream)
            return P2PWork(self, rid, lambda: _prefix_of(out, c.info(rid)), src, "recv", out, cur)
        asked = _check_array(array) if array is not None else self._array
        lend = self._lend if array is None else arrays.lenders(asked)
        rid = c.irecv(src, tag, 0, 0, 0)

        def finish() -> Any:
            st = c.info(rid)
            if st.descriptor:  # no payload of its own: its Status is the message
                c.release(rid)
                return st
            # copy=False refuses (kind, dtype) with the message kept for the next recv; a
            # rendezvous message has no slot to lend (None): it is copied out once instead.
            # One that landed (written by its sender into our landing area) is the result
            # as it is, for either copy: nothing else will ever write its block (cupy with
            # copy: no host block can be one, so it is copied out like any other).
            kind = arrays.receive_kind(asked, st.array)
            if not (copy and kind == "cupy") and (lent := c.loan(rid, lend, copy)) is not None:
                return lent
            word, shape = st.dtype, st.shape
            try:  # everything that can refuse the message, before it is consumed
                if kind == "cupy":
                    arrays.to_cupy(None)  # cupy is there
                    if not copy:
                        raise InvalidArgument("copy=False lends a host receive slot; a cupy array lives on the "
                                              "GPU: receive with copy=True, or as numpy")
                dev = None
                if kind in ("torch", "cupy") and self._cuda_device is not None and st.device:
                    # Sent from GPU memory: the result goes on our GPU, copied on its current stream.
                    dev = arrays.torch.device("cuda", self._cuda_device)
                    _check_capture()
                # cupy: received as numpy (host) or a CUDA torch tensor, then handed to cupy
                made = kind if kind != "cupy" else ("numpy" if dev is None else "torch")
                arr, ptr = arrays.empty(made, word, shape, dev)
            except BaseException:
                # Like a MessageMismatch: the message stays for the next recv
                # (one with out=, or another array kind).
                c.cancel(rid)
                raise
            if not c.copy_out(rid, ptr, -1 if dev is None else arrays.torch.cuda.current_stream(dev).cuda_stream):
                c.wait(rid, self._timeout)  # a rendezvous streaming in through the slots
            return arrays.to_cupy(arr) if kind == "cupy" else arr

        return P2PWork(self, rid, finish, src, "recv")

    def batch_isend_irecv(self, ops: Iterable[P2POp]) -> list[Work]:
        """Issue every op at once (receives first); rings and all-pairs patterns
        cannot deadlock because nothing here blocks. Every op is checked before
        any is posted, so a bad op posts nothing; if posting still fails (a
        peer died, the communicator closed), what was posted is cancelled:
        unmatched receives leave their messages for later receives."""
        from . import _C

        ops = list(ops)
        sends: dict[int, tuple[Any, tuple[int, int, int, tuple[int, ...], Any, int], int]] = {}
        for i, op in enumerate(ops):
            fn = getattr(op.op, "__func__", op.op)
            if fn not in (Communicator.irecv, Communicator.isend):
                raise InvalidArgument(f"ops[{i}]: P2POp.op must be comm.isend or comm.irecv")
            if getattr(op.op, "__self__", self) is not self:
                raise InvalidArgument(f"ops[{i}]: P2POp.op belongs to another communicator")
            self._check_peer(op.peer, f"ops[{i}].peer")
            _C.check_tag(op.tag)
            if fn is Communicator.irecv:
                if op.tensor is not None:
                    t_ = arrays.native(op.tensor, f"ops[{i}].tensor")
                    if arrays.describe_recv(t_)[3] >= 0 and self._device_routes[int(op.peer)] is not None:
                        arrays.check_device(t_, self._cuda_device, f"ops[{i}].tensor", "GPU transport")
                elif op.exact:
                    raise InvalidArgument(f"ops[{i}]: exact=True checks the message against the irecv's tensor: "
                                          "pass one (a buffer of the expected dtype and size)")
                continue
            if op.exact:
                raise InvalidArgument(f"ops[{i}]: exact=True is for an irecv (its message must fill its tensor), "
                                      "not an isend")
            if op.tensor is None:
                raise InvalidArgument(f"ops[{i}]: an isend needs a tensor")
            tensor = arrays.native(op.tensor, f"ops[{i}].tensor")
            d = self._describe_send(tensor, op.peer)
            sends[i] = (tensor, d, arrays.kind_of(op.tensor))
            if d[1] > (limit := self._c.send_limit(int(op.peer), d[5] >= 0)):
                why = (f"the receive bound of {limit} bytes on rank {op.peer} (a GPU payload goes into one slot; "
                       "raise it with varcomm.init(bound=...) or VARCOMM_BOUND on the receiver)" if d[5] >= 0 and
                       limit == self._c.peer_bound(int(op.peer)) else
                       f"this rank's max_message of {limit} bytes (VARCOMM_MAX_MESSAGE)")
                raise MessageTooLarge(f"ops[{i}]: message of {d[1]} bytes exceeds {why} (nothing was posted)")
        works: list[Work | None] = [None] * len(ops)
        try:
            for i, op in enumerate(ops):
                if i not in sends:
                    works[i] = self.irecv(op.peer, op.tag, op.tensor, exact=op.exact)
            for i, (tensor, d, kind) in sends.items():
                works[i] = self._isend(tensor, int(ops[i].peer), ops[i].tag, d, kind)
        except BaseException as e:
            for w in works:
                if isinstance(w, P2PWork):
                    w._cancel(e)
            raise
        return [w for w in works if w is not None]

    # ---- all-to-all (varcomm/collectives/alltoall.py) ---------------------------------------

    @overload
    def all_to_all_v(self, x: Array, send_splits: Splits, *, tag: int | None = None, out: Array | None = None,
                     async_op: Literal[False] = False, timeout: float | None = None) -> tuple[Array, list[int]]: ...
    @overload
    def all_to_all_v(self, x: Array, send_splits: Splits, *, tag: int | None = None, out: Array | None = None,
                     async_op: Literal[True], timeout: float | None = None) -> Work: ...
    @overload
    def all_to_all_v(self, x: Array, send_splits: Splits, *, tag: int | None = None, out: Array | None = None,
                     async_op: bool = False, timeout: float | None = None) -> tuple[Array, list[int]] | Work: ...
    def all_to_all_v(self, x: Array, send_splits: Splits, *, tag: int | None = None, out: Array | None = None,
                     async_op: bool = False, timeout: float | None = None) -> tuple[Array, list[int]] | Work:
        """Rows of x split by send_splits go to each rank; returns (concatenated rows
        in source order, rows received per source). Counts travel with the data.
        With send_splits on the GPU: (bound-sized out, counts and offsets per
        source as a [2, world] device tensor), no host sync (alltoall_device)."""
        from .collectives import alltoall

        return alltoall.all_to_all_v(self, x, send_splits, tag=tag, out=out, async_op=async_op, timeout=timeout)

    @overload
    def all_to_all_single(self, output: Array, input: Array, output_split_sizes: Splits | None = None,
                          input_split_sizes: Splits | None = None, *, async_op: Literal[False] = False,
                          timeout: float | None = None) -> None: ...
    @overload
    def all_to_all_single(self, output: Array, input: Array, output_split_sizes: Splits | None = None,
                          input_split_sizes: Splits | None = None, *, async_op: Literal[True],
                          timeout: float | None = None) -> Work: ...
    @overload
    def all_to_all_single(self, output: Array, input: Array, output_split_sizes: Splits | None = None,
                          input_split_sizes: Splits | None = None, *, async_op: bool = False,
                          timeout: float | None = None) -> Work | None: ...
    def all_to_all_single(self, output: Array, input: Array, output_split_sizes: Splits | None = None,
                          input_split_sizes: Splits | None = None, *, async_op: bool = False,
                          timeout: float | None = None) -> Work | None:
        """torch.distributed.all_to_all_single's contract, when the output splits are known."""
        from .collectives import alltoall

        return alltoall.all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                                          async_op=async_op, timeout=timeout)

    @overload
    def all_to_all(self, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array], *,
                   async_op: Literal[False] = False, timeout: float | None = None) -> list[Array]: ...
    @overload
    def all_to_all(self, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array], *,
                   async_op: Literal[True], timeout: float | None = None) -> Work: ...
    @overload
    def all_to_all(self, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array], *,
                   async_op: bool = False, timeout: float | None = None) -> list[Array] | Work: ...
    def all_to_all(self, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array], *,
                   async_op: bool = False, timeout: float | None = None) -> list[Array] | Work:
        from .collectives import alltoall

        return alltoall.all_to_all(self, output_tensor_list, input_tensor_list, async_op=async_op, timeout=timeout)

    def barrier(self, timeout: float | None = None) -> None:
        """Every rank reaches this point (through the store; not on the data path).
        A rank that died makes it fail (PeerFailure) within a second or so;
        `timeout` (seconds; default: the communicator's) bounds the wait."""
        if self._closed:
            from .errors import ClosedError

            raise ClosedError("communicator is closed")
        limit = _check_timeout(timeout)
        if timeout is not None and limit is None:
            limit = 1e9  # inf: no limit
        if self._orphans:
            self._settle_orphans()
        n = self._barriers + 1
        self._barriers = n
        given_up = threading.Event()

        def arrive() -> None:
            self._publish(f"barrier/{n}")  # (who arrived: a rank that died after it is not blamed)
            self._wait_all(f"barrier/{n}", limit, given_up)

        try:
            # (on a thread: a store call on a stopped store host held it past every timeout)
            self._bounded(arrive, limit=(limit if limit is not None else self._timeout or 300) + 2.0,
                          still=lambda: self._bounded(self._store.check, [f"barrier/{n}/probe"], limit=2.0))
        except _StoreSilent as e:
            self._end.store_down = True  # (close() must not wait on it either)
            raise _Timeout(f"barrier: {e}: the process that hosts it (rank 0 under varcomm.init or varcomm-run, "
                           "torchrun's agent under torchrun) is stopped or hung, or the network to it is down (no "
                           "error came back, only silence)") from None
        except VarcommError:
            raise
        except (RuntimeError, OSError) as e:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
            raise self._store_lost("barrier", e) from None
        finally:
            given_up.set()

    def _settle_orphans(self) -> None:
        """Finish the dropped receives whose message is in (see P2PWork settle)."""
        orphans, self._orphans = self._orphans, []  # a finish may drop more (the GC appends)
        c = self._c
        for rid, finish in orphans:
            try:
                if not c.test(rid):
                    self._orphans.append((rid, finish))
                    continue
                c.wait(rid, 0.0)
                finish()
            except Exception:  # its Work was dropped: nobody is left to hear of it
                pass  # failed or closed (nothing arrived), or refused (kept for the next recv): nothing to copy

    def _store_lost(self, what: str, e: Exception) -> PeerFailure:
        """The store stopped answering: its host (rank 0 under varcomm-run,
        the agent under torchrun) exited, or the network to it is down."""
        self._end.store_down = True  # (each later call to it would print a C++ stack trace from torch)
        dead = [why for r in range(self.world_size) if r != self.rank and (why := self._c.peer_error(r))]
        return PeerFailure(f"{what}: the rendezvous store stopped answering ({e}); "
                           + ("; ".join(dead) if dead else "the process that hosts it has most likely exited"))

    # ---- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Leave the job.

        Queued sends are flushed first: close keeps writing them while their
        receivers free slots, for up to 10 s, and stops waiting for a receiver
        that closed or died. Then every Work that completed stays completed
        (wait() returns its result) and every other one fails with ClosedError;
        later calls raise ClosedError. Peers may still be writing into this
        rank's region, so close then waits for them to close too (or die): up
        to 30 s on the rank that hosts the rendezvous store, 10 s where a
        network route exists."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the communicator is its parent's (the core lets it be)
            return
        # Device all-to-all / point-to-point: this rank's kernels run to their
        # end (or are aborted: a dead peer, 10 s) before it says it left, and its
        # workspace is freed only once every peer left too: a peer's receive
        # kernel writes its credits into this rank's workspace through CUDA IPC
        # (freed at once, a late peer wrote freed device memory).
        devices = [dev for dev in (self._device_p2p, self._device_a2a) if dev is not None]
        store_down = self._end.store_down
        try:  # (whatever the drain raises, ^C too, the finally frees the devices and the core)
            for dev in devices:
                try:
                    dev.synchronize(None, _CLOSE_FLUSH_S)
                except VarcommError:  # failed, timed out or aborted: close frees it all the same
                    pass
            # The core first takes messages still streaming in to their end (a
            # dropped irecv(out=) is filled so), then says goodbye; only then
            # "left": senders stop flushing to a rank that left, and a sender
            # that tears its endpoint down with our data unread loses it.
            self._c.goodbye(self._end.failing)
            if self._orphans:
                self._settle_orphans()  # those whose message is in; the rest fail with the close
            try:
                if not store_down:
                    self._bounded(self._publish, "left")
            except (RuntimeError, OSError):  # the store's host died: close without it
                store_down = True
            if not store_down:  # (else its peers are gone with it: nothing to wait for)
                self._flush(time.monotonic() + _CLOSE_FLUSH_S)
            # Every rank waits for the others (or their deaths) before tearing its
            # transports down: peers may still be writing into our region, and rank
            # 0 hosts the store. Progress meanwhile so their writes complete.
            keep_store = self._owner is not None and self.rank == 0
            rdma = self._c.close_waits_for_peers
            if (keep_store or rdma or devices) and not store_down:
                limit = float(30 if keep_store else 10)
                if self._end.peer_wait_cap is not None:
                    limit = min(limit, self._end.peer_wait_cap)
                start = time.monotonic()
                deadline, said = start + limit, False
                missing = [r for r in range(self.world_size) if r != self.rank]
                while missing and time.monotonic() < deadline:
                    if self._end.at_exit and not said and time.monotonic() - start > 1.0:
                        said = True  # (a process that seems to hang at its exit says why)
                        host = "it hosts the rendezvous store, and " if keep_store else ""
                        print(f"varcomm: at exit, rank {self.rank} waits for rank(s) {missing} to close too (up to "
                              f"{limit:.0f} s: {host}they may still write into its memory)", file=sys.stderr,
                              flush=True)
                    self._c.progress()  # (and our goodbyes, once a full ring has room)
                    try:  # (every pass: a peer seen to leave later let its exit fail our receives first)
                        left = self._bounded(self._published, missing, "left")
                        missing = [r for r in missing if r not in left]
                    except Exception:  # the store's owner left after every rank had, or is cut off
                        break
                    # A rank that died without closing will not come: stop waiting for it.
                    if all(self._c.peer_error(r) for r in missing):
                        break
                    time.sleep(0.005)
        finally:
            for dev in devices:  # kernels' waits end, streams drain, before the engine goes
                dev.close()
            if self._fallback is not None:
                self._fallback.close()
            self._c.close()
            if self._a2a is not None:  # dropped all-to-alls end with ClosedError now: their thread goes too
                self._a2a.join(2.0)

    def _bounded(self, call: Callable[..., Any], *args: Any, limit: float = _CLOSE_STORE_S,
                 still: Callable[[], Any] | None = None) -> Any:
        """Store calls (close()'s, a barrier's), given up (_StoreSilent) after
        `limit` s, their thread left behind (a daemon: it ends with the
        process). A store client call has no deadline of its own: a stopped or
        unreachable store host (no connection reset) holds it for torch's
        store timeout. still(): at `limit`, whether to wait on (it returns:
        the store answers, so `call`, which makes many, is slow, not stuck;
        _StoreSilent: give up)."""
        if sys.is_finalizing():  # (a close() from a __del__ at exit: a thread started now never runs)
            return call(*args)
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, call(*args)))
            except BaseException as e:  # (handed to the caller)
                box.append((False, e))

        t = threading.Thread(target=run, daemon=True, name="varcomm-store-call")
        t.start()
        t.join(limit)
        while not box and still is not None:
            try:
                still()
            except _StoreSilent:
                break
            t.join(1.0)
        if not box:
            raise _StoreSilent(f"the rendezvous store did not answer within {limit:.3g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _flush(self, deadline: float) -> None:
        """Drive queued sends until written, `deadline`, or every receiver left
        has closed (it receives nothing more) or died (the core fails those)."""
        checked = 0.0
        while pending := self._c.unflushed():
            now = time.monotonic()
            if now > deadline:
                return
            if now - checked > 0.05:  # the store is a round trip: not every pass
                checked = now
                try:
                    if all(self._bounded(self._published, [p], "left") for p in pending):
                        return
                except Exception:  # the store's owner left: so did its peers
                    return
            time.sleep(0.0005)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, bound={self.bound}, "
                f"slots={self.slots}, transports={sorted(set(self._routes))})")


def _cuda_device(options: Options) -> int:
    """The GPU this process uses, -1 when none or unknown: nvlink_device, else
    torch's current device once this process has used CUDA (or, with nvlink
    forced on, whenever CUDA is available). A fact for the core, not a choice."""
    if options.nvlink_device is not None:
        return options.nvlink_device
    torch = arrays.torch
    if options.nvlink == "off" or torch is None:
        return -1
    if torch.cuda.is_initialized() or (options.nvlink == "on" and torch.cuda.is_available()):
        return int(torch.cuda.current_device())
    return -1


def _stage(tensor: Any) -> Any:
    """The staging path for a CUDA tensor to a peer with no GPU transport (no
    nvlink or rdma-gpu for the pair: the fallback route, a build without CUDA, a
    peer that does not use CUDA): a host copy, sent as usual. The receiver gets
    a host tensor unless it receives into a CUDA out=."""
    return tensor.detach().to("cpu")


def _copy_and_out(what: str) -> InvalidArgument:
    return InvalidArgument(f"{what}: copy=False lends the receive slot itself, out= asks for the message in out; pass "
                           "one of them (out= with the default copy=True)")


def _check_array(array: str) -> str:
    if array not in ("auto", "torch", "numpy", "cupy"):
        raise InvalidArgument(f"array={array!r}: use auto, torch, numpy or cupy")
    return array


def _allocators(array: str) -> tuple[Any, ...]:
    return arrays.allocators(_check_array(array))


def _check_capture() -> None:
    if arrays.torch.cuda.is_current_stream_capturing():
        raise InvalidArgument("varcomm send/recv of CUDA tensors cannot be captured in a CUDA graph: sequence "
                              "numbers and credits are host state, so a replay would repeat the captured message")


def _prefix_of(out: Any, st: Status) -> Any:
    return arrays.prefix_view(out, st.nbytes, st.shape)


def rank_int(value: Any, what: str) -> int:
    """A rank argument as an int: an int or numpy integer; a bool, float, str
    or tensor is refused, naming the argument (int() would truncate 1.7 to 1)."""
    if isinstance(value, bool):  # an int to Python, but never meant as a rank
        raise InvalidArgument(f"{what} must be an int rank (numpy integers too), not a bool ({value!r})")
    if not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{what} must be an int rank (numpy integers too), not {type(value).__name__} "
                              f"({value!r})")
    return int(value)


_torch_store_inits = 0  # init() calls that joined through torch.distributed's default store


def init(rank: int | None = None, world_size: int | None = None, store: Store | None = None, *,
         prefix: str | None = None, **options: Any) -> Communicator:
    """Join the job and connect to every peer.

    rank/world_size default to the launcher's environment (varcomm-run, torchrun,
    mpirun, srun); `store` defaults to a TCPStore at MASTER_ADDR:MASTER_PORT.
    Where torch.distributed is initialized already (any backend: nccl, gloo,
    varcomm) and neither rank nor store is given, its default group's store,
    rank and size are used: its rank 0 hosts MASTER_PORT's store already.
    prefix: with store=, the key prefix of this communicator (else an instance count).
    options: any field of varcomm.options.Options, by name; each defaults to its
    VARCOMM_* variable, then to its default (README "Options and environment"):
    bound (VARCOMM_BOUND, 8 MiB): largest message a peer may send us.
    slots (VARCOMM_SLOTS, 8): messages in flight per sending peer.
    transport (VARCOMM_TRANSPORT): auto | shm | rdma | fallback.
    timeout (VARCOMM_TIMEOUT, seconds, default 600; None waits forever).
    init_timeout (VARCOMM_INIT_TIMEOUT, seconds, default 30): how long init waits
    for every rank and the store; then it raises varcomm.TimeoutError naming
    the ranks that never arrived (a rank that came twice, a world size that
    disagrees, the port a foreign program holds: InvalidArgument, at once;
    another rank's failed set-up: PeerFailure, at once; a rank silent in
    set-up: TimeoutError after the larger of init_timeout and timeout).
    array (VARCOMM_ARRAY, auto): kind returned by recv without out: auto (the sender's) | torch | numpy | cupy.
    rdma_provider, rdma_iface, spin_us, nvlink, a2a_algorithm, ...: see Options.
    An unknown option raises TypeError; a bad value, InvalidArgument.
    """
    opts = Options.resolve(keyword_origin="init", **options)
    if store is None and rank is None and world_size is None:
        group = bootstrap.torch_default_group()
        if group is not None:
            store, rank, world_size = group
            if prefix is None:  # counting init() calls only: ranks may have made other communicators (subgroups)
                global _torch_store_inits
                _torch_store_inits += 1
                prefix = f"varcomm/init/{_torch_store_inits}/"
    return connect(opts, rank, world_size, store, prefix)


def connect(options: Options, rank: int | None = None, world_size: int | None = None, store: Store | None = None,
            prefix: str | None = None) -> Communicator:
    """init() with options already resolved (the torch backend and varcomm.distributed)."""
    if arrays.torch is not None and not _TORCH_WORDS:
        from . import dtypes

        # Not complex ones: a conjugate view's bytes are not its values (arrays.values).
        _TORCH_WORDS.update({dt: w for dt, w in dtypes.torch_words().items() if not dt.is_complex})
    p = bootstrap.placement(rank, world_size, have_store=store is not None)
    options = options.placed(p.local_world_size)
    run.mark_peer_failures()  # (under varcomm-run: the launcher then names the rank that failed first)
    s, owner = bootstrap.make_store(p, store, options.timeout, options.init_timeout, prefix, options.job_key)
    return Communicator(p, s, owner, options)


__all__ = ["Communicator", "Work", "P2PWork", "P2POp", "Options", "init", "connect"]
