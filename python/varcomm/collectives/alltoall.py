"""Variable-size all-to-all without a count exchange.

Every chunk travels as one varcomm message whose header carries its shape and
dtype, so a receiver learns each source's row count from the message itself:
no count all-to-all, no device-to-host sync before the payload is posted.

The exchange itself (tags, the one-phase and two-phase strategies, error
markers, the local copy, timeouts and clean-up) is one engine in the core,
``csrc/collectives.{h,cpp}``; this module checks arguments, describes the
arrays to it, and allocates an output once the headers told its size.
Errors are raised only after every pair's messages were consumed, so the
communicator stays usable for the next collective.

Device memory (CUDA tensors, with splits known on the host): the same entry
points and the same engine. Each chunk's copy is ordered on the caller's
current stream; its header travels through host memory at enqueue, so a
receiver allocates its output (on the input's device) without waiting on the
GPU, and the host never blocks on GPU work. A peer with a device route
(nvlink on one host, rdma-gpu across hosts) is reached without a host wait; a chunk to a peer without one is staged
through a host copy (which does block the host), and a rank with no device
transport at all runs the host collective on host copies. How device arrays
are seen (place, stream, allocation) is `arrays.DeviceMemory`.

The strategy is the option ``a2a_algorithm`` (``VARCOMM_A2A_ALGORITHM``), read at call time:
``auto`` or ``one-phase`` (counts travel in each chunk's header), or
``two-phase``, the conventional baseline (a descriptor per pair with the
count, dtype and shape, then the payload into exactly-sized buffers).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, TypeVar, cast, overload

import numpy as np

from .. import _C, arrays, dtypes
from ..errors import InvalidArgument, VarcommError
from ..errors import TimeoutError as _Timeout
from . import alltoall_device

if TYPE_CHECKING:
    import torch

    from ..arrays import Array, Splits
    from ..comm import Communicator
    from ..work import Work

R = TypeVar("R")

#: Collective tags are >= this; user point-to-point tags should stay below it.
COLL_TAG_BASE: int = _C.COLL_TAG_BASE
#: Largest user `tag` a collective accepts (it selects a sub-space of the reserved tags).
MAX_COLL_TAG: int = _C.MAX_COLL_TAG

__all__ = ["all_to_all_v", "all_to_all_single", "all_to_all", "AllToAllWork", "COLL_TAG_BASE"]

_STRATEGIES = {"auto": 0, "one-phase": 0, "two-phase": 1}
_V, _SINGLE = 0, 1  # the core's row-form operations


def _strategy(comm: Communicator) -> int:
    """The all-to-all strategy (option a2a_algorithm), read at call time."""
    return _STRATEGIES[comm.options.a2a_algorithm]


# What a layer above names its all-to-alls in their errors: (operation, input,
# backward), e.g. ("moe.combine", "expert_outputs", False); unset, the
# function's own names, a forward.
_label: contextvars.ContextVar[tuple[str, str, bool]] = contextvars.ContextVar("varcomm_a2a_label",
                                                                              default=("", "", False))


# A value every rank passes alike for the row-form all-to-alls started inside
# (the core's A2APlan::agree): (kind << 20 | value, its name, why it must agree); 0: none.
_agreed: contextvars.ContextVar[tuple[int, str, str]] = contextvars.ContextVar("varcomm_a2a_agree",
                                                                             default=(0, "", ""))
# The kinds of values (csrc/protocol.h kAgreeKindShift): moe.dispatch's num_experts, and which dispatch a
# combine, a dispatch's backward or a combine's backward undoes.
AGREE_NUM_EXPERTS, AGREE_COMBINE, AGREE_DISPATCH_BACK, AGREE_COMBINE_BACK = 1, 2, 3, 4


@contextlib.contextmanager
def agreeing(kind: int, value: int, name: str, why: str) -> Iterator[None]:
    """Row-form all-to-alls started inside carry `value` (20 bits) of `kind`
    (1..15) in every chunk's header: a rank whose value differs fails the
    call on every rank it sends to or receives from, a rank it sends no rows
    too, with "rank s passed <name> v where rank r passed w<why>"; a rank
    whose kind differs (another call, or none) is out of step."""
    if not 0 <= kind < 16:
        raise ValueError(f"agreeing: kind {kind} is not in 0..15")
    token = _agreed.set((kind << 20 | value & 0xFFFFF if kind else 0, name, why))
    try:
        yield
    finally:
        _agreed.reset(token)


@contextlib.contextmanager
def labelled(name: str, input: str, backward: bool = False) -> Iterator[None]:
    """Row-form all-to-alls started inside are named `name` (their input
    `input`) in the errors every rank gets. backward: they are an autograd
    backward's, and one that meets a peer's forward fails on both ranks (out
    of step) instead of pairing a gradient with the peer's rows."""
    token = _label.set((name, input, backward))
    try:
        yield
    finally:
        _label.reset(token)


# The only uses of the core's collective binding.
# keep: the arrays behind the pointers; a send still in flight when the
# collective is given up on (timeout, error) keeps them alive in the core.
def _rows(comm: Communicator, op: int, tag: int, ptr: int, row_bytes: int, splits: list[int], word: int,
          trailing: tuple[int, ...], out: int, cap: int, keep: object, expect: list[int] | None = None,
          stream: int = -1, x_host: int = 0) -> _C.AllToAll:
    name, input, backward = _label.get()
    if row_bytes >= 1 << 63:  # (only an empty x can have such rows: (0, 2**62) float32)
        raise InvalidArgument(f"{name or 'all-to-all'}: a row of {input or 'x'} (trailing shape {trailing}) would be "
                              f"{row_bytes} bytes, "
                              "more than a message can describe (2**63): use a smaller trailing shape")
    agree, agree_name, agree_why = _agreed.get()
    return _C.all_to_all_rows(comm._c, op, _strategy(comm), tag, ptr, row_bytes, splits, word, trailing, out, cap,
                              expect, keep, stream, x_host, name, input, backward, agree, agree_name, agree_why)


