"""All-to-all with device-side splits: the host never reads a count.

``send_splits`` lives on the GPU (as a router's bincount of top-k ids does);
the output is a bound-sized buffer, and the rows and offsets received from
each source come back as a device tensor, written by a kernel. This is the
contract of torch SymmMem's ``all_to_all_vdev`` / ``all_to_all_vdev_2d``
(``out_splits_offsets``: row 0 the counts, row 1 the offsets), over
varcomm's nvlink set-up (CUDA IPC, no NVSHMEM) and with varcomm's errors.
The kernels and their protocol are ``transport/nvlink/a2a_kernels.cuh``;
the host side is ``transport/nvlink/a2a_device.cpp``; this module describes
arrays to it.

Arrays: torch CUDA tensors (ordered on torch's current stream), any object
with ``__cuda_array_interface__`` (cupy, numba; ordered on its ``stream``
entry, or the legacy default stream), or, with an explicit ``stream=``,
torch tensors in memory the GPU addresses directly (the CPU stand-in
driver's device memory in tests; pinned, mapped host memory), which
varcomm keeps alive until that stream ran the call (torch CUDA tensors are
``record_stream``'ed for it instead). Outputs not given are allocated
bound-sized: torch CUDA tensors for torch CUDA inputs, else a
``DeviceArray`` (``__cuda_array_interface__``) in memory varcomm allocated.

Errors are found by the kernels and recorded in host-mapped memory; the
host raises them at ``DeviceWork.synchronize()``, at ``synchronize(comm)``,
or at the next device all-to-all call (once that call is enqueued: the
ranks stay in step), whichever comes first, one per look and in call order
(each names its call; calls enqueued before the host looked keep theirs).
A call this rank refuses on the host (an argument error) is launched empty,
so that its receivers stay in step (MessageMismatch naming this rank, 0 rows
from it). As errors surface later on the peers than on the rank that caused
them, every rank must go on making the same calls after an error; a chunk
from another kind of call (a combine met by a dispatch: ranks out of step)
is MessageMismatch naming both calls. Per call:

* a chunk over its receiver's slot (the bound): nothing of it is sent, the
  receiver gets 0 rows from that source; MessageTooLarge on both;
* rows of another dtype or row size than the receiver's: MessageMismatch
  naming the source, 0 rows from it;
* rows that do not fit ``out``: MessageTooLarge, 0 rows from that source;
* splits outside ``x`` (negative, or summing past its rows): InvalidArgument
  (MessageMismatch naming that rank on its receivers);
* a peer that does not answer within ``timeout`` (the kernels' own limit):
  TimeoutError; a dead peer (noticed within seconds by a watcher
  thread, whoever waits on the stream) or a close:
  PeerFailure. After these two the device path of the communicator stays
  failed (its sequence numbers may disagree between ranks); point-to-point
  and host collectives go on working. The same holds after a call that
  started while another still ran (InvalidArgument): a CUDA graph replayed
  on another stream than the one it was captured on.

Nothing is ever written past ``out``, ``out_splits_offsets`` or a slot.

CUDA graphs: every sequence number, flag and credit lives in device memory
and is advanced by the kernels, so a call (or a whole MoE dispatch and
combine) captured once replays with new routing each time: same buffers,
new contents of ``send_splits``. Call it once before capturing (the first
call sets up the workspaces, a collective through the host), and replay
on the capture stream (or one ordered after every earlier call's).

Streams: a stream may be destroyed once its calls are enqueued (varcomm
keeps an event, not the stream); one given to ``synchronize(stream=)`` or
a ``DeviceArray``'s must still exist when it is used.

Point-to-point with the row count on the device (``setup_p2p`` once, then
``send_rows`` / ``recv_rows``) uses the same kernels' protocol per pair and
is capturable the same way; the ordinary ``send`` / ``recv`` still refuse
capture.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import numpy as np

from .. import _C, arrays, dtypes
from ..errors import InvalidArgument, VarcommError

_F = TypeVar("_F", bound=Callable[..., Any])

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["DeviceArray", "all_to_all_vdev", "all_to_all_vdev_2d", "all_to_all_vdev_2d_offset", "is_device_splits",
           "synchronize", "DeviceWork", "capacity_rows", "setup_p2p", "send_rows", "recv_rows"]

_IN_PREFIX, _IN_OFFSETS = 0, 1
_OUT_EXPERT_MAJOR, _OUT_RANK_MAJOR = 0, 1
_PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD, as __cuda_array_interface__ spells it
_INT = {dtypes.word(dtypes.INT, 32): 4, dtypes.word(dtypes.INT, 64): 8}
_I64 = dtypes.word(dtypes.INT, 64)


@dataclass
class _Dev:
    """A device array as the core sees it."""

    ptr: int
    word: int
    shape: tuple[int, ...]
    stream: int | None  # the stream it is ordered on, None: not said
    obj: Any
    cuda: bool  # a torch CUDA tensor (outputs can be allocated like it)

    @property
    def row_bytes(self) -> int:
        n = dtypes.itemsize(self.word)
        for s in self.shape[1:]:
            n *= s
        return n


def _cai_word(cai: dict[str, Any], what: str) -> int:
    name = cai.get("varcomm_dtype")  # dtypes numpy has no typestr for (bfloat16, float8)
    try:
        if name is not None:
            return dtypes.from_torch(getattr(arrays.torch, str(name)))
        return dtypes.from_numpy(np.dtype(cai["typestr"]))
    except (TypeError, KeyError, AttributeError, InvalidArgument) as e:
        raise InvalidArgument(f"{what}: unsupported dtype in __cuda_array_interface__ ({e})") from None


def _describe(comm: Communicator, x: Any, what: str, stream: int | None) -> _Dev:
    """x as a device array; stream: the caller's, else x's own."""
    if arrays.is_torch(x):
        if not x.is_contiguous():
            raise InvalidArgument(f"{what} must be contiguous (the kernels address it as rows)")
        if x.is_cuda:
            arrays.check_device(x, comm._cuda_device, what, "device all-to-all")  # the kernels run there
            s = arrays.torch.cuda.current_stream(x.device).cuda_stream
            return _Dev(x.data_ptr(), dtypes.from_torch(x.dtype), tuple(x.shape), s, x, True)
        if stream is None:
            raise InvalidArgument(f"{what} is a CPU tensor: the device all-to-all takes CUDA tensors (or, with an "
                                  "explicit stream=, memory the GPU addresses directly)")
        return _Dev(x.data_ptr(), dtypes.from_torch(x.dtype), tuple(x.shape), None, x, False)
    cai = getattr(x, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise InvalidArgument(f"{what} must be a CUDA tensor or an array with __cuda_array_interface__, not "
                              f"{type(x).__name__}")
    shape = tuple(int(s) for s in cai["shape"])
    word = _cai_word(cai, what)
    strides = cai.get("strides")
    if strides is not None:
        expect, step = [], dtypes.itemsize(word)
        for s in reversed(shape):
            expect.append(step)
            step *= s
        if tuple(strides) != tuple(reversed(expect)):
            raise InvalidArgument(f"{what} must be C-contiguous")
    ptr = int(cai["data"][0])
    st = cai.get("stream")
    own = None if st is None else (0 if int(st) == 1 else int(st))
    return _Dev(ptr, word, shape, own, x, False)


class DeviceArray:
    """A C-contiguous array in GPU memory that varcomm allocated (an output of
    a device all-to-all whose inputs were not torch tensors). Any library
    that reads ``__cuda_array_interface__`` (cupy.asarray, numba) takes it
    without a copy; the memory is freed with the last reference."""

    def __init__(self, handle: Any, shape: tuple[int, ...], word: int, stream: int):
        self.shape, self.word, self.stream = shape, word, stream
        self.nbytes = dtypes.itemsize(word) * int(np.prod(shape, dtype=np.int64))
        self.ptr: int = handle.alloc(self.nbytes)
        # Freed once its stream ran what was enqueued (a kernel may still write it).
        self._free = weakref.finalize(self, handle.free, self.ptr, stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": self.shape, "data": (self.ptr, False), "version": 3, "strides": None,
                             "stream": self.stream or 1}
        try:
            d["typestr"] = dtypes.to_numpy(self.word).str
        except InvalidArgument:  # bfloat16, float8: numpy has no typestr
            d["typestr"] = f"|V{dtypes.itemsize(self.word)}"
            d["varcomm_dtype"] = dtypes.describe(self.word)
        return d

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={dtypes.describe(self.word)}, ptr={self.ptr:#x})"


def _record(h: Any, devs: tuple[_Dev, ...], stream: int, explicit: bool) -> None:
    """After a launch with an explicit stream=: the kernels read and write
    arrays on a stream their allocator does not know, which without this
    could hand their memory (an out allocated here on the current stream, a
    dropped input such as a temporary splits tensor) to new arrays while the
    kernels still use it. Torch CUDA tensors are record_stream'ed; the others
    (torch tensors in memory the GPU addresses, cupy arrays) are kept alive
    by the handle until the stream passed this point. varcomm's own
    DeviceArray frees itself in its own stream's order: kept too when the
    call runs on another."""
    if not explicit:
        return
    keep = []
    for d in devs:
        if d.cuda:
            d.obj.record_stream(arrays.torch.cuda.ExternalStream(stream, device=d.obj.device))
        elif not isinstance(d.obj, DeviceArray) or d.obj.stream != stream:
            keep.append(d.obj)
    if keep:
        h.keep(tuple(keep), stream)


def is_device_splits(splits: Any) -> bool:
    """Splits that live on a GPU: a torch CUDA tensor or a __cuda_array_interface__ array."""
    if arrays.is_torch(splits):
        return bool(splits.is_cuda)
    return isinstance(getattr(splits, "__cuda_array_interface__", None), dict)


def _slot_bytes(comm: Communicator) -> int:
    """Payload bytes of a device slot: the bound (at least 64), in the 16-byte words the kernels copy."""
    return comm.options.bound // 16 * 16


def _handle(comm: Communicator) -> Any:
    """The communicator's device all-to-all (set up on first use: a collective)."""
    h = getattr(comm, "_device_a2a", None)
    if h is not None:
        return h
    why = _C.device_a2a_unavailable_reason()
    if why:
        raise InvalidArgument(f"device-split all-to-all unavailable: {why}")
    dev = comm._cuda_device
    if dev is None:
        raise InvalidArgument("device-split all-to-all: this communicator uses no GPU (set VARCOMM_NVLINK=1, or "
                              "use CUDA before varcomm.init)")
    h = _C.DeviceAllToAll(comm._c, dev, _slot_bytes(comm), comm._timeout)
    comm._device_a2a = h
    return h


