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

The strategy is the option ``a2a_algorithm`` (``VARCOMM_A2A_ALGORITHM``), read at call time:
``auto`` or ``one-phase`` (counts travel in each chunk's header), or
``two-phase``, the conventional baseline (a descriptor per pair with the
count, dtype and shape, then the payload into exactly-sized buffers).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar, cast, overload

import numpy as np

from .. import _C, arrays, dtypes
from ..errors import InvalidArgument
from . import alltoall_device

if TYPE_CHECKING:
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


# The only uses of the core's collective binding.
# keep: the arrays behind the pointers; a send still in flight when the
# collective is given up on (timeout, error) keeps them alive in the core.
def _rows(comm: Communicator, op: int, tag: int, ptr: int, row_bytes: int, splits: list[int], word: int,
          trailing: tuple[int, ...], out: int, cap: int, keep: object, expect: list[int] | None = None
          ) -> _C.AllToAll:
    return _C.all_to_all_rows(comm._c, op, _strategy(comm), tag, ptr, row_bytes, splits, word, trailing, out, cap,
                              expect, keep)


def _list(comm: Communicator, sends: list[tuple[int, int, int, tuple[int, ...]]],
          outs: list[tuple[int, int, int, tuple[int, ...]] | None], keep: object) -> _C.AllToAll:
    return _C.all_to_all_list(comm._c, _strategy(comm), sends, outs, keep)


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


def _check_timeout(timeout: float | None) -> None:
    """NaN is refused before the collective starts (the core's rule)."""
    if timeout is not None:
        _C.check_timeout(timeout)


def _check_out(out: Any, what: str) -> None:
    if not (arrays.is_torch(out) or isinstance(out, np.ndarray)):
        raise InvalidArgument(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(out).__name__}")


# ---------------------------------------------------------------------------
# the work object


class AllToAllWork:
    """A pending all-to-all (a varcomm.Work). ``wait()`` finishes it and returns
    its result (the same value the blocking call returns)."""

    def __init__(self, finish: Callable[[float | None], Any], keep: Any = None):
        self._finish: Callable[[float | None], Any] | None = finish
        self._keep = keep  # the inputs must outlive the transfer
        self._result: Any = None
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> Any:
        _check_timeout(timeout)  # before the collective is taken: a NaN leaves it pending
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

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(): an all-to-all moves host memory only, so no device work is left after it."""
        return self.wait(timeout)

    def result(self) -> Any:
        return self.wait()

    def __del__(self) -> None:
        # Dropped without wait(): finish anyway so every pair's message is consumed.
        if self._finish is not None:
            try:
                self.wait()
            except Exception:
                pass


def _done(finish: Callable[[float | None], R], async_op: bool, timeout: float | None, keep: object) -> R | Work:
    return AllToAllWork(finish, keep) if async_op else finish(timeout)


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

    send_splits on the GPU (a CUDA int tensor, or a __cuda_array_interface__
    array): the device-split form, alltoall_device.all_to_all_vdev. Nothing
    is read on the host; it returns ``(out, out_splits_offsets)``, a
    bound-sized out and the rows and offsets per source as a device tensor.
    """
    if alltoall_device.is_device_splits(send_splits):
        return alltoall_device.all_to_all_vdev(comm, x, send_splits, out=out, timeout=timeout,  # type: ignore[no-any-return]
                                               async_op=async_op)
    _check_timeout(timeout)
    if tag is not None and (not isinstance(tag, (int, np.integer)) or isinstance(tag, bool)):
        raise InvalidArgument(f"tag {tag!r} out of range [0, {MAX_COLL_TAG}] for a collective")
    n = comm.world_size
    if type(x) is _Tensor and x.is_cpu and x.is_contiguous() and x.dim() and not (x.is_conj() or x.is_neg()):
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
    h = _rows(comm, _V, int(tag or 0), ptr, rb, splits, word, trailing, optr, cap, (x, out))
    made: list[Any] = []

    def alloc(total: int) -> int:
        shape = (total,) + trailing
        a = arrays.torch.empty(shape, dtype=x.dtype) if arrays.is_torch(x) else np.empty(shape, x.dtype)
        made.append(a)
        return a.data_ptr() if arrays.is_torch(a) else a.ctypes.data

    def finish(t: float | None) -> tuple[Array, list[int]]:
        recv = _run(comm, h, t, alloc if out is None else None)
        if out is None:
            return made[0], recv
        total = sum(recv)
        return arrays.prefix_view(out, total * rb, (total,) + trailing), recv

    return _done(finish, async_op, timeout, (x, out))


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
    inp = arrays.host_array(input, "input")
    rows, trailing, rb, ptr, word = _rows_of(inp, "input")
    _check_out(output, "output")
    if not (output.is_contiguous() if arrays.is_torch(output) else output.flags.c_contiguous):
        raise InvalidArgument("output must be contiguous: chunks are received straight into it")
    if len(output.shape) == 0:
        raise InvalidArgument("output must have at least one dimension (rows are split along dim 0)")
    orows, otrail = int(output.shape[0]), tuple(int(s) for s in output.shape[1:])
    optr, cap, oword = arrays.describe_out(output)
    if oword != word or otrail != trailing:
        raise InvalidArgument(f"output ({output.dtype}, rows of shape {otrail}) and input ({inp.dtype}, rows of "
                              f"shape {trailing}) must agree in dtype and trailing shape")
    n = comm.world_size
    in_splits = _splits(input_split_sizes, n, rows, "input_split_sizes")
    out_splits = _splits(output_split_sizes, n, orows, "output_split_sizes")
    h = _rows(comm, _SINGLE, 0, ptr, rb, in_splits, word, trailing, optr, cap, (inp, output), out_splits)

    def finish(t: float | None) -> None:
        _run(comm, h, t)
        return None

    return _done(finish, async_op, timeout, (inp, output))


@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: Literal[False] = False, timeout: float | None = None) -> list[Array]: ...
@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: Literal[True], timeout: float | None = None) -> Work: ...
@overload
def all_to_all(comm: Communicator, output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               *, async_op: bool = False, timeout: float | None = None) -> list[Array] | Work: ...
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
    h = _list(comm, sends, given, (msgs, list(outs)))

    def alloc(s: int, word: int, shape: tuple[int, ...]) -> int:
        a, ptr = arrays.empty(kind, word, shape)
        outs[s] = a
        return ptr

    def finish(t: float | None) -> list[Array]:
        _run(comm, h, t, alloc)
        return cast("list[Array]", outs)  # every entry given or allocated now

    return _done(finish, async_op, timeout, (msgs, outs))