def _list(comm: Communicator, sends: list[tuple[Any, ...]], outs: list[tuple[Any, ...] | None], keep: object,
          stream: int = -1) -> _C.AllToAll:
    return _C.all_to_all_list(comm._c, _strategy(comm), sends, outs, keep, stream)


def _run(comm: Communicator, handle: _C.AllToAll, timeout: float | None,
         alloc: Callable[..., int] | None = None) -> Any:
    """Rows per source (row forms; Any: the caller knows it is a list), None (list form)."""
    return handle.run(comm._timeout if timeout is None else timeout, alloc)


# ---------------------------------------------------------------------------
# argument checks


def _prod(s: Sequence[int]) -> int:
    p = 1
    for v in s:
        p *= int(v)
    return p


def _rows_of(x: Any, what: str) -> tuple[int, tuple[int, ...], int, int, int]:
    """(rows, trailing shape, bytes per row, pointer, dtype word) of a >= 1-d host array."""
    if len(x.shape) == 0:
        raise InvalidArgument(f"{what} must have at least one dimension (rows are split along dim 0)")
    ptr, _nbytes, word, shape, _keep = arrays.describe_host(x)
    trailing = tuple(int(s) for s in shape[1:])
    return int(shape[0]), trailing, dtypes.itemsize(word) * _prod(trailing), ptr, word