def _p2p_handle(comm: Communicator) -> Any:
    h = comm._device_p2p
    if h is None:
        raise InvalidArgument("device point-to-point is not set up: call alltoall_device.setup_p2p(comm) on every "
                              "rank first (a collective)")
    return h


def setup_p2p(comm: Communicator) -> None:
    """Set up the device point-to-point path (send_rows / recv_rows): a
    workspace of its own, world_size x the bound, like the all-to-all's.
    A collective: every rank calls it, before any capture."""
    if comm._device_p2p is not None:
        return
    _handle(comm)  # the same checks, and the all-to-all's workspace, first
    dev = comm._cuda_device
    assert dev is not None  # _handle raised otherwise
    comm._device_p2p = _C.DeviceAllToAll(comm._c, dev, _slot_bytes(comm), comm._timeout, p2p=True)


def send_rows(comm: Communicator, x: Any, rows: Any, dst: int, *, stream: int | None = None,
              timeout: float | None = None) -> None:
    """Send ``x[:rows]`` to ``dst``, ``rows`` a one-element int tensor on the
    device (the host never reads it): one kernel writes the rows, the count
    and a flag into dst's slot for us. Capturable in a CUDA graph (every
    sequence number is on the device); per pair, sends must be ordered (one
    stream). Errors as for the all-to-all (a count over x or the bound:
    nothing sent, the receiver gets 0 rows)."""
    h = _p2p_handle(comm)
    xd = _describe(comm, x, "x", stream)
    if len(xd.shape) == 0:
        raise InvalidArgument("x must have at least one dimension (rows along dim 0)")
    rd, rb = _splits(comm, rows, 1, "rows", stream)
    s = stream if stream is not None else xd.stream if xd.stream is not None else 0
    try:  # (a launch that raises an earlier call's error has enqueued its kernels all the same)
        h.launch_p2p(True, int(dst), xd.word, xd.row_bytes, xd.ptr, xd.shape[0], rd.ptr, rb, int(s),
                     comm._timeout if timeout is None else timeout)
    finally:
        _record(h, (xd, rd), int(s), stream is not None)


