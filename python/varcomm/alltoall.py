"""Variable-size all-to-all without a count exchange.

Every chunk travels as one varcomm message whose header carries its shape and
dtype, so a receiver learns each source's row count from the message itself:
no count all-to-all, no device-to-host sync before the payload is posted.

Per collective, every ordered pair of distinct ranks exchanges exactly one
message on a reserved tag (``COLL_TAG_BASE`` and up, with a per-communicator
sequence number), so collectives never match user point-to-point traffic or
each other. A chunk over its receiver's bound is replaced by an *error marker*
(a 0-d message of a dtype code no array has), so the receiver raises instead of
hanging; and because every pair still exchanged its one message, the
communicator stays usable for the next collective. A rank's chunk to itself is
a local copy.

Where any peer is reached only through the fallback (torch.distributed), the
conventional two-phase algorithm runs instead: one small metadata message per
pair (byte count, dtype, shape, the sender's bound), then the payload into
exactly-sized buffers. Same API, same results and errors; it is the baseline.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Sequence

import numpy as np

from . import arrays, dtypes
from .errors import InvalidArgument, MessageMismatch, MessageTooLarge, VarcommError

#: Collective tags are >= this; user point-to-point tags should stay below it.
COLL_TAG_BASE = 1 << 40
#: Largest user `tag` a collective accepts (it selects a sub-space of the reserved tags).
MAX_COLL_TAG = (1 << 20) - 1

# The error marker: 0-d with a dtype word no array has (varcomm's opaque code, 0 bits).
MARKER_WORD = dtypes.word(dtypes.OPAQUE, 0, 0)
_MARKER = np.array(1, dtype=np.int64)  # payload: reason code 1 = over the receiver's bound
_MARKER_PTR = _MARKER.ctypes.data
_I64 = dtypes.from_numpy(np.dtype(np.int64))

__all__ = ["all_to_all_v", "all_to_all_single", "all_to_all", "AllToAllWork", "COLL_TAG_BASE", "MARKER_WORD"]

# ---------------------------------------------------------------------------
# helpers


def _next_seq(comm: Any) -> int:
    n = getattr(comm, "_coll_seq", 0)
    comm._coll_seq = n + 1
    return n


def _native_tag(seq: int, user_tag: int | None) -> int:
    return _tags(seq, user_tag)[0]


def _tags(seq: int, user_tag: int | None) -> tuple[int, int]:
    """The two reserved tags of collective number `seq`: (one-phase message or
    two-phase metadata, two-phase payload)."""
    base = COLL_TAG_BASE * (1 + int(user_tag or 0)) + 2 * (seq % (COLL_TAG_BASE // 2))
    return base, base + 1


def _check_tag(tag: int | None) -> None:
    if tag is not None and not (isinstance(tag, (int, np.integer)) and 0 <= tag <= MAX_COLL_TAG):
        raise InvalidArgument(f"tag {tag!r} out of range [0, {MAX_COLL_TAG}] for a collective")


def _uses_fallback(comm: Any) -> bool:
    """Whether to run the conventional two-phase algorithm (counts, then payload).
    Option a2a_algorithm: "auto" runs one phase (no count exchange) unless a
    peer is on the fallback; "two-phase" forces the latter on every transport
    (for comparison: it isolates what the count exchange costs)."""
    if comm.options.a2a_algorithm == "two-phase":
        return True
    routes = getattr(comm, "_routes", None)
    if routes is None:
        return any(comm.transport_for(p) == "fallback" for p in range(comm.world_size))
    return "fallback" in routes


def _prod(s: Sequence[int]) -> int:
    p = 1
    for v in s:
        p *= int(v)
    return p


_TorchTensor = arrays.torch.Tensor if arrays.torch is not None else type(None)
_TORCH_DTYPES: dict[Any, tuple[int, int]] = {}


def _torch_dtype_info(dt: Any) -> tuple[int, int]:
    """(dtype word, item size) of a torch dtype, cached."""
    info = _TORCH_DTYPES.get(dt)
    if info is None:
        info = _TORCH_DTYPES[dt] = (dtypes.from_torch(dt), arrays.torch.empty((), dtype=dt).element_size())
    return info


def _word_of(a: Any) -> int:
    return dtypes.from_torch(a.dtype) if arrays.is_torch(a) else dtypes.from_numpy(a.dtype)


def _ptr_of(a: Any) -> int:
    return a.data_ptr() if arrays.is_torch(a) else a.ctypes.data


def _nbytes(a: Any) -> int:
    return a.nbytes


def _contiguous(a: Any) -> bool:
    return a.is_contiguous() if arrays.is_torch(a) else bool(a.flags.c_contiguous)


def _dtype_name(word: int) -> str:
    if word == MARKER_WORD:
        return "error-marker"
    try:
        return str(dtypes.to_torch(word)).replace("torch.", "")
    except Exception:
        try:
            return str(dtypes.to_numpy(word))
        except Exception:
            return f"dtype code {word:#x}"


def _memmove(dst: int, src: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def _host(x: Any, what: str) -> Any:
    """A contiguous CPU torch tensor or numpy array (copied if strided)."""
    if arrays.is_torch(x):
        if x.device.type != "cpu":
            raise InvalidArgument(f"{what} on {x.device}: this build has no GPU transport")
        return x if x.is_contiguous() else x.contiguous()
    if isinstance(x, np.ndarray):
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    raise InvalidArgument(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(x).__name__}")


def _rows_of(x: Any, what: str) -> tuple[int, tuple[int, ...], int]:
    """(rows, trailing shape, bytes per row) of a >= 1-d array."""
    if len(x.shape) == 0:
        raise InvalidArgument(f"{what} must have at least one dimension (rows are split along dim 0)")
    trailing = tuple(int(s) for s in x.shape[1:])
    isz = x.element_size() if arrays.is_torch(x) else x.itemsize
    return int(x.shape[0]), trailing, isz * _prod(trailing)


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
        out = [int(s) for s in splits]
    except TypeError as e:
        raise InvalidArgument(f"{what} must be a sequence of {n} ints") from e
    if len(out) != n:
        raise InvalidArgument(f"{what} has {len(out)} entries; the world has {n} ranks")
    if any(s < 0 for s in out):
        raise InvalidArgument(f"{what} has a negative entry: {out}")
    if total is not None and sum(out) != total:
        raise InvalidArgument(f"{what} sums to {sum(out)} but dim 0 has {total} rows")
    return out


def _view_prefix(out: Any, nbytes: int, shape: tuple[int, ...]) -> Any:
    if tuple(out.shape) == shape:
        return out
    isz = out.element_size() if arrays.is_torch(out) else out.itemsize
    return out.reshape(-1)[: nbytes // max(isz, 1)].reshape(shape)


# ---------------------------------------------------------------------------
# the work object


class AllToAllWork:
    """A pending all-to-all. ``wait()`` finishes it and returns its result
    (the same value the blocking call returns)."""

    def __init__(self, finish: Callable[[float | None], Any], keep: Any = None):
        self._finish: Callable[[float | None], Any] | None = finish
        self._keep = keep  # the inputs must outlive the transfer
        self._result: Any = None
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> Any:
        if self._finish is not None:
            f, self._finish = self._finish, None
            try:
                self._result = f(timeout)
            except BaseException as e:
                self._error = e
            finally:
                self._keep = None
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._finish is None

    def result(self) -> Any:
        return self.wait()

    def __del__(self) -> None:
        # Dropped without wait(): finish anyway so every pair's message is consumed.
        if self._finish is not None:
            try:
                self.wait()
            except Exception:
                pass


# ---------------------------------------------------------------------------
# the generic exchange: one message per ordered pair
#
# An operation supplies, per destination d, the message for d (an array; for
# d == rank it is copied locally), and a `plan` that, once every source's
# (nbytes, dtype word, shape) is known, picks where each source's message
# lands (an array of exactly that many bytes, or None to drop it) and notes
# problems. Errors are raised only after every pair's message was consumed.


class _Errors:
    def __init__(self, op: str, comm: Any):
        self.op = op
        self.comm = comm
        self.too_large: list[tuple[int, str]] = []  # (dst, why): this rank's own chunk does not fit dst
        self.markers: list[int] = []  # sources that could not send to this rank
        self.problems: list[str] = []  # mismatches, named by source
        self.overflow = ""  # the received rows do not fit the caller's `out`

    def raise_any(self) -> None:
        r, op = self.comm.rank, self.op
        if self.too_large:
            d, why = self.too_large[0]
            msg = f"{op}: rank {r}'s chunk for rank {d} does not fit: {why}"
            if len(self.too_large) > 1:
                msg += f" (nor do its chunks for ranks {[x for x, _ in self.too_large[1:]]})"
            msg += "; the other ranks were told, and the communicator stays usable"
            err: VarcommError = MessageTooLarge(msg)
            err.peer = d
            raise err
        if self.problems:
            raise MessageMismatch(f"{op} on rank {r}: " + "; ".join(self.problems))
        if self.markers:
            s = self.markers[0]
            err = VarcommError(
                f"{op}: rank {s} could not send its chunk to rank {r}: it is over rank {r}'s receive bound of "
                f"{self.comm.bound} bytes, and rank {s} raised MessageTooLarge"
                + (f" (so did ranks {self.markers[1:]})" if len(self.markers) > 1 else "")
                + "; the communicator stays usable")
            err.peer = s
            raise err
        if self.overflow:
            raise MessageTooLarge(f"{op} on rank {r}: {self.overflow}")


Plan = Callable[[list[Any], _Errors], list[Any]]


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _deadline(comm: Any, timeout: float | None) -> float | None:
    t = comm._timeout if timeout is None else timeout
    return None if t is None else time.monotonic() + t


def _exchange(comm: Any, op: str, msgs: list[Any], plan: Plan, seq: int,
              user_tag: int | None = None) -> Callable[[float | None], Any]:
    """Post the collective; returns finish(timeout) -> (dsts, metas)."""
    if _uses_fallback(comm):
        return _exchange_fallback(comm, op, msgs, plan, seq, user_tag)
    return _exchange_native(comm, op, msgs, plan, _native_tag(seq, user_tag))


def _cleanup(c: Any, ids: list[int]) -> None:
    for i in ids:
        if i:
            try:
                c.cancel(i)
            except Exception:
                pass
            try:
                c.detach(i)
            except Exception:
                pass


def _exchange_native(comm: Any, op: str, msgs: list[Any], plan: Plan, tag: int) -> Callable[[float | None], Any]:
    c = comm._c
    n, r = comm.world_size, comm.rank
    errs = _Errors(op, comm)
    recv_ids = [0] * n
    send_ids: list[int] = []
    try:
        for k in range(1, n):  # receives first, so early senders find them posted
            s = (r - k) % n
            recv_ids[s] = c.irecv(s, tag, 0, 0, 0)
        for k in range(1, n):  # staggered destinations spread the load over receivers
            d = (r + k) % n
            m = msgs[d]
            try:
                sid = c.isend(d, tag, _ptr_of(m), _nbytes(m), _word_of(m), tuple(m.shape))
            except MessageTooLarge as e:
                errs.too_large.append((d, str(e)))
                sid = c.isend(d, tag, _MARKER_PTR, 8, MARKER_WORD, ())
            send_ids.append(sid)
    except BaseException:
        _cleanup(c, send_ids + recv_ids)
        raise

    def finish(timeout: float | None) -> Any:
        deadline = _deadline(comm, timeout)
        try:
            metas: list[Any] = [None] * n
            me = msgs[r]
            metas[r] = (_nbytes(me), _word_of(me), tuple(me.shape))
            for k in range(1, n):
                s = (r - k) % n
                c.wait(recv_ids[s], _left(deadline))
                st = c.info(recv_ids[s])
                nbytes, word, shape = st.nbytes, st.dtype, st.shape
                if word == MARKER_WORD and len(shape) == 0:
                    errs.markers.append(s)
                    c.release(recv_ids[s])
                    recv_ids[s] = 0
                else:
                    metas[s] = (nbytes, word, tuple(shape))
            dsts = plan(metas, errs)
            for s in range(n):
                d = dsts[s]
                if s == r:
                    if d is not None:
                        _memmove(_ptr_of(d), _ptr_of(me), _nbytes(me))
                    continue
                if not recv_ids[s]:
                    continue
                if d is None:
                    c.release(recv_ids[s])
                else:
                    c.copy_out(recv_ids[s], _ptr_of(d))
                recv_ids[s] = 0
            for i, sid in enumerate(send_ids):
                c.wait(sid, _left(deadline))
                send_ids[i] = 0
        except BaseException:
            _cleanup(c, send_ids + recv_ids)
            raise
        errs.raise_any()
        return dsts, metas

    return finish


def _exchange_fallback(comm: Any, op: str, msgs: list[Any], plan: Plan, seq: int,
                       user_tag: int | None) -> Callable[[float | None], Any]:
    """The conventional algorithm: metadata (counts) for every pair first, then payload."""
    n, r = comm.world_size, comm.rank
    mtag, ptag = _tags(seq, user_tag)
    errs = _Errors(op, comm)
    mine = [np.array([_nbytes(m), _word_of(m), comm.bound, len(m.shape), *m.shape], dtype=np.int64) for m in msgs]
    recv_meta = {s: comm.irecv(s, mtag) for s in range(n) if s != r}
    meta_sends = [comm.isend(mine[d], d, mtag) for d in range(n) if d != r]

    def finish(timeout: float | None) -> Any:
        deadline = _deadline(comm, timeout)
        metas: list[Any] = [None] * n
        metas[r] = (_nbytes(msgs[r]), _word_of(msgs[r]), tuple(msgs[r].shape))
        peer_bound = [0] * n
        for s, w in recv_meta.items():
            got = w.wait(_left(deadline))
            m = [int(v) for v in (got.tolist() if hasattr(got, "tolist") else list(got))]
            nbytes, word, peer_bound[s], nd = m[0], m[1], m[2], m[3]
            if nbytes > comm.bound:  # the sender knows too: it will not send the payload
                errs.markers.append(s)
            else:
                metas[s] = (nbytes, word, tuple(m[4:4 + nd]))
        for w in meta_sends:
            w.wait(_left(deadline))
        dsts = plan(metas, errs)
        recvs = []
        for s in range(n):
            if s == r or metas[s] is None:
                continue
            d = dsts[s]
            # A refused message is still received (into a scratch array): its sender cannot know.
            recvs.append(comm.irecv(s, ptag, out=None if d is None or _nbytes(d) == 0 else d))
        psends = []
        for d in range(n):
            if d == r:
                continue
            if _nbytes(msgs[d]) > peer_bound[d]:
                errs.too_large.append((d, f"message of {_nbytes(msgs[d])} bytes exceeds the receive bound of "
                                          f"{peer_bound[d]} bytes on rank {d}"))
                continue
            psends.append(comm.isend(msgs[d], d, ptag))
        if dsts[r] is not None:
            _memmove(_ptr_of(dsts[r]), _ptr_of(msgs[r]), _nbytes(msgs[r]))
        for w in recvs:
            w.wait(_left(deadline))
        for w in psends:
            w.wait(_left(deadline))
        errs.raise_any()
        return dsts, metas

    return finish


# ---------------------------------------------------------------------------
# all_to_all_v


def all_to_all_v(comm: Any, x: Any, send_splits: Any, *, tag: int | None = None, out: Any = None,
                 async_op: bool = False, timeout: float | None = None) -> Any:
    """Send rows ``x[off[d] : off[d] + send_splits[d]]`` to rank d; returns
    ``(received, recv_splits)``: the chunks from every source concatenated
    along dim 0 in source-rank order (a new array of x's kind, or a view of
    ``out``), and their row counts (a list of ints).

    No counts are exchanged: each chunk's shape travels in its message header.

    x: torch tensor or numpy array, >= 1-d; every rank passes the same dtype
       and trailing shape.
    send_splits: list of ints or a CPU tensor, one per rank, summing to x.shape[0].
    out: optional bound-sized buffer of x's dtype; the chunks are received
       straight into its prefix and a view with the received shape is returned.
    tag: optional int in [0, 2**20): a sub-space of the reserved collective
       tags (every rank must pass the same).
    async_op: return an AllToAllWork whose wait() returns the same tuple.
    timeout: seconds for the whole collective (default: the communicator's).

    Errors (raised after every pair's message was consumed, so the
    communicator stays usable): a chunk over its receiver's bound raises
    MessageTooLarge on the sender and VarcommError naming the sender on the
    receiver; a dtype or trailing-shape mismatch raises MessageMismatch naming
    the source rank; more rows than ``out`` holds raises MessageTooLarge.
    """
    if tag is not None:
        _check_tag(tag)
    n = comm.world_size
    if type(x) is _TorchTensor and x.is_contiguous() and x.device.type == "cpu" and x.dim():
        # the common case, without the general checks' overhead
        shape = x.shape
        rows, trailing = shape[0], tuple(shape[1:])
        word, isz = _torch_dtype_info(x.dtype)
        rb = isz * _prod(trailing) if trailing else isz
    else:
        x = _host(x, "x")
        rows, trailing, rb = _rows_of(x, "x")
        word = _word_of(x)
    if (type(send_splits) is list and len(send_splits) == n and all(type(v) is int and v >= 0 for v in send_splits)
            and sum(send_splits) == rows):
        splits = send_splits
    else:
        splits = _splits(send_splits, n, rows, "send_splits")
    if out is not None:
        if not (arrays.is_torch(out) or isinstance(out, np.ndarray)):
            raise InvalidArgument(f"out must be a torch.Tensor or numpy.ndarray, not {type(out).__name__}")
        _ptr, cap, oword = arrays.describe_out(out)
        if oword != word:
            raise InvalidArgument(f"out has dtype {out.dtype} but x has dtype {x.dtype}")
    seq = _next_seq(comm)
    if comm.options.a2a_algorithm == "two-phase" and "fallback" not in comm._routes:
        finish = _v_native_two_phase(comm, x, splits, trailing, rb, word, out, _tags(seq, tag))
        if async_op:
            return AllToAllWork(finish, keep=(x, out))
        return finish(timeout)
    if not _uses_fallback(comm):
        finish = _v_native(comm, x, splits, rows, trailing, rb, word, out, _native_tag(seq, tag))
        if async_op:
            return AllToAllWork(finish, keep=(x, out))
        return finish(timeout)
    msgs = []
    off = 0
    for d in range(n):
        msgs.append(x[off:off + splits[d]])
        off += splits[d]
    r = comm.rank
    result: list[Any] = [None, None]

    def plan(metas: list[Any], errs: _Errors) -> list[Any]:
        recv = [0] * n
        ok = [False] * n
        for s, m in enumerate(metas):
            if m is None:
                continue
            nbytes, w, shape = m
            if w != word or len(shape) != len(trailing) + 1 or tuple(shape[1:]) != trailing:
                errs.problems.append(
                    f"the chunk from rank {s} is {_dtype_name(w)} of shape {tuple(shape)}, but rank {r}'s x is "
                    f"{_dtype_name(word)} with rows of shape {trailing}; every rank must pass the same dtype and "
                    "trailing shape")
                continue
            recv[s] = int(shape[0])
            ok[s] = True
        total = sum(recv[s] for s in range(n) if ok[s])
        result[1] = [recv[s] if ok[s] else 0 for s in range(n)]
        shape = (total,) + trailing
        if out is not None:
            if total * rb > cap:
                errs.overflow = (f"{total} rows ({total * rb} bytes) arrived but out holds only {cap} bytes "
                                 f"(recv_splits {result[1]}); the chunks were dropped")
                return [None] * n
            buf = _view_prefix(out, total * rb, shape)
        else:
            buf = arrays.torch.empty(shape, dtype=x.dtype) if arrays.is_torch(x) else np.empty(shape, x.dtype)
        result[0] = buf
        dsts: list[Any] = [None] * n
        o = 0
        for s in range(n):
            if ok[s]:
                dsts[s] = buf[o:o + recv[s]]
                o += recv[s]
        return dsts

    fin = _exchange_fallback(comm, "all_to_all_v", msgs, plan, seq, tag)

    def finish(t: float | None) -> Any:
        fin(t)
        return result[0], result[1]

    if async_op:
        return AllToAllWork(finish, keep=(x, msgs, out))
    return finish(timeout)


def _wait(c: Any, rid: int, deadline: float | None) -> None:
    c.wait(rid, None if deadline is None else max(deadline - time.monotonic(), 0.0))


def _v_native(comm: Any, x: Any, splits: list[int], rows: int, trailing: tuple[int, ...], rb: int, word: int,
              out: Any, tag: int, expect: list[int] | None = None,
              op: str = "all_to_all_v") -> Callable[[float | None], Any]:
    """all_to_all_v over native transports, by pointer arithmetic (no per-chunk
    array objects): post every receive, then every send; finish() learns the
    row counts from the headers, allocates once (or uses `out`) and copies
    each chunk from its slot straight to its place. With `expect` (rows per
    source, all_to_all_single's output_split_sizes) a disagreeing header is a
    MessageMismatch and nothing is written."""
    c = comm._c
    n, r = comm.world_size, comm.rank
    base = _ptr_of(x)
    offs = [0] * (n + 1)
    for d in range(n):
        offs[d + 1] = offs[d] + splits[d]
    recv_ids = [0] * n
    send_ids = [0] * n
    too_large: list[tuple[int, str]] = []
    try:
        for k in range(1, n):  # receives first, so early senders find them posted
            s = (r - k) % n
            recv_ids[s] = c.irecv(s, tag, 0, 0, 0)
        for k in range(1, n):  # staggered destinations spread the load over receivers
            d = (r + k) % n
            cnt = splits[d]
            try:
                send_ids[d] = c.isend(d, tag, base + offs[d] * rb, cnt * rb, word, (cnt,) + trailing)
            except MessageTooLarge as e:
                too_large.append((d, str(e)))
                send_ids[d] = c.isend(d, tag, _MARKER_PTR, 8, MARKER_WORD, ())
    except BaseException:
        _cleanup(c, send_ids + recv_ids)
        raise
    ndim = len(trailing) + 1

    def finish(timeout: float | None) -> Any:
        t = comm._timeout if timeout is None else timeout
        deadline = None if t is None else time.monotonic() + t
        errs = _Errors(op, comm)
        errs.too_large = too_large
        try:
            recv = [0] * n
            recv[r] = splits[r]
            for k in range(1, n):
                s = (r - k) % n
                rid = recv_ids[s]
                _wait(c, rid, deadline)
                st = c.info(rid)
                w, shape = st.dtype, st.shape
                if w == word and len(shape) == ndim and shape[1:] == trailing:
                    recv[s] = shape[0]
                    continue
                if w == MARKER_WORD and not shape:
                    errs.markers.append(s)
                else:
                    errs.problems.append(_mismatch(s, r, w, shape, word, trailing))
                c.release(rid)
                recv_ids[s] = 0
            if expect is not None:
                for s in range(n):
                    if recv[s] != expect[s] and (s == r or recv_ids[s]):
                        errs.problems.append(f"rank {s} sent {recv[s]} rows, but output_split_sizes[{s}] on rank "
                                             f"{r} is {expect[s]}")
            total = sum(recv)
            result: Any = None
            if out is not None:
                optr, cap, _w = arrays.describe_out(out)
                if errs.problems:
                    optr = 0  # write nothing
                elif total * rb > cap:
                    errs.overflow = (f"{total} rows ({total * rb} bytes) arrived but out holds only {cap} bytes "
                                     f"(recv_splits {recv}); the chunks were dropped")
                    optr = 0
            else:
                shape = (total,) + trailing
                if arrays.is_torch(x):
                    result = arrays.torch.empty(shape, dtype=x.dtype)
                    optr = result.data_ptr()
                else:
                    result = np.empty(shape, dtype=x.dtype)
                    optr = result.ctypes.data
            o = optr
            for s in range(n):
                nb = recv[s] * rb
                if s == r:
                    if optr and nb:
                        ctypes.memmove(o, base + offs[r] * rb, nb)
                elif recv_ids[s]:
                    if optr:
                        c.copy_out(recv_ids[s], o)
                    else:
                        c.release(recv_ids[s])
                    recv_ids[s] = 0
                o += nb
            for d in range(n):
                if send_ids[d]:
                    _wait(c, send_ids[d], deadline)
                    send_ids[d] = 0
        except BaseException:
            _cleanup(c, send_ids + recv_ids)
            raise
        errs.raise_any()
        if out is not None:
            result = _view_prefix(out, total * rb, (total,) + trailing)
        return result, recv

    return finish


def _v_native_two_phase(comm: Any, x: Any, splits: list[int], trailing: tuple[int, ...], rb: int, word: int,
                        out: Any, tags: tuple[int, int]) -> Callable[[float | None], Any]:
    """The conventional algorithm over native transports, written as tightly
    as the one-phase path (for a like-for-like comparison): a small metadata
    message per pair (rows, dtype, trailing shape, the sender's bound), wait
    for all of them, allocate, then post the payload receives straight into
    place and send the payloads."""
    c = comm._c
    n, r = comm.world_size, comm.rank
    mtag, ptag = tags
    base = _ptr_of(x)
    offs = [0] * (n + 1)
    for d in range(n):
        offs[d + 1] = offs[d] + splits[d]
    # fixed length (rows, dtype, bound, ndim, 8 dims), so any peer's metadata fits
    metas = [np.array([splits[d], word, comm.bound, len(trailing), *trailing] + [0] * (8 - len(trailing)),
                      dtype=np.int64) for d in range(n)]
    meta_rx = np.zeros((n, 12), dtype=np.int64)
    mlen = 12 * 8
    ids: list[int] = []
    recv_ids = [0] * n
    try:
        for k in range(1, n):
            s = (r - k) % n
            recv_ids[s] = c.irecv(s, mtag, meta_rx[s].ctypes.data, mlen, _I64)
        for k in range(1, n):
            d = (r + k) % n
            ids.append(c.isend(d, mtag, metas[d].ctypes.data, mlen, _I64, (12,)))
    except BaseException:
        _cleanup(c, ids + recv_ids)
        raise

    def finish(timeout: float | None) -> Any:
        t = comm._timeout if timeout is None else timeout
        deadline = None if t is None else time.monotonic() + t
        errs = _Errors("all_to_all_v", comm)
        pids: list[tuple[int, bool]] = []
        try:
            for k in range(1, n):  # phase 1: every count (and dtype, bound) first
                s = (r - k) % n
                _wait(c, recv_ids[s], deadline)
                c.info(recv_ids[s])  # retires the request
                recv_ids[s] = 0
            m = [row[:4] + row[4:4 + row[3]] for row in meta_rx.tolist()]
            recv = [0] * n
            recv[r] = splits[r]
            ok = [True] * n
            for s in range(n):
                if s == r:
                    continue
                if m[s][1] != word or tuple(m[s][4:]) != trailing:
                    errs.problems.append(_mismatch(s, r, m[s][1], (m[s][0],) + tuple(m[s][4:]), word, trailing))
                    ok[s] = False
                elif m[s][0] * rb > comm.bound:
                    errs.markers.append(s)
                    ok[s] = False
                else:
                    recv[s] = m[s][0]
            total = sum(recv)
            if out is not None:
                optr, cap, _w = arrays.describe_out(out)
                result = None
                if total * rb > cap:
                    errs.overflow = f"{total} rows ({total * rb} bytes) arrived but out holds only {cap} bytes"
            else:
                shape = (total,) + trailing
                result = arrays.torch.empty(shape, dtype=x.dtype) if arrays.is_torch(x) else np.empty(shape, x.dtype)
                optr, cap = _ptr_of(result), total * rb
            o = optr
            for s in range(n):  # phase 2: payloads straight into place (scratch when refused)
                nb = recv[s] * rb
                if s != r and (ok[s] or m[s][0] * rb <= comm.bound):
                    into = o if ok[s] and not errs.overflow and nb else 0
                    pids.append((c.irecv(s, ptag, into, nb if into else 0, word if into else 0), bool(into)))
                o += nb
            for k in range(1, n):
                d = (r + k) % n
                nb = splits[d] * rb
                if nb > m[d][2]:  # over d's bound: d knows it too and expects nothing
                    errs.too_large.append((d, f"message of {nb} bytes exceeds the receive bound of {m[d][2]} "
                                              f"bytes on rank {d}"))
                    continue
                ids.append(c.isend(d, ptag, base + offs[d] * rb, nb, word, (splits[d],) + trailing))
            if recv[r] and not errs.overflow:
                ctypes.memmove(optr + sum(recv[:r]) * rb, base + offs[r] * rb, recv[r] * rb)
            for i, placed in pids:
                _wait(c, i, deadline)
                if placed:
                    c.info(i)  # retires the request
                else:
                    c.release(i)  # a refused or empty chunk: drop it
            pids = []
            for i in ids:
                _wait(c, i, deadline)
        except BaseException:
            _cleanup(c, ids + recv_ids + [i for i, _ in pids])
            raise
        errs.raise_any()
        if out is not None:
            result = _view_prefix(out, total * rb, (total,) + trailing)
        return result, recv

    return finish


def _mismatch(s: int, r: int, w: int, shape: tuple[int, ...], word: int, trailing: tuple[int, ...]) -> str:
    return (f"the chunk from rank {s} is {_dtype_name(w)} of shape {tuple(shape)}, but rank {r}'s x is "
            f"{_dtype_name(word)} with rows of shape {trailing}; every rank must pass the same dtype and "
            "trailing shape")


# ---------------------------------------------------------------------------
# torch-compatible forms


def all_to_all_single(comm: Any, output: Any, input: Any, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, *, async_op: bool = False,
                      timeout: float | None = None) -> Any:
    """torch.distributed.all_to_all_single: rows of ``input`` go out by
    ``input_split_sizes`` (default: equal), rows from source s land in
    ``output`` at the offsets given by ``output_split_sizes`` (default:
    equal); each chunk is received straight into its slice of ``output``.
    Returns None (a work when ``async_op``), like torch. Each message's header
    is checked against ``output_split_sizes``: a disagreement raises
    MessageMismatch naming the source rank (the disagreeing chunk is not written)."""
    inp = _host(input, "input")
    rows, trailing, rb = _rows_of(inp, "input")
    if not (arrays.is_torch(output) or isinstance(output, np.ndarray)):
        raise InvalidArgument(f"output must be a torch.Tensor or numpy.ndarray, not {type(output).__name__}")
    if not _contiguous(output):
        raise InvalidArgument("output must be contiguous: chunks are received straight into it")
    orows, otrail, _orb = _rows_of(output, "output")
    if _word_of(output) != _word_of(inp) or otrail != trailing:
        raise InvalidArgument(f"output ({output.dtype}, rows of shape {otrail}) and input ({inp.dtype}, rows of "
                              f"shape {trailing}) must agree in dtype and trailing shape")
    n, r = comm.world_size, comm.rank
    in_splits = _splits(input_split_sizes, n, rows, "input_split_sizes")
    out_splits = _splits(output_split_sizes, n, orows, "output_split_sizes")
    word = _word_of(inp)
    seq = _next_seq(comm)
    if not _uses_fallback(comm):
        fast = _v_native(comm, inp, in_splits, rows, trailing, rb, word, output, _native_tag(seq, None),
                         expect=out_splits, op="all_to_all_single")

        def finish_fast(t: float | None) -> None:
            fast(t)
            return None

        if async_op:
            return AllToAllWork(finish_fast, keep=(inp, output))
        return finish_fast(timeout)
    msgs = []
    off = 0
    for d in range(n):
        msgs.append(inp[off:off + in_splits[d]])
        off += in_splits[d]
    slices = []
    off = 0
    for s in range(n):
        slices.append(output[off:off + out_splits[s]])
        off += out_splits[s]

    def plan(metas: list[Any], errs: _Errors) -> list[Any]:
        dsts: list[Any] = [None] * n
        for s, m in enumerate(metas):
            if m is None:
                continue
            _nb, w, shape = m
            if w != word or tuple(shape) != (out_splits[s],) + trailing:
                errs.problems.append(
                    f"rank {s} sent {_dtype_name(w)} of shape {tuple(shape)}, but rank {r} expects "
                    f"{_dtype_name(word)} of shape {(out_splits[s],) + trailing} (output_split_sizes[{s}] = "
                    f"{out_splits[s]})")
                continue
            dsts[s] = slices[s]
        return dsts

    fin = _exchange_fallback(comm, "all_to_all_single", msgs, plan, seq, None)

    def finish(t: float | None) -> None:
        fin(t)
        return None

    if async_op:
        return AllToAllWork(finish, keep=(inp, msgs, output))
    return finish(timeout)


def all_to_all(comm: Any, output_tensor_list: list[Any] | None, input_tensor_list: Sequence[Any], *,
               async_op: bool = False, timeout: float | None = None) -> Any:
    """torch.distributed.all_to_all: ``input_tensor_list[d]`` goes to rank d,
    and what rank s sent lands in ``output_tensor_list[s]``. Tensors may have
    any shape (0-d included) and dtype. Beyond torch: ``output_tensor_list``
    may be None or hold None entries, which are allocated from the arriving
    headers; the filled list is returned (by ``wait()`` when ``async_op``).
    A given output must match the arriving dtype and shape exactly, else
    MessageMismatch naming the source rank."""
    n, r = comm.world_size, comm.rank
    if len(input_tensor_list) != n:
        raise InvalidArgument(f"input_tensor_list has {len(input_tensor_list)} entries; the world has {n} ranks")
    if output_tensor_list is not None and len(output_tensor_list) != n:
        raise InvalidArgument(f"output_tensor_list has {len(output_tensor_list)} entries; the world has {n} ranks")
    msgs = [_host(t, f"input_tensor_list[{d}]") for d, t in enumerate(input_tensor_list)]
    outs = output_tensor_list if output_tensor_list is not None else [None] * n
    use_torch = arrays.is_torch(msgs[r])
    for s, o in enumerate(outs):
        if o is not None:
            if not (arrays.is_torch(o) or isinstance(o, np.ndarray)):
                raise InvalidArgument(f"output_tensor_list[{s}] must be a tensor, an array or None")
            if not _contiguous(o):
                raise InvalidArgument(f"output_tensor_list[{s}] must be contiguous")
    seq = _next_seq(comm)

    def plan(metas: list[Any], errs: _Errors) -> list[Any]:
        dsts: list[Any] = [None] * n
        for s, m in enumerate(metas):
            if m is None:
                continue
            _nb, w, shape = m
            o = outs[s]
            if o is None:
                try:
                    o = arrays.empty("torch" if use_torch else "numpy", w, shape)[0]
                except Exception:
                    errs.problems.append(f"rank {s} sent dtype {_dtype_name(w)}, which rank {r} cannot represent")
                    continue
                outs[s] = o
            elif _word_of(o) != w or tuple(o.shape) != tuple(shape):
                errs.problems.append(f"rank {s} sent {_dtype_name(w)} of shape {tuple(shape)}, but "
                                     f"output_tensor_list[{s}] on rank {r} is {o.dtype} of shape {tuple(o.shape)}")
                continue
            dsts[s] = o
        return dsts

    fin = _exchange(comm, "all_to_all", msgs, plan, seq)

    def finish(t: float | None) -> Any:
        fin(t)
        return outs

    if async_op:
        return AllToAllWork(finish, keep=(msgs, outs))
    return finish(timeout)