def _splits(splits: Any, n: int, total: int | None, what: str) -> list[int]:
    if splits is None:
        if total is None or total % n:
            raise InvalidArgument(f"{what}: {total} rows do not split evenly over {n} ranks; pass split sizes")
        return [total // n] * n
    if arrays.is_torch(splits):
        if splits.device.type != "cpu":
            raise InvalidArgument(f"{what} must be a list or a CPU tensor, not on {splits.device}")
        splits = splits.tolist()
    elif isinstance(splits, np.ndarray):
        splits = splits.tolist()
    try:
        items = list(splits)
    except TypeError as e:
        raise InvalidArgument(f"{what} must be a sequence of {n} ints") from e
    # Ints only (numpy integers too), as for ranks and tags: 2.5 rows, "4" or
    # True is a caller's bug, not a count to round.
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
    if bad:
        raise InvalidArgument(f"{what} must hold ints (row counts), not {bad[0]!r} ({type(bad[0]).__name__})")
    out = [int(v) for v in items]
    if len(out) != n:
        raise InvalidArgument(f"{what} has {len(out)} entries; the world has {n} ranks")
    if any(s < 0 for s in out):
        raise InvalidArgument(f"{what} has a negative entry: {out}")
    if total is not None and sum(out) != total:
        raise InvalidArgument(f"{what} sums to {sum(out)} but dim 0 has {total} rows")
    return out


def _agree(output: Any, inp: Any, differ: bool, otrail: tuple[int, ...], trailing: tuple[int, ...]) -> None:
    if differ:
        raise InvalidArgument(f"output ({output.dtype}, rows of shape {otrail}) and input ({inp.dtype}, rows of "
                              f"shape {trailing}) must agree in dtype and trailing shape")


# A collective's host output of at least comm._landed_min[torch] bytes (the
# core says: Engine::landed_output_min; 0: never) is placed in the landing
# area (Communicator.empty), where a peer writes its chunk itself, one memcpy,
# and the pages stay mapped and touched from one call to the next. Such an
# output is lent only while lent blocks (these outputs and comm.empty
# buffers) would then hold at most half the area, so outputs kept alive (MoE
# dispatch outputs saved for backward) leave the rest to point-to-point
# landings; past that, an ordinary array. Only lent blocks count: a chunk of
# this same call landing in the area meanwhile does not change where its
# output comes from.
def _host_out(comm: Communicator, kind: str, word: int, shape: tuple[int, ...]) -> tuple[Array, int]:
    """A collective's host output, and its data pointer."""
    nbytes = dtypes.itemsize(word) * _prod(shape)
    least = comm._landed_min[kind == "torch"]
    if least and nbytes >= least:
        return comm._landed_empty(kind, word, shape, comm.options.landing // 2)
    return arrays.empty(kind, word, shape)


_F = TypeVar("_F", bound=Callable[..., Any])


def _in_step(fn: _F) -> _F:
    """An entry point whose call this rank refuses before the core took the
    collective's number (an argument error: splits that do not add up, a bad
    out) refuses it to every peer too (the core's AllToAll::refuse): they fail
    that same call at once, naming this rank, where they would otherwise pair
    their next call with this rank's next, and take each other's data.
    Nested entry points (moe.dispatch around all_to_all_v) refuse once. Any
    exception before the core took the number refuses, not only the
    InvalidArgument of a check: an argument no check foresaw (a numpy array
    where a tensor goes) fails inside torch with its own error."""
    @functools.wraps(fn)
    def call(comm: Communicator, *args: Any, **kw: Any) -> Any:
        before, device_before = comm._c.collectives, alltoall_device.launched(comm)
        try:
            return fn(comm, *args, **kw)
        except Exception as e:
            if isinstance(e, InvalidArgument):
                _name_call(e, fn, comm)
            if _device_protocol(fn.__name__, args, kw):  # its own refusal: an empty launch
                alltoall_device.refuse_unlaunched(comm, e, device_before, args[0] if args else None,
                                                  kw.get("stream"), kw.get("timeout"))
                raise
            # (A closed communicator or a failed peer: nothing to refuse through.)
            failure = isinstance(e, VarcommError) and not isinstance(e, InvalidArgument)
            if failure or comm._c.collectives != before or getattr(e, "_refused_to_peers", False):
                raise
            tag = kw.get("tag")
            _C.all_to_all_refuse(comm._c, int(tag) if type(tag) is int else 0)
            with contextlib.suppress(AttributeError):  # (an exception type without a __dict__)
                e._refused_to_peers = True  # type: ignore[attr-defined]
            raise
    return cast(_F, call)


def _name_call(e: InvalidArgument, fn: Callable[..., Any], comm: Communicator) -> None:
    """This rank's own argument error starts "<call> on rank r:", as its
    peers' errors about the call do (the name a layer above labelled the
    call with, as moe.combine, or the entry point's)."""
    name = _label.get()[0] or ("moe." if fn.__module__.endswith(".moe") else "") + fn.__name__
    text = str(e)
    if e.args and not _NAMED.match(text) and not text.startswith((name, fn.__name__)):
        e.args = (f"{name} on rank {comm.rank}: {text}",) + e.args[1:]


_NAMED = re.compile(r"[\w.]+ on rank \d+: ")


def _device_protocol(name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> bool:
    """Whether the call was the device-split form, whose refusals are its own
    protocol's (CUDA send_splits; moe with CUDA topk_ids, or its handle)."""
    if name == "all_to_all_v":
        return alltoall_device.is_device_splits(kw.get("send_splits", args[1] if len(args) > 1 else None))
    if name == "dispatch":
        ids = kw.get("topk_ids", args[1] if len(args) > 1 else None)
        return bool(getattr(ids, "is_cuda", False))
    if name == "combine":
        h = kw.get("handle", args[1] if len(args) > 1 else None)
        from .moe_device import DeviceMoEHandle  # (combine takes torch: loaded already)

        return isinstance(h, DeviceMoEHandle)
    return False


def _check_timeout(timeout: float | None) -> None:
    """NaN, a negative number or a non-number is refused before the collective starts (the core's rule)."""
    if timeout is not None:
        _C.check_timeout(timeout)


def _check_out(out: Any, what: str) -> None:
    if not (arrays.is_torch(out) or isinstance(out, np.ndarray)):
        raise InvalidArgument(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(out).__name__}")


def _check_out_rows(out: Any, trailing: tuple[int, ...]) -> None:
    """all_to_all_v's out is a buffer whose prefix is viewed as [rows, *x.shape[1:]]:
    a 1-d one, or rows of x's shape (out of [N, 7] for rows of 4 came back
    filled across its rows, out[0] holding one row and most of the next)."""
    shape = tuple(int(v) for v in out.shape)
    if len(shape) > 1 and shape[1:] != trailing:
        raise InvalidArgument(f"out has rows of shape {shape[1:]} but x's rows are {trailing}: the result is out's "
                              f"front viewed as [rows, *x.shape[1:]]; pass an out with x's row shape, or a 1-d "
                              f"buffer (out.view(-1))")


# ---------------------------------------------------------------------------
# device memory


class _Dev(NamedTuple):
    """A collective on device memory: where (place), ordered on what (stream)."""

    mem: arrays.DeviceMemory
    place: Any
    stream: Any

    @property
    def handle(self) -> int:
        return self.mem.handle(self.stream)


def _device(comm: Communicator, xs: Sequence[Any], outs: Sequence[Any], what: str) -> _Dev | None:
    """The device the collective runs on, None for host memory. Inputs and
    given outputs must all be in the same memory: one device, or the host."""
    dm = arrays.device_memory()
    places = [dm.place(t) for t in xs] + [dm.place(o) for o in outs if o is not None]
    if all(p is None for p in places):
        return None
    if any(p != places[0] for p in places):
        raise InvalidArgument(f"{what}: every input and output must be in the same memory (one device, or the host), "
                              f"got {sorted({str(p or 'host') for p in places})}; move them to one device first")
    arrays.check_device(places[0], comm._cuda_device, f"{what}'s data", "GPU transport")
    return _Dev(dm, places[0], dm.stream(places[0]))


def _dense(dev: _Dev, x: Any, what: str) -> Any:
    """x as contiguous device memory of its values (a copy where it is not)."""
    arrays._strided(x, what)
    y = arrays.values(x)
    if not y.is_contiguous():
        y = y.contiguous()
    return x if y is x else dev.mem.to(y, dev.place)


def _dev_out(dev: _Dev, out: Any, what: str) -> tuple[int, int, int]:
    """(pointer, capacity bytes, dtype word) of a device output, which the
    copies on dev.stream write later."""
    arrays._check_out_bits(out)
    if not out.is_contiguous():
        raise InvalidArgument(f"{what} must be contiguous: chunks are received straight into it")
    dev.mem.record(out, dev.stream)
    # An empty tensor's data_ptr is 0, which the core reads as "no out" (as describe_out).
    arrays.check_memory(out, what)
    arrays.bump_version(out)
    return out.data_ptr() or arrays._EMPTY_OUT, out.nbytes, dtypes.from_torch(out.dtype)


def _staged_to(comm: Communicator, dst: int) -> bool:
    """A device chunk to dst goes through a host copy: the pair has no device route."""
    return comm._device_routes[dst] is None


def _no_device_transport(comm: Communicator) -> bool:
    """No GPU transport on this rank (the core reports no device ordinal): the
    whole collective runs on host copies. With one, the self chunk is a device
    copy whatever the routes (nvlink, or rdma-gpu alone)."""
    return comm._cuda_device is None


# ---------------------------------------------------------------------------
# the work object


class _Pending:
    """A pending all-to-all's completion: its finish, run once by whoever
    comes first (its Work's wait or is_completed, a later call finishing the
    earlier ones, or the communicator's drainer once some Work was dropped);
    the others wait on its lock, then read the result or error."""

    __slots__ = ("finish", "poll", "keep", "lock", "done", "result", "error", "dropped", "owner")

    def __init__(self, finish: Callable[[float | None], Any], poll: Callable[[], bool] | None, keep: Any,
                 owner: _Pendings):
        self.finish: Callable[[float | None], Any] | None = finish
        self.poll = poll  # True once finish returns at once (never waits for a peer)
        self.keep = keep  # the inputs must outlive the transfer
        self.lock = threading.Lock()
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.dropped = False  # its Work is gone: the drainer finishes it
        self.owner = owner

    def complete(self, timeout: float | None) -> None:
        with self.lock:
            if self.done:
                return
            try:
                assert self.finish is not None
                self.result = self.finish(timeout)
            except Exception as e:
                self.error = e
            except BaseException as e:  # (^C: raised to whoever was finishing it; its own wait says so)
                self.error = VarcommError(f"this all-to-all was interrupted ({type(e).__name__}) while it was being "
                                          "finished; its data may be incomplete")
                raise
            finally:
                self._finished()

    def _finished(self) -> None:
        # (the closures hold the inputs and the core's handle: not for as long as the Work lives)
        self.done, self.keep, self.finish, self.poll = True, None, None, None
        self.owner.forget(self)

    def ready(self) -> bool:
        """Finished, or finished now because its poll says finish returns at
        once; never waits for a peer, nor for a thread finishing it (False)."""
        if self.done:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.done:
                return True
            if self.poll is None:
                return False
            try:
                if not self.poll():
                    return False
            except Exception as e:  # the call failed: its wait raises it
                self.error = e
                self._finished()
                return True
        finally:
            self.lock.release()
        self.complete(None)  # (returns at once: its poll said so)
        return True


class _Pendings:
    """A communicator's pending all-to-alls, oldest first (comm._a2a), and
    the thread that finishes them once one of their Works was dropped."""

    def __init__(self) -> None:
        self.queue: collections.deque[_Pending] = collections.deque()
        # Reentrant: a garbage collection while the drainer holds it may drop another Work on that thread.
        self.lock = threading.RLock()
        self.drainer: threading.Thread | None = None

    def forget(self, p: _Pending) -> None:
        with contextlib.suppress(ValueError):
            self.queue.remove(p)

    def drop(self, p: _Pending) -> None:
        """p's Work was dropped unfinished: it finishes anyway (every pair's
        message must be consumed), on the drainer, never on the line that
        dropped it: there it would block until every peer joined the call, a
        deadlock (to the timeout) where this rank's next step is what a peer
        waits for before it joins. One thread for all, in order: one thread
        each (300 dropped calls, 1 slot) woke in turn and took 30 s."""
        p.dropped = True
        with self.lock:
            if self.drainer is None or not self.drainer.is_alive():
                t = threading.Thread(target=self._drain, daemon=True, name="varcomm-dropped-all-to-alls")
                t.start()  # (RuntimeError at shutdown: the caller finishes p itself)
                self.drainer = t

    def _drain(self) -> None:
        while True:
            with self.lock:
                todo = [p for p in list(self.queue) if p.dropped and not p.done]  # (list(): one C call)
                if not todo:
                    self.drainer = None
                    return
            for p in todo:
                if p.done:
                    continue
                # Every earlier call first (held ones too: each keeps its result for its own wait), as any
                # later call finishes them: p's messages may queue behind theirs.
                _finish_older(self, p, None, "drain")
                p.complete(None)  # (its error: nobody holds the Work to be told; the messages are consumed)

    def join(self, timeout: float) -> None:
        """Until the drainer ended (close(): at exit a thread still in the core when the interpreter
        finalizes is ended by it, through C++ frames, which aborts the process)."""
        t = self.drainer
        if t is not None and t is not threading.current_thread():
            t.join(timeout)


_PENDINGS_LOCK = threading.Lock()


def _pendings(comm: Communicator) -> _Pendings:
    q = comm._a2a
    if q is None:
        with _PENDINGS_LOCK:
            if comm._a2a is None:
                comm._a2a = _Pendings()
            q = comm._a2a
    return cast(_Pendings, q)


class AllToAllWork:
    """A pending all-to-all (a varcomm.Work). ``wait()`` finishes it and returns
    its result (the same value the blocking call returns).

    The pending all-to-alls of a communicator finish in the order they were
    made: waiting on a later one (or making a blocking one) first finishes
    the earlier ones, whose wait() then returns their result at once. Each
    holds one slot per peer until it finishes, so a later one's messages can
    be queued behind them (more than `slots` pending hung to the timeout
    when waited newest first). A wait(timeout) that runs out while earlier
    ones are unfinished raises TimeoutError and leaves them, and this one,
    pending."""

    def __init__(self, comm: Communicator, finish: Callable[[float | None], Any], keep: Any = None,
                 dev: _Dev | None = None, poll: Callable[[], bool] | None = None):
        self._q = _pendings(comm)
        self._p = _Pending(finish, poll, keep, self._q)
        self._dev = dev  # device memory: the stream its copies are ordered on
        self._q.queue.append(self._p)

    def wait(self, timeout: float | None = None) -> Any:
        _check_timeout(timeout)  # before the collective is taken: a NaN leaves it pending
        p = self._p
        if not p.done:
            remaining = _finish_older(self._q, p, timeout, "wait")
            p.complete(remaining)
        if p.error is not None:
            raise p.error
        return p.result

    def _then(self, fn: Callable[[Any], Any]) -> AllToAllWork:
        """Run fn(result) as part of finishing (its value becomes the result),
        so a Work dropped unwaited still runs it (the torch backend's copy of
        a non-contiguous output out of its contiguous stand-in)."""
        p = self._p
        with p.lock:
            f = p.finish
            if f is not None:
                p.finish = lambda t: fn(f(t))
            elif p.error is None:  # (finished already, by another thread's call: fn still runs, once)
                p.result = fn(p.result)
        return self

    def is_completed(self) -> bool:
        """True once every pair's data is in (the call is then finished here:
        wait() returns at once); never waits for a peer."""
        p = self._p
        if p.done:
            return True
        # Earlier ones that are ready finish first (in order): they may hold the slots this one's data needs.
        for q in list(self._q.queue):
            if q is p or not q.ready():
                break
        return p.ready()

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(), then (device memory) block the host until the copies on the stream ran."""
        r = self.wait(timeout)
        if self._dev is not None:
            self._dev.mem.synchronize(self._dev.stream)
        return r

    def result(self) -> Any:
        return self.wait()

    def __del__(self) -> None:
        p = getattr(self, "_p", None)
        if p is None or p.done:
            return
        # On the drainer; here, with every earlier call, for device memory (its stream order is this
        # line's), or once the interpreter finalizes (a Work still referenced at exit: a thread started
        # then never runs, and start() waits for it forever; the communicator is closed by then, so
        # wait() ends at once).
        if self._dev is None and not sys.is_finalizing():
            try:
                self._q.drop(p)
                return
            except RuntimeError:
                pass  # no new threads
        try:
            self.wait()
        except Exception:
            pass


def _finish_older(q: _Pendings, upto: _Pending | None, timeout: float | None, what: str) -> float | None:
    """Finish the pending all-to-alls made before `upto` (None: all), oldest
    first; each keeps its result or error for its own wait(). Returns the
    time left of `timeout` (None: none was given). With a timeout, an earlier
    one is waited for without being cancelled (polled: it is another call's),
    and running out raises TimeoutError, leaving the earlier ones pending."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.0
    while True:
        try:
            p = q.queue[0]
        except IndexError:
            break
        if p is upto or (upto is not None and upto.done):  # (done meanwhile, on another thread: no longer queued)
            break
        if deadline is None:
            p.complete(None)
        else:
            while not p.ready():
                if time.monotonic() > deadline:
                    this = "this call was taken back" if what == "call" else "this one stays pending too"
                    raise _Timeout(f"all-to-all {what} timed out after {timeout:.3g} s: an earlier all-to-all of "
                                   f"this communicator, which this one finishes after, has not finished; it stays "
                                   f"pending, and {this} (wait it, or give a longer timeout)")
                time.sleep(pause)
                pause = min(pause * 2 or 1e-5, 1e-3)
        q.forget(p)  # (finished: normally gone already)
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)


def _done(comm: Communicator, finish: Callable[[float | None], R], async_op: bool, timeout: float | None,
          keep: object, dev: _Dev | None = None, poll: Callable[[], bool] | None = None) -> R | Work:
    if async_op:
        return AllToAllWork(comm, finish, keep, dev, poll)
    if comm._a2a is None or not comm._a2a.queue:
        return finish(timeout)
    try:  # (earlier ones hold slots this call's messages may need)
        remaining = _finish_older(comm._a2a, None, timeout, "call")
    except BaseException as e:
        try:
            r = finish(1e-3)  # this call was posted: it is taken back (or, with its data all in, done)
        except Exception:
            raise e from None
        if isinstance(e, _Timeout):
            return r
        raise
    return finish(remaining)


# ---------------------------------------------------------------------------
# all_to_all_v

_Tensor = arrays.torch.Tensor if arrays.torch is not None else type(None)


@overload
def all_to_all_v(comm: Communicator, x: Array, send_splits: Splits, *, tag: int | None = None,
                 out: Array | None = None, async_op: Literal[False] = False, timeout: float | None = None
                 ) -> tuple[Array, list[int]]: ...
@overload
def all_to_all_v(comm: Communicator, x: Array, send_splits: Splits, *, tag: int | None = None,
                 out: Array | None = None, async_op: Literal[True], timeout: float | None = None) -> Work: ...
@overload
def all_to_all_v(comm: Communicator, x: Array, send_splits: Splits, *, tag: int | None = None,
                 out: Array | None = None, async_op: bool = False, timeout: float | None = None
                 ) -> tuple[Array, list[int]] | Work: ...
@_in_step
def all_to_all_v(comm: Communicator, x: Array, send_splits: Splits, *, tag: int | None = None,
                 out: Array | None = None, async_op: bool = False, timeout: float | None = None
                 ) -> tuple[Array, list[int]] | Work:
    """Send rows ``x[off[d] : off[d] + send_splits[d]]`` to rank d; returns
    ``(received, recv_splits)``: the chunks from every source concatenated
    along dim 0 in source-rank order (a new array of x's kind, or a view of
    ``out``), and their row counts (a list of ints).

    No counts are exchanged: each chunk's shape travels in its message header.

    x: torch tensor or numpy array, >= 1-d; every rank passes the same dtype
       and trailing shape.
    send_splits: list of ints or a CPU tensor, one per rank, summing to x.shape[0].
    out: optional bound-sized buffer of x's dtype, 1-d or with x's row shape;
       the chunks are received straight into its front and a view with the
       received shape is returned.
    tag: optional int in [0, 2**20): a sub-space of the reserved collective
       tags (every rank must pass the same).
    async_op: return an AllToAllWork whose wait() returns the same tuple.
    timeout: seconds for the whole collective (default: the communicator's).

    Errors (raised after every pair's message was consumed, so the
    communicator stays usable): a GPU chunk over its receiver's bound (host
    chunks over it go by rendezvous) raises MessageTooLarge on every rank,
    naming the sender; a dtype or trailing-shape mismatch raises MessageMismatch naming
    the source rank; more rows than ``out`` holds raises MessageTooLarge.
    A call one rank refuses before it starts (InvalidArgument: bad splits)
    raises MessageMismatch naming it on the others, and the next call pairs up
    right; every rank must make the same collective calls in the same order
    (one that a rank skips leaves the ranks out of step).

    With async_op, x (and out) must not change until wait() returns: large
    chunks are read out of x by their receivers then.

    Differentiable: with x a torch tensor requiring grad (blocking, no out=),
    the result carries the graph and its gradient goes back to the senders by
    the reverse all_to_all_v; every rank must then run backward through it.

    send_splits on the GPU (a CUDA int tensor, or a __cuda_array_interface__
    array): the device-split form, alltoall_device.all_to_all_vdev. Nothing
    is read on the host; it returns ``(out, out_splits_offsets)``, a
    bound-sized out and the rows and offsets per source as a device tensor;
    differentiable too (without out= and async_op).
    """
    if alltoall_device.is_device_splits(send_splits):
        return alltoall_device.all_to_all_vdev(comm, x, send_splits, out=out, timeout=timeout,  # type: ignore[no-any-return]
                                               async_op=async_op)
    if isinstance(x, _Tensor) and x.requires_grad and x.dim() and arrays.torch.is_grad_enabled():
        if async_op or out is not None:
            # The result would not carry the graph: x's gradient silently stopped here.
            raise InvalidArgument("all_to_all_v: x requires grad, and the result is differentiable only from the "
                                  "blocking form without out= (async_op=False, out=None); pass x.detach() to send "
                                  "it without a gradient")
        from . import a2a_autograd

        return a2a_autograd.all_to_all_v(comm, x, _splits(send_splits, comm.world_size, int(x.shape[0]),
                                                          "send_splits"), tag, timeout)
    _check_timeout(timeout)
    if tag is not None and (not isinstance(tag, (int, np.integer)) or isinstance(tag, bool)):
        raise InvalidArgument(f"tag {tag!r} out of range [0, {MAX_COLL_TAG}] for a collective")
    dev = _device(comm, [x], [out], "all_to_all_v")
    if dev is not None:
        return cast("tuple[Array, list[int]] | Work",
                    _v_device(comm, dev, x, send_splits, int(tag or 0), out, async_op, timeout))
    n = comm.world_size
    if (type(x) is _Tensor and x.is_cpu and x.is_contiguous() and x.dim() and not (x.is_conj() or x.is_neg())
            and (x.data_ptr() >= arrays.NO_MEMORY_BELOW or not x.numel()) and not x.is_nested):
        # (a zero tensor has no memory: host_array materializes it; a nested one: host_array names it)
        # the common case, without the general checks' overhead
        shape = x.shape
        rows, trailing = shape[0], tuple(shape[1:])
        word = dtypes.from_torch(x.dtype)
        rb = x.element_size() * _prod(trailing)
        ptr = x.data_ptr()
    else:
        x = arrays.host_array(x, "x")
        rows, trailing, rb, ptr, word = _rows_of(x, "x")
    if (type(send_splits) is list and len(send_splits) == n and all(type(v) is int and v >= 0 for v in send_splits)
            and sum(send_splits) == rows):
        splits = send_splits
    else:
        splits = _splits(send_splits, n, rows, "send_splits")
    optr = cap = 0
    if out is not None:
        _check_out(out, "out")
        optr, cap, oword = arrays.describe_out(out)
        if oword != word:
            raise InvalidArgument(f"out has dtype {out.dtype} but x has dtype {x.dtype}")
        _check_out_rows(out, trailing)
    made: list[Any] = []  # in keep too: a copy still streaming into it after an error keeps it alive
    h = _rows(comm, _V, int(tag or 0), ptr, rb, splits, word, trailing, optr, cap, (x, out, made))

    def alloc(total: int) -> int:
        a, ptr = _host_out(comm, "torch" if arrays.is_torch(x) else "numpy", word, (total,) + trailing)
        made.append(a)
        return ptr

    def finish(t: float | None) -> tuple[Array, list[int]]:
        recv = _run(comm, h, t, alloc if out is None else None)
        if out is None:
            return made[0], recv
        total = sum(recv)
        return arrays.prefix_view(out, total * rb, (total,) + trailing), recv

    return _done(comm, finish, async_op, timeout, (x, out), poll=lambda: h.poll(alloc if out is None else None))


def _v_device(comm: Communicator, dev: _Dev, x: Any, send_splits: Splits, tag: int, out: Any, async_op: bool,
              timeout: float | None) -> Any:
    """all_to_all_v of device memory (x and out on dev.place)."""
    x = _dense(dev, x, "x")
    if x.dim() == 0:
        raise InvalidArgument("x must have at least one dimension (rows are split along dim 0)")
    rows, trailing = int(x.shape[0]), tuple(int(s) for s in x.shape[1:])
    word, rb = dtypes.from_torch(x.dtype), x.element_size() * _prod(trailing)
    splits = _splits(send_splits, comm.world_size, rows, "send_splits")
    optr = cap = 0
    if out is not None:
        optr, cap, oword = _dev_out(dev, out, "out")
        if oword != word:
            raise InvalidArgument(f"out has dtype {out.dtype} but x has dtype {x.dtype}")
        _check_out_rows(out, trailing)
    mem, place = dev.mem, dev.place
    if _no_device_transport(comm):
        bounce = None if out is None else arrays.torch.empty(tuple(out.shape), dtype=out.dtype)
        work = all_to_all_v(comm, mem.to_host(x), splits, tag=tag, out=bounce, async_op=True, timeout=timeout)

        def staged(t: float | None) -> tuple[Array, list[int]]:
            got, recv = work.wait(t)
            if out is None:
                return mem.to(got, place), recv
            view = arrays.prefix_view(out, got.nbytes, tuple(got.shape))
            view.copy_(got)  # host to device
            return view, recv

        return _done(comm, staged, async_op, timeout, (x, out), dev, poll=work.is_completed)
    me = comm.rank
    host = mem.to_host(x) if any(splits[d] and _staged_to(comm, d) for d in range(len(splits)) if d != me) else None
    mem.record(x, dev.stream)
    keep = (x, out, host)
    h = _rows(comm, _V, tag, x.data_ptr(), rb, splits, word, trailing, optr, cap, keep,
              stream=dev.handle, x_host=0 if host is None else host.data_ptr())
    made: list[Any] = []

    def alloc(total: int) -> int:
        a = mem.empty((total,) + trailing, x.dtype, place)
        mem.record(a, dev.stream)
        made.append(a)
        return int(a.data_ptr())

    def finish(t: float | None) -> tuple[Array, list[int]]:
        recv = _run(comm, h, t, alloc if out is None else None)
        mem.wait(dev.stream, place)
        if out is None:
            return made[0], recv
        total = sum(recv)
        return arrays.prefix_view(out, total * rb, (total,) + trailing), recv

    return _done(comm, finish, async_op, timeout, keep, dev, poll=lambda: h.poll(alloc if out is None else None))


# ---------------------------------------------------------------------------
# torch-compatible forms


@overload
def all_to_all_single(comm: Communicator, output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None, *,
                      async_op: Literal[False] = False, timeout: float | None = None) -> None: ...
@overload
def all_to_all_single(comm: Communicator, output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None, *,
                      async_op: Literal[True], timeout: float | None = None) -> Work: ...
@overload
def all_to_all_single(comm: Communicator, output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None, *,
                      async_op: bool = False, timeout: float | None = None) -> Work | None: ...
@_in_step
def all_to_all_single(comm: Communicator, output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None, *,
                      async_op: bool = False, timeout: float | None = None) -> Work | None:
    """torch.distributed.all_to_all_single: rows of ``input`` go out by
    ``input_split_sizes`` (default: equal), rows from source s land in
    ``output`` at the offsets given by ``output_split_sizes`` (default:
    equal); each chunk is received straight into its slice of ``output``.
    Returns None (a work when ``async_op``), like torch. Each message's header
    is checked against ``output_split_sizes``: a disagreement raises
    MessageMismatch naming the source rank (nothing is written)."""
    _check_timeout(timeout)
    _check_out(output, "output")
    dev = _device(comm, [input], [output], "all_to_all_single")
    if dev is not None:
        return _single_device(comm, dev, output, input, output_split_sizes, input_split_sizes, async_op, timeout)
    inp = arrays.host_array(input, "input")
    rows, trailing, rb, ptr, word = _rows_of(inp, "input")
    if not (output.is_contiguous() if arrays.is_torch(output) else output.flags.c_contiguous):
        raise InvalidArgument("output must be contiguous: chunks are received straight into it")
    if len(output.shape) == 0:
        raise InvalidArgument("output must have at least one dimension (rows are split along dim 0)")
    orows, otrail = int(output.shape[0]), tuple(int(s) for s in output.shape[1:])
    optr, cap, oword = arrays.describe_out(output)
    _agree(output, inp, oword != word or otrail != trailing, otrail, trailing)
    n = comm.world_size
    in_splits = _splits(input_split_sizes, n, rows, "input_split_sizes")
    out_splits = _splits(output_split_sizes, n, orows, "output_split_sizes")
    h = _rows(comm, _SINGLE, 0, ptr, rb, in_splits, word, trailing, optr, cap, (inp, output), out_splits)

    def finish(t: float | None) -> None:
        _run(comm, h, t)
        return None

    return _done(comm, finish, async_op, timeout, (inp, output), poll=h.poll)


def _single_device(comm: Communicator, dev: _Dev, output: Any, input: Any, output_split_sizes: Splits | None,
                   input_split_sizes: Splits | None, async_op: bool, timeout: float | None) -> Work | None:
    """all_to_all_single of device memory (input and output on dev.place)."""
    inp = _dense(dev, input, "input")
    if inp.dim() == 0 or output.dim() == 0:
        raise InvalidArgument("input and output must have at least one dimension (rows are split along dim 0)")
    rows, trailing = int(inp.shape[0]), tuple(int(s) for s in inp.shape[1:])
    word, rb = dtypes.from_torch(inp.dtype), inp.element_size() * _prod(trailing)
    optr, cap, oword = _dev_out(dev, output, "output")
    orows, otrail = int(output.shape[0]), tuple(int(s) for s in output.shape[1:])
    _agree(output, inp, oword != word or otrail != trailing, otrail, trailing)
    n = comm.world_size
    in_splits = _splits(input_split_sizes, n, rows, "input_split_sizes")
    out_splits = _splits(output_split_sizes, n, orows, "output_split_sizes")
    mem, place = dev.mem, dev.place
    if _no_device_transport(comm):
        bounce = arrays.torch.empty(tuple(output.shape), dtype=output.dtype)
        work = all_to_all_single(comm, bounce, mem.to_host(inp), out_splits, in_splits, async_op=True,
                                 timeout=timeout)

        def staged(t: float | None) -> None:
            work.wait(t)
            output.copy_(bounce)  # host to device

        return _done(comm, staged, async_op, timeout, (inp, output), dev, poll=work.is_completed)
    me = comm.rank
    host = mem.to_host(inp) if any(in_splits[d] and _staged_to(comm, d) for d in range(n) if d != me) else None
    mem.record(inp, dev.stream)
    keep = (inp, output, host)
    h = _rows(comm, _SINGLE, 0, inp.data_ptr(), rb, in_splits, word, trailing, optr, cap, keep, out_splits,
              stream=dev.handle, x_host=0 if host is None else host.data_ptr())

    def finish(t: float | None) -> None:
        _run(comm, h, t)
        mem.wait(dev.stream, place)

    return _done(comm, finish, async_op, timeout, keep, dev, poll=h.poll)


@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: Literal[False] = False, timeout: float | None = None) -> list[Array]: ...
@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: Literal[True], timeout: float | None = None) -> Work: ...
@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: bool = False, timeout: float | None = None) -> list[Array] | Work: ...
@_in_step
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: bool = False, timeout: float | None = None) -> list[Array] | Work:
    """torch.distributed.all_to_all: ``input_tensor_list[d]`` goes to rank d,
    and what rank s sent lands in ``output_tensor_list[s]``. Tensors may have
    any shape (0-d included) and dtype. Beyond torch: ``output_tensor_list``
    may be None or hold None entries, which are allocated from the arriving
    headers; the filled list is returned (by ``wait()`` when ``async_op``).
    A given output must match the arriving dtype and shape exactly, else
    MessageMismatch naming the source rank."""
    _check_timeout(timeout)
    n, r = comm.world_size, comm.rank
    if len(input_tensor_list) != n:
        raise InvalidArgument(f"input_tensor_list has {len(input_tensor_list)} entries; the world has {n} ranks")
    if output_tensor_list is not None and len(output_tensor_list) != n:
        raise InvalidArgument(f"output_tensor_list has {len(output_tensor_list)} entries; the world has {n} ranks")
    dev = _device(comm, input_tensor_list, output_tensor_list or [], "all_to_all")
    if dev is not None:
        return _list_device(comm, dev, output_tensor_list, input_tensor_list, async_op, timeout)
    msgs = [arrays.host_array(t, f"input_tensor_list[{d}]") for d, t in enumerate(input_tensor_list)]
    outs: list[Array | None] = output_tensor_list if output_tensor_list is not None else [None] * n
    sends = []
    for m in msgs:
        ptr, nbytes, word, shape, _keep = arrays.describe_host(m)
        sends.append((ptr, nbytes, word, tuple(shape)))
    given: list[tuple[int, int, int, tuple[int, ...]] | None] = [None] * n
    for s, o in enumerate(outs):
        if o is None:
            continue
        if not (arrays.is_torch(o) or isinstance(o, np.ndarray)):
            raise InvalidArgument(f"output_tensor_list[{s}] must be a tensor, an array or None")
        if not (o.is_contiguous() if arrays.is_torch(o) else o.flags.c_contiguous):
            raise InvalidArgument(f"output_tensor_list[{s}] must be contiguous")
        optr, cap, oword = arrays.describe_out(o)
        given[s] = (optr, cap, oword, tuple(o.shape))
    kind = "torch" if arrays.is_torch(msgs[r]) else "numpy"
    made: list[Array] = []  # in keep too: a copy still streaming into one after an error keeps it alive
    h = _list(comm, sends, given, (msgs, list(outs), made))

    def alloc(s: int, word: int, shape: tuple[int, ...]) -> int:
        a, ptr = _host_out(comm, kind, word, shape)
        outs[s] = a
        made.append(a)
        return ptr

    def finish(t: float | None) -> list[Array]:
        _run(comm, h, t, alloc)
        return cast("list[Array]", outs)  # every entry given or allocated now

    return _done(comm, finish, async_op, timeout, (msgs, outs), poll=lambda: h.poll(alloc))