def recv_rows(comm: Communicator, out: Any, rows_out: Any, src: int, *, stream: int | None = None,
              timeout: float | None = None) -> None:
    """Receive what ``src`` sent with send_rows into the bound-sized ``out``;
    the kernel writes the row count to ``rows_out`` (a one-element int64
    device tensor). A message over ``out``'s rows, or of another dtype or row
    size, is dropped (0 rows) and raised at synchronize or the next call."""
    h = _p2p_handle(comm)
    od = _describe(comm, out, "out", stream)
    if len(od.shape) == 0:
        raise InvalidArgument("out must have at least one dimension (rows along dim 0)")
    rd = _describe(comm, rows_out, "rows_out", stream)
    if rd.word != _I64 or int(np.prod(rd.shape)) != 1:
        raise InvalidArgument("rows_out must be one int64 on the device")
    s = stream if stream is not None else od.stream if od.stream is not None else 0
    try:
        h.launch_p2p(False, int(src), od.word, od.row_bytes, od.ptr, od.shape[0], rd.ptr, 8, int(s),
                     comm._timeout if timeout is None else timeout)
    finally:
        _record(h, (od, rd), int(s), stream is not None)


def capacity_rows(comm: Communicator, row_bytes: int) -> int:
    """Rows of `row_bytes` one source may send to one rank (its slot: the bound)."""
    return _slot_bytes(comm) // max(row_bytes, 1)


class DeviceWork:
    """A device all-to-all enqueued on its stream (a varcomm.Work). ``wait()``
    returns the result at once (the GPU work is ordered on the stream);
    ``synchronize()`` blocks the host until the stream ran it and raises what
    the kernels recorded."""

    def __init__(self, comm: Communicator, stream: int, result: Any):
        self._comm, self._stream, self._result = comm, stream, result
        self._synced = False

    def wait(self, timeout: float | None = None) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return self._synced

    def synchronize(self, timeout: float | None = None) -> Any:
        synchronize(self._comm, self._stream, timeout)
        self._synced = True
        return self._result

    def result(self) -> Any:
        return self._result


def synchronize(comm: Communicator, stream: int | None = None, timeout: float | None = None) -> None:
    """Block until `stream` (default: every stream a device all-to-all or
    point-to-point of comm ran on, but those being captured) ran every call
    enqueued on it, then raise what the kernels recorded. A peer that died
    meanwhile aborts the kernels' waits (PeerFailure)."""
    h = _handle(comm)
    s = None if stream is None else int(stream)
    t = comm._timeout if timeout is None else timeout
    h.synchronize(s, t)
    if comm._device_p2p is not None:
        comm._device_p2p.synchronize(s, t)


def torch_on(x: Any, stream: int | None) -> contextlib.AbstractContextManager[Any]:
    """Torch CUDA tensors with an explicit stream: torch's own ops around a
    call (allocations, gathers, copies; and so an autograd Function's
    backward, which autograd runs on the forward's stream) run on that stream,
    as the kernels do. On torch's current stream instead, a kernel could read
    a gather not yet done, or a copy read an output the kernel had not yet
    written."""
    if stream is None or not x.is_cuda:
        return contextlib.nullcontext()
    return arrays.torch.cuda.stream(arrays.torch.cuda.ExternalStream(stream, device=x.device))


def torch_after(comm: Communicator, x: Any, stream: int | None, timeout: float | None = None) -> None:
    """After a call on torch tensors not on a GPU (the stand-in driver's device
    memory, with an explicit stream): wait for the kernels (up to the call's
    timeout) before torch reads the result, since CPU torch ops are not
    ordered on the stream."""
    if not x.is_cuda:
        synchronize(comm, stream, timeout)