def _list_device(comm: Communicator, dev: _Dev, output_tensor_list: list[Array | None] | None,
                 input_tensor_list: Sequence[Array], async_op: bool, timeout: float | None) -> list[Array] | Work:
    """all_to_all of device memory (every tensor on dev.place); None outputs are
    allocated there."""
    n, r = comm.world_size, comm.rank
    mem, place = dev.mem, dev.place
    msgs = [_dense(dev, t, f"input_tensor_list[{d}]") for d, t in enumerate(input_tensor_list)]
    outs: list[Array | None] = output_tensor_list if output_tensor_list is not None else [None] * n
    if _no_device_transport(comm):
        bounces: list[Array | None] = [None if o is None else arrays.torch.empty(tuple(o.shape), dtype=o.dtype)
                                       for o in outs]
        work = all_to_all(comm, bounces, [mem.to_host(m) for m in msgs], async_op=True, timeout=timeout)

        def staged(t: float | None) -> list[Array]:
            got = work.wait(t)
            for s, g in enumerate(got):
                o = outs[s]
                if o is None:
                    outs[s] = mem.to(g, place)
                else:
                    cast("torch.Tensor", o).copy_(g)  # host to device
            return cast("list[Array]", outs)

        return _done(comm, staged, async_op, timeout, (msgs, outs), dev, poll=work.is_completed)
    handle = dev.handle
    sends: list[tuple[Any, ...]] = []
    hosts: list[Any] = []
    for d, m in enumerate(msgs):
        host = mem.to_host(m) if d != r and m.nbytes and _staged_to(comm, d) else None
        hosts.append(host)
        mem.record(m, dev.stream)
        sends.append((m.data_ptr(), m.nbytes, dtypes.from_torch(m.dtype), tuple(m.shape), handle,
                      0 if host is None else host.data_ptr()))
    given: list[tuple[Any, ...] | None] = [None] * n
    for s, o in enumerate(outs):
        if o is not None:
            optr, cap, oword = _dev_out(dev, o, f"output_tensor_list[{s}]")
            given[s] = (optr, cap, oword, tuple(o.shape), handle)
    keep = (msgs, hosts, list(outs))
    h = _list(comm, sends, given, keep, handle)

    def alloc(s: int, word: int, shape: tuple[int, ...]) -> int:
        a = mem.empty(shape, dtypes.to_torch(word), place)
        mem.record(a, dev.stream)
        outs[s] = a
        return int(a.data_ptr())

    def finish(t: float | None) -> list[Array]:
        _run(comm, h, t, alloc)
        mem.wait(dev.stream, place)
        return cast("list[Array]", outs)

    return _done(comm, finish, async_op, timeout, keep, dev, poll=lambda: h.poll(alloc))