def _splits(comm: Communicator, splits: Any, n: int, what: str, stream: int | None) -> tuple[_Dev, int]:
    d = _describe(comm, splits, what, stream)
    if d.word not in _INT:
        raise InvalidArgument(f"{what} must be int32 or int64, not {dtypes.describe(d.word)}")
    total = 1
    for s in d.shape:
        total *= s
    if total != n:
        raise InvalidArgument(f"{what} has {total} entries; {n} expected")
    return d, _INT[d.word]


def _launch(comm: Communicator, ne: int, in_layout: int, out_layout: int, x: Any, splits: Any, splits_len: int,
            out: Any, out_splits_offsets: Any, stream: int | None, timeout: float | None, async_op: bool,
            out_rows: int | None = None, backward: bool = False, dispatch: Any = None) -> Any:
    h = _handle(comm)  # (set up on first use: a collective, before anything is refused)
    before = launched(comm)
    try:
        return _checked_launch(comm, h, ne, in_layout, out_layout, x, splits, splits_len, out, out_splits_offsets,
                               stream, timeout, async_op, out_rows, backward, dispatch)
    except Exception as e:
        refuse_unlaunched(comm, e, before, x, stream, timeout)
        raise


def refuse_unlaunched(comm: Communicator, e: BaseException, calls_before: int, like: Any, stream: int | None,
                      timeout: float | None) -> None:
    """After `e` left a device entry point: where no device call was launched
    since `calls_before` (an argument error, or an earlier call's error raised
    before this one could start), refuse the call to the peers (an empty
    launch, refuse()), so that they stay in step. (Closed or failed for good:
    refuse() launches nothing.)"""
    if not getattr(e, "_refused_to_peers", False) and launched(comm) == calls_before:
        refuse(comm, like, stream, timeout)
        if launched(comm) != calls_before:  # (none where the device path is not there, or failed)
            with contextlib.suppress(AttributeError):  # (an exception type without a __dict__)
                e._refused_to_peers = True  # type: ignore[attr-defined]


def refusing(fn: _F) -> _F:
    """A device entry point (comm first, its input second) whose argument
    errors are refused to the peers, so their call pairs with nothing rather
    than with this rank's next call."""
    @functools.wraps(fn)
    def call(comm: Communicator, *args: Any, **kw: Any) -> Any:
        before = launched(comm)
        try:
            return fn(comm, *args, **kw)
        except Exception as e:
            refuse_unlaunched(comm, e, before, args[0] if args else None, kw.get("stream"), kw.get("timeout"))
            raise
    return cast(_F, call)


def launched(comm: Communicator) -> int:
    """Device all-to-all calls this rank launched so far (refused ones too)."""
    h = comm._device_a2a
    return 0 if h is None else int(h.launches)


def refuse(comm: Communicator, like: Any = None, stream: int | None = None, timeout: float | None = None) -> None:
    """This rank refused its part of the next device call on the host (an
    argument error): the call is launched with no data, so every rank's call
    numbers stay in step; its receivers get 0 rows from this rank and
    MessageMismatch naming it, at their next look (synchronize, or their next
    call). On the stream given, else like's (the call's input), else the
    default stream. Best effort: where the device path is not set up or has
    failed, nothing is launched (the caller raises its own error either way)."""
    try:
        h = _handle(comm)
        s = stream
        if s is None and like is not None:
            try:
                s = _describe(comm, like, "x", None).stream
            except Exception:  # (what was refused may be that very argument)
                s = None
        try:
            _C.check_timeout(timeout)
        except Exception:
            timeout = None
        h.refuse(int(s or 0), comm._timeout if timeout is None else timeout)
    except VarcommError:
        pass


def _checked_launch(comm: Communicator, h: Any, ne: int, in_layout: int, out_layout: int, x: Any, splits: Any,
                    splits_len: int, out: Any, out_splits_offsets: Any, stream: int | None, timeout: float | None,
                    async_op: bool, out_rows: int | None, backward: bool, dispatch: Any) -> Any:
    n = comm.world_size
    xd = _describe(comm, x, "x", stream)
    if len(xd.shape) == 0:
        raise InvalidArgument("x must have at least one dimension (rows are split along dim 0)")
    sd, sb = _splits(comm, splits, splits_len, "splits", stream)
    rb = xd.row_bytes
    s = stream if stream is not None else xd.stream if xd.stream is not None else 0
    if out is None:
        rows = out_rows if out_rows is not None else n * capacity_rows(comm, rb)
        if xd.cuda:
            out = arrays.torch.empty((rows,) + xd.shape[1:], dtype=x.dtype, device=x.device)
        else:
            out = DeviceArray(h, (rows,) + xd.shape[1:], xd.word, int(s))
    od = _describe(comm, out, "out", stream)
    if od.word != xd.word or od.shape[1:] != xd.shape[1:]:
        raise InvalidArgument(f"out ({dtypes.describe(od.word)}, rows of {od.shape[1:]}) and x "
                              f"({dtypes.describe(xd.word)}, rows of {xd.shape[1:]}) must agree in dtype and trailing "
                              "shape")
    if out_splits_offsets is None:
        if xd.cuda:
            out_splits_offsets = arrays.torch.empty((2, n * ne), dtype=arrays.torch.int64, device=x.device)
        else:
            out_splits_offsets = DeviceArray(h, (2, n * ne), _I64, int(s))
    oso = _describe(comm, out_splits_offsets, "out_splits_offsets", stream)
    if oso.word != _I64 or int(np.prod(oso.shape)) != 2 * n * ne:
        raise InvalidArgument(f"out_splits_offsets must be int64 with {2 * n * ne} entries ([2, {n * ne}]), not "
                              f"{dtypes.describe(oso.word)} {oso.shape}")
    kept: tuple[_Dev, ...] = (xd, sd, od, oso)
    if dispatch is not None:  # (moe_device's: one int64 its dispatch's kernel writes)
        dd = _describe(comm, dispatch, "dispatch", stream)
        if dd.word != _I64 or int(np.prod(dd.shape)) != 1:
            raise InvalidArgument("the dispatch number must be one int64 on the device")
        kept += (dd,)
    if timeout is not None:
        _C.check_timeout(timeout)
    try:  # (a launch that raises an earlier call's error has enqueued its kernels all the same)
        h.launch(ne, in_layout, out_layout, xd.word, rb, xd.ptr, xd.shape[0], sd.ptr, sb, od.ptr, od.shape[0],
                 oso.ptr, int(s), comm._timeout if timeout is None else timeout, backward,
                 0 if dispatch is None else dd.ptr, dispatch is not None and in_layout == _IN_PREFIX and not backward)
    finally:
        _record(h, kept, int(s), stream is not None)
    result = (out, out_splits_offsets)
    return DeviceWork(comm, int(s), result) if async_op else result


def _differentiable(x: Any, out: Any, out_splits_offsets: Any, async_op: bool, what: str) -> bool:
    """Whether the call must carry x's graph (a torch tensor requiring grad):
    then only the form that returns new tensors can."""
    if not (arrays.is_torch(x) and x.requires_grad and arrays.torch.is_grad_enabled()):
        return False
    if out is not None or out_splits_offsets is not None or async_op:
        raise InvalidArgument(f"{what}: x requires grad, and the result is differentiable only without out=, "
                              "out_splits_offsets= and async_op (the gradient would silently stop here); drop "
                              "them, or pass x.detach() to send it without a gradient")
    return True


def _autograd(comm: Communicator, x: Any, splits: Any, experts_per_rank: int, stream: int | None,
              timeout: float | None) -> Any:
    from . import a2a_autograd

    return a2a_autograd.all_to_all_vdev_2d(comm, x, splits, experts_per_rank, stream, timeout)


@refusing
def all_to_all_vdev(comm: Communicator, x: Any, send_splits: Any, *, out: Any = None,
                    out_splits_offsets: Any = None, stream: int | None = None, timeout: float | None = None,
                    async_op: bool = False) -> Any:
    """Rows ``x[off[d] : off[d] + send_splits[d]]`` (offsets: the prefix sums,
    on the device) go to rank d. Returns ``(out, out_splits_offsets)``: ``out``
    holds the chunks from every source back to back in source order (a
    bound-sized buffer: ``world_size x`` the rows of one bound when
    allocated), ``out_splits_offsets[0][s]`` the rows from source s and
    ``[1][s]`` their first row in ``out``, int64 on the device. Nothing waits
    on the host (but for torch tensors not on a GPU, whose CPU ops the stream
    does not order); ``async_op``: a DeviceWork instead (its
    ``synchronize()`` raises the kernels' errors).

    Differentiable when x is a torch tensor that requires grad (without
    out=, out_splits_offsets= and async_op): the gradient goes back by the
    combine. As with every collective, x must then require grad on every
    rank, and every rank must run backward through it in the same order."""
    n = comm.world_size
    if _differentiable(x, out, out_splits_offsets, async_op, "all_to_all_vdev"):
        return _autograd(comm, x, send_splits, 1, stream, timeout)
    return _launch(comm, 1, _IN_PREFIX, _OUT_EXPERT_MAJOR, x, send_splits, n, out, out_splits_offsets, stream,
                   timeout, async_op)


@refusing
def all_to_all_vdev_2d(comm: Communicator, x: Any, send_splits: Any, experts_per_rank: int, *, out: Any = None,
                       out_splits_offsets: Any = None, stream: int | None = None, timeout: float | None = None,
                       async_op: bool = False, _backward: bool = False, _dispatch: Any = None) -> Any:
    """The MoE dispatch (torch's ``all_to_all_vdev_2d``): x's rows are sorted by
    global expert, ``send_splits[d * E + e]`` of them for local expert e of
    rank d (E = experts_per_rank). ``out`` is expert-major: for each local
    expert, its rows from source 0, 1, ...; ``out_splits_offsets[0][e * world
    + s]`` rows from source s for expert e, ``[1][...]`` where they start, so
    expert e's rows are one contiguous run (what a grouped GEMM takes).
    (``_backward``: the call of an autograd backward, set by the autograd
    layers: a forward's chunk met by it is "out of step" on both ranks.
    ``_dispatch``: moe_device's one-int64 device tensor; a forward dispatch's
    kernel writes its call number there, a backward carries and checks it.)"""
    n = comm.world_size
    if _differentiable(x, out, out_splits_offsets, async_op, "all_to_all_vdev_2d"):
        return _autograd(comm, x, send_splits, int(experts_per_rank), stream, timeout)
    return _launch(comm, int(experts_per_rank), _IN_PREFIX, _OUT_EXPERT_MAJOR, x, send_splits,
                   n * int(experts_per_rank), out, out_splits_offsets, stream, timeout, async_op,
                   backward=_backward, dispatch=_dispatch)


@refusing
def all_to_all_vdev_2d_offset(comm: Communicator, x: Any, in_splits_offsets: Any, experts_per_rank: int, *,
                              out: Any = None, out_splits_offsets: Any = None, stream: int | None = None,
                              timeout: float | None = None, async_op: bool = False,
                              out_rows: int | None = None, _backward: bool = False, _dispatch: Any = None) -> Any:
    """The MoE combine (torch's ``all_to_all_vdev_2d_offset``): x is
    expert-major as dispatch left it, ``in_splits_offsets`` [2, E * world]
    (dispatch's ``out_splits_offsets``) says which rows go back to each
    source. ``out`` is rank-major: from rank 0 its rows for its experts 0, 1,
    ..., then rank 1's, ...: exactly the order this rank sent them in.
    ``out_splits_offsets[0][s * E + e]``, ``[1][...]``: counts and offsets.
    (``_dispatch``: the dispatch undone, as in all_to_all_vdev_2d.)"""
    n = comm.world_size
    if arrays.is_torch(x) and x.requires_grad and arrays.torch.is_grad_enabled():
        # Its backward would have to put each gradient row back where in_splits_offsets took it from, which need
        # not be where a dispatch leaves rows; moe_device.combine knows the layout and carries autograd.
        raise InvalidArgument("all_to_all_vdev_2d_offset: x requires grad, and this call is not differentiable "
                              "(the gradient would silently stop here): use moe_device.combine (or moe.combine) "
                              "for a differentiable combine, or pass x.detach()")
    return _launch(comm, int(experts_per_rank), _IN_OFFSETS, _OUT_RANK_MAJOR, x, in_splits_offsets,
                   2 * n * int(experts_per_rank), out, out_splits_offsets, stream, timeout, async_op, out_rows,
                   _backward, _dispatch)
