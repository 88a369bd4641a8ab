"""The ``"varcomm"`` backend of torch.distributed.

``import varcomm.torch`` (or this module) registers it; then::

    dist.init_process_group("varcomm")          # env:// (torchrun, varcomm-run, mpirun, srun), or init_method=/store=

and ``dist.send/recv/isend/irecv/batch_isend_irecv``, ``dist.all_to_all_single``,
``dist.all_to_all`` and ``dist.barrier`` on CPU tensors go through varcomm, in
every group: the default one, ``new_group`` ones and DeviceMesh dimensions
(one varcomm Communicator per group, whose ranks are the group ranks, met
through the store torch hands the backend).

Everything varcomm does not implement (all_reduce, all_gather, broadcast,
reduce_scatter, gather, scatter, the coalesced and functional forms, object
collectives, monitored_barrier) runs on a gloo backend made underneath from
the same store, and CUDA tensors run on an NCCL backend (when torch has CUDA and
NCCL; option ``torch_nccl``, ``VARCOMM_TORCH_NCCL=0``, turns it off): both are registered as the
group's per-device backends, so torch's own dispatch finds them.

A ``placeholder()`` tensor is the exception: ``dist.recv``/``irecv`` into it
take a message of any shape and dtype, which it then holds (how
``varcomm.integrations.pipelining`` receives microbatches of any length).
Otherwise semantics are torch's: ``dist.recv`` receives into the given tensor, whose
size must equal the message's (the same number of bytes and the same dtype;
a different shape with the same size is accepted, as gloo and NCCL do), and a
message of another size is refused with an error naming both sizes. The
variable-size forms (receive without knowing the size) are in
``varcomm.distributed``. Messages over varcomm's receive bound
(``VARCOMM_BOUND``, which must be the same on every rank) travel as a small
header plus bound-sized chunks, so any size works.

varcomm's options come from the environment, or from a ``varcomm.Options``
passed as ``pg_options`` (``dist.init_process_group("varcomm",
pg_options=varcomm.Options.resolve(bound=...))``); groups made later without
one take the default group's. The wait timeout is the group's ``timeout``.
"""
from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _C, bootstrap, dtypes
from ..collectives import alltoall as _a2a
from ..comm import Communicator, connect
from ..errors import MessageMismatch, MessageTooLarge, VarcommError
from ..errors import TimeoutError as VarcommTimeout
from ..options import Options

BACKEND = "varcomm"

__all__ = ["BACKEND", "VarcommProcessGroup", "VarcommWork", "register", "comm_of", "placeholder",
           "recv_into_placeholder"]


# ---------------------------------------------------------------------------
# works


def _seconds(timeout: timedelta | float | None) -> float | None:
    """A torch wait timeout (timedelta, 0 = the group's default) in seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return None if timeout <= 0 else float(timeout)


class VarcommWork(dist.Work):
    """A torch.distributed Work over pending varcomm operations (also a varcomm.Work).

    ``wait()`` finishes them (raising what they raised) and returns True."""

    def __init__(self, finish: Callable[[float | None], Any] | None, poll: Callable[[], bool] | None = None,
                 result: Sequence[torch.Tensor] = (), source: int = -1):
        super().__init__()
        self._finish = finish
        self._poll = poll
        self._result = list(result)
        self._source = source
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if self._finish is not None:
            f, self._finish = self._finish, None
            try:
                f(_seconds(timeout))
            except _NotYet as e:
                self._finish = f  # nothing was cancelled: a later wait resumes
                raise VarcommTimeout(f"{e} (after {_seconds(timeout)} s); the receive stays posted: wait again "
                                     "to finish it") from None
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        if self._poll is not None and self._poll():
            f, self._finish = self._finish, None
            try:
                f(0.0)
            except _NotYet:
                self._finish = f
                return False
            except BaseException as e:
                self._error = e  # is_success() and wait() tell
            return True
        return False

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self, timeout: timedelta | float | None = None) -> None:
        self.wait(timeout)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A completed future (the work is finished first: varcomm has no progress thread)."""
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        try:
            self.wait()
            fut.set_result(self._result)
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the result
        return fut

    def block_current_stream(self) -> None:
        self.wait()


def _done(result: Sequence[torch.Tensor] = ()) -> VarcommWork:
    return VarcommWork(None, result=result)


def _all_done(works: Sequence[Any]) -> Callable[[], bool]:
    return lambda: all(w.is_completed() for w in works)


# ---------------------------------------------------------------------------
# making a communicator for a group


def _communicator(store: dist.Store, rank: int, size: int, options: Options) -> Communicator:
    """A Communicator over `size` ranks meeting in `store`."""
    # The group's store is already unique to the group: no instance count.
    return connect(options, rank=rank, world_size=size, store=store, prefix="varcomm/")


def _group_options(backend_options: Any) -> Options:
    """A group's varcomm options: its pg_options, else the default group's, else the environment's."""
    if isinstance(backend_options, Options):
        return backend_options
    if backend_options is not None:
        raise TypeError(f"varcomm backend: pg_options must be a varcomm.Options, not {type(backend_options).__name__}")
    if dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
        if isinstance(pg, VarcommProcessGroup):
            return pg.options
    return Options.resolve()


def _want_nccl(options: Options) -> bool:
    return options.torch_nccl and bool(dist.is_nccl_available() and torch.cuda.is_available())


# ---------------------------------------------------------------------------
# the process group


# A message over the receiver's bound is a descriptor on its tag, then chunks
# of that bound on a tag of their own, which no receive posted later on the
# message's tag can take. The chunk receives are posted when the receive is
# waited, so a receive that may be chunked first finishes every earlier one
# from the same source and tag: chunk receives are then posted in the order the
# messages were sent. Nothing in it is ever cancelled (a cancelled chunk would
# shift every later one): past its deadline a wait raises with the receive
# still posted, and the next wait resumes it.
_CHUNK_TAGS = -(1 << 62)
_chunked: weakref.WeakKeyDictionary[Communicator, dict[tuple[int, int], list[VarcommWork]]] = \
    weakref.WeakKeyDictionary()


class _NotYet(Exception):
    """A resumable wait's deadline passed; its state is kept."""


def _chunk_tag(tag: int) -> int:
    return _CHUNK_TAGS - tag


def _check_tag(tag: int) -> None:
    if not 0 <= tag < 1 << 40:
        raise RuntimeError(f"varcomm backend: tag {tag} is out of range: use a tag in [0, 2**40) (negative tags "
                           "carry the chunks of large messages)")


def _deadline(comm: Communicator, timeout: float | None) -> float | None:
    t = comm._timeout if timeout is None else timeout
    return None if t is None else time.monotonic() + t


def _until_done(works: Sequence[Any], deadline: float | None, what: str) -> None:
    """Wait for `works` without cancelling any: past `deadline`, _NotYet(what)."""
    pause = 2e-5
    for w in works:
        while not w.is_completed():
            if deadline is not None and time.monotonic() >= deadline:
                raise _NotYet(what)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class _ChunkedRecv:
    """One receive that may arrive as a descriptor and chunks: the message's
    header work, then its chunk works once the header is checked. `check(head)`
    returns where the chunks go (a byte view), or raises for a refused message
    after its chunks were taken (into scratch), so none is left for another."""

    def __init__(self, comm: Communicator, src: int, tag: int):
        self.comm, self.src, self.tag = comm, src, tag
        self.head_work = comm.irecv(src, tag)
        self.head: Any = None
        self.chunks: list[Any] | None = None
        self.refusal: BaseException | None = None

    def run(self, deadline: float | None, check: Callable[[Any], torch.Tensor | None]) -> Any:
        what = f"recv from rank {self.src} (tag {self.tag})"
        if self.chunks is None:
            _until_done([self.head_work], deadline, f"{what}: nothing arrived")
            self.head = self.head_work.wait()
            if not (isinstance(self.head, _C.Status) and self.head.descriptor):
                self.chunks = []
            else:
                try:
                    flat = check(self.head)
                except Exception as e:
                    self.refusal, flat = e, None
                b, n = self.comm.bound, self.head.nbytes
                self.chunks = [self.comm.irecv(self.src, _chunk_tag(self.tag),
                                               out=None if flat is None else flat[o:o + b]) for o in range(0, n, b)]
        _until_done(self.chunks, deadline, f"{what}: its chunks did not all arrive")
        for w in self.chunks:
            w.wait()
        if self.refusal is not None:
            raise self.refusal
        return self.head


def _in_order(comm: Communicator, src: int, tag: int, finish: Callable[[float | None], None],
              result: Sequence[torch.Tensor]) -> VarcommWork:
    """A Work running `finish` once the receives from (src, tag) made this way
    before it have finished (their errors stay theirs)."""
    queue = _chunked.setdefault(comm, {}).setdefault((src, tag), [])

    def run(timeout: float | None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        while queue and queue[0] is not work:
            earlier = queue[0]
            try:
                earlier.wait(None if end is None else max(end - time.monotonic(), 0.0))
            except Exception:  # its error is raised again by its own wait
                pass
            if queue and queue[0] is earlier:
                raise _NotYet(f"recv from rank {src} (tag {tag}): an earlier receive from it with this tag is "
                              "still waiting for its message")
        try:
            finish(None if end is None else max(end - time.monotonic(), 0.0))
        except _NotYet:
            raise
        except BaseException:
            queue.remove(work)
            raise
        queue.remove(work)

    work = VarcommWork(run, lambda: True, result, source=src)
    queue.append(work)
    return work


class VarcommProcessGroup(dist.ProcessGroup):
    """One torch.distributed group on varcomm: point-to-point, all-to-all and
    barrier through ``self.comm`` (a varcomm Communicator over the group's
    ranks); every other collective through the per-device backends registered
    underneath (gloo for CPU, NCCL for CUDA)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, *,
                 global_ranks: Sequence[int] | None = None, group_id: str = "", options: Options | None = None):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload is not in torch's stub
        self._rank = rank
        self._size = size
        self._pg_timeout = timeout
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        #: What groups made later without pg_options inherit (before the group's timeout is applied).
        self.options = options if options is not None else Options.resolve()
        self.comm = _communicator(store, rank, size, dataclasses.replace(
            self.options, timeout=timeout.total_seconds() if timeout else None))
        # Each receiver's bound, fixed at set-up: sends chunk by it (it slices by its own).
        self._peer_bounds = [self.comm.peer_bound(q) for q in range(size)]
        self._closed = False
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        _name_backend(self._gloo, self.global_ranks, group_id)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._nccl: Any = None
        if _want_nccl(self.options):
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.is_high_priority_stream = False
            _name_backend(opts, self.global_ranks, group_id, on_options=True)
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, self._nccl)

    # ---- identity -------------------------------------------------------------

    def getBackendName(self) -> str:  # torch's name
        return BACKEND

    def __repr__(self) -> str:
        return f"VarcommProcessGroup(rank={self._rank}, size={self._size}, comm={self.comm!r})"

    def _device_backend(self, t: torch.Tensor, op: str) -> Any:
        """The backend for a tensor varcomm does not carry (not on CPU)."""
        if t.device.type == "cuda" and self._nccl is not None:
            return self._nccl
        raise RuntimeError(f"varcomm backend: {op} of a tensor on {t.device}: varcomm carries CPU tensors here, "
                           "and no NCCL backend was made for this group (needs torch with CUDA and NCCL, and "
                           "VARCOMM_TORCH_NCCL not 0)")

    # ---- point-to-point -------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work:
        t = _single(tensors, "send")
        _check_tag(tag)
        if t.device.type != "cpu":
            return self._device_backend(t, "send").send(tensors, dstRank, tag)
        comm = self.comm
        b = self._peer_bounds[dstRank]
        if t.nbytes <= b:
            works = [comm.isend(t, dstRank, tag)]
        else:  # a descriptor of the whole message, then bound-sized chunks
            flat = _bytes_of(t.contiguous())
            works = [comm.isend_descriptor(dstRank, t.nbytes, dtypes.from_torch(t.dtype), tuple(t.shape), tag)]
            works += [comm.isend(flat[o:o + b], dstRank, _chunk_tag(tag)) for o in range(0, t.nbytes, b)]

        def finish(timeout: float | None) -> None:
            for w in works:
                w.wait(timeout)

        return VarcommWork(finish, _all_done(works), [t])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work:
        t = _single(tensors, "recv")
        _check_tag(tag)
        if t.device.type != "cpu":
            return self._device_backend(t, "recv").recv(tensors, srcRank, tag)
        if getattr(t, _ANY_SHAPE, False):
            return recv_into_placeholder(self.comm, t, srcRank, tag)
        comm, src = self.comm, srcRank
        dst = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)

        def refuse(what: str) -> RuntimeError:
            return RuntimeError(
                f"varcomm backend: recv from rank {src} (tag {tag}) into a tensor of shape {tuple(t.shape)} and "
                f"dtype {t.dtype} ({t.nbytes} bytes): {what}. torch.distributed.recv needs a tensor of exactly the "
                "message's size; to receive a message of unknown size use varcomm.distributed.recv(src=...), "
                "which returns it")

        if t.nbytes <= comm.bound:
            works = [comm.irecv(src, tag, out=dst)]

            def finish(timeout: float | None) -> None:
                try:
                    got = works[0].wait(timeout)
                except MessageTooLarge as e:
                    raise refuse(f"the message is larger ({e})") from e
                except MessageMismatch as e:
                    raise refuse(f"the message has another dtype ({e})") from e
                if got.numel() != t.numel():
                    raise refuse(f"the message has shape {tuple(got.shape)}, {got.nbytes} bytes")
                if dst is not t:
                    with torch.no_grad():
                        t.copy_(dst)
        else:
            rx = _ChunkedRecv(comm, src, tag)  # the descriptor; the chunks are received once it is checked

            def check(head: Any) -> torch.Tensor:
                if head.nbytes != t.nbytes or head.dtype != dtypes.from_torch(t.dtype):
                    raise refuse(f"the message is a {head.nbytes}-byte {dtypes.describe(head.dtype)} tensor of "
                                 f"shape {head.shape}, sent in chunks; it was dropped")
                return _bytes_of(dst)

            def finish(timeout: float | None) -> None:
                head = rx.run(_deadline(comm, timeout), check)
                if not (isinstance(head, _C.Status) and head.descriptor):
                    raise refuse(f"the message has shape {tuple(head.shape)}, {head.nbytes} bytes; it was dropped")
                if dst is not t:
                    with torch.no_grad():
                        t.copy_(dst)

            return _in_order(comm, src, tag, finish, [t])

        return VarcommWork(finish, _all_done(works), [t], source=src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        t = _single(tensors, "recv")
        if t.device.type != "cpu":
            return self._device_backend(t, "recv").recv_anysource(tensors, tag)
        raise RuntimeError("varcomm backend: recv without src (from any source) is not supported; pass src=")

    # ---- all-to-all -------------------------------------------------------------

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # torch's name
                          output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        if opts is None:
            opts = dist.AllToAllOptions()
        if output.device.type != "cpu" or input.device.type != "cpu":
            return self._device_backend(output, "all_to_all_single").alltoall_base(
                output, input, output_split_sizes, input_split_sizes, opts)
        dst = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype)
        w = _a2a.all_to_all_single(self.comm, dst, input, list(output_split_sizes) or None,
                                   list(input_split_sizes) or None, async_op=True)

        def finish(timeout: float | None) -> None:
            w.wait(timeout)
            if dst is not output:
                with torch.no_grad():
                    output.copy_(dst)

        return VarcommWork(finish, None, [output])

    # torch calls it by both names (dist.all_to_all_single; functional collectives)
    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch's stub overloads it

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        if opts is None:
            opts = dist.AllToAllOptions()
        if any(x.device.type != "cpu" for x in [*output_tensors, *input_tensors]):
            return self._device_backend(output_tensors[0], "all_to_all").alltoall(output_tensors, input_tensors, opts)
        dsts = [o if o.is_contiguous() else torch.empty(o.shape, dtype=o.dtype) for o in output_tensors]
        w = _a2a.all_to_all(self.comm, list(dsts), list(input_tensors), async_op=True)

        def finish(timeout: float | None) -> None:
            w.wait(timeout)
            with torch.no_grad():
                for o, d in zip(output_tensors, dsts):
                    if d is not o:
                        o.copy_(d)

        return VarcommWork(finish, None, list(output_tensors))

    # ---- everything else: gloo (CPU) or NCCL (CUDA) ------------------------------
    # Each collective is delegated here, in Python, rather than left to torch's
    # C++ ProcessGroup, which would dispatch to the registered backend while
    # holding the GIL: a gloo worker freeing a finished work's tensors needs
    # the GIL under its queue lock, and that deadlocks against the next enqueue.
    # Calling the backend's own binding releases the GIL first.

    def _delegate(self, name: str, args: tuple[Any, ...]) -> dist.Work:
        t = _first_tensor(args)
        backend = self._gloo if t is None or t.device.type == "cpu" else self._device_backend(t, name)
        return getattr(backend, name)(*args)

    def allreduce(self, *args: Any) -> dist.Work:
        return self._delegate("allreduce", args)

    def allreduce_coalesced(self, *args: Any) -> dist.Work:
        return self._delegate("allreduce_coalesced", args)

    def allgather(self, *args: Any) -> dist.Work:
        return self._delegate("allgather", args)

    def allgather_coalesced(self, *args: Any) -> dist.Work:
        return self._delegate("allgather_coalesced", args)

    def _allgather_base(self, *args: Any) -> dist.Work:
        return self._delegate("_allgather_base", args)

    all_gather_single = _allgather_base  # type: ignore[assignment]  # *args: delegated as given

    def reduce_scatter(self, *args: Any) -> dist.Work:
        return self._delegate("reduce_scatter", args)

    def _reduce_scatter_base(self, *args: Any) -> dist.Work:
        return self._delegate("_reduce_scatter_base", args)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]  # *args: delegated as given

    def reduce(self, *args: Any) -> dist.Work:
        return self._delegate("reduce", args)

    def broadcast(self, *args: Any) -> dist.Work:
        return self._delegate("broadcast", args)

    def gather(self, *args: Any) -> dist.Work:
        return self._delegate("gather", args)

    def scatter(self, *args: Any) -> dist.Work:
        return self._delegate("scatter", args)

    def monitored_barrier(self, *args: Any) -> Any:
        return self._gloo.monitored_barrier(*args)  # type: ignore[attr-defined]  # not in torch's stub

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._coalesced("_allgather_base", "allgather_into_tensor_coalesced", outputs, inputs, opts,
                               dist.AllgatherOptions)  # type: ignore[attr-defined]  # not in torch's stub

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]  # torch's parameter names

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._coalesced("_reduce_scatter_base", "reduce_scatter_tensor_coalesced", outputs, inputs, opts,
                               dist.ReduceScatterOptions)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]  # torch's parameter names

    def _coalesced(self, single: str, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   opts: Any, make_opts: Callable[[], Any]) -> dist.Work:
        """One backend call per tensor pair, where the backend has no coalesced form (gloo)."""
        opts = make_opts() if opts is None else opts
        t = _first_tensor((outputs, inputs))
        backend = self._gloo if t is None or t.device.type == "cpu" else self._device_backend(t, name)
        if hasattr(backend, name):
            return getattr(backend, name)(outputs, inputs, opts)
        works = [getattr(backend, single)(o, i, opts) for o, i in zip(outputs, inputs)]

        def finish(timeout: float | None) -> None:
            for w in works:
                w.wait()

        return VarcommWork(finish, _all_done(works), list(outputs))

    # ---- barrier and lifetime ---------------------------------------------------

    def barrier(self, opts: Any = None) -> dist.Work:
        self.comm.barrier()
        return _done()

    def shutdown(self) -> None:
        self._close()
        super().shutdown()

    def abort(self) -> None:
        self._close()
        super().abort()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.comm.close()
            except (VarcommError, RuntimeError, OSError):
                pass  # the store's host (rank 0) may be gone already: nothing left to tell


_ANY_SHAPE = "_varcomm_any_shape"


def placeholder(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> torch.Tensor:
    """An empty CPU tensor that ``dist.recv``/``dist.irecv`` (and ``batch_isend_irecv``)
    on a varcomm group fill with a message of any shape: once the receive is
    complete (``wait()``), this same tensor object holds the message, with the
    sender's shape and dtype (its ``.data`` is set to it; ``requires_grad`` is
    kept). No shape message, no size known in advance. ``dtype`` and
    ``requires_grad`` are the tensor's until then (what autograd or a dtype
    check sees before the wait); the message's dtype wins. A message over
    varcomm's bound arrives as a descriptor and chunks, as for any receive of
    this backend (the chunks on their own tag, received in message order
    whichever receive is waited first)."""
    t = torch.empty(0, dtype=dtype, requires_grad=requires_grad)
    setattr(t, _ANY_SHAPE, True)
    return t


def recv_into_placeholder(comm: Communicator, t: torch.Tensor, src: int, tag: int = 0) -> VarcommWork:
    """Post a receive from ``src`` on ``comm`` that fills ``t`` (a placeholder())
    with the message when waited: ``t.data`` becomes the received tensor, of
    the sender's shape, dtype and device (a GPU tensor sent from GPU memory
    arrives on this rank's GPU)."""
    _check_tag(tag)
    rx = _ChunkedRecv(comm, src, tag)
    whole: list[torch.Tensor] = []

    def check(head: Any) -> torch.Tensor:  # a descriptor: the data follows in chunks
        whole.append(torch.empty(tuple(head.shape), dtype=dtypes.to_torch(head.dtype)))
        return _bytes_of(whole[0])

    def finish(timeout: float | None) -> None:
        got = rx.run(_deadline(comm, timeout), check)
        if whole:
            got = whole[0]
        # .data: the tensor object the caller holds (its requires_grad, its attributes) now is the message
        t.data = got if isinstance(got, torch.Tensor) else torch.from_numpy(got)

    return _in_order(comm, src, tag, finish, [t])


def _name_backend(obj: Any, global_ranks: list[int], group_id: str, on_options: bool = False) -> None:
    """What torch sets on the backends it makes itself (flight recorder, debug output)."""
    opts = obj if on_options else getattr(obj, "options", None)
    for attr, value in (("global_ranks_in_group", global_ranks), ("group_name", group_id)):
        try:
            setattr(opts, attr, value)
        except (AttributeError, TypeError, RuntimeError):
            pass


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _single(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise RuntimeError(f"varcomm backend: {op} takes exactly one tensor, got {len(tensors)}")
    return tensors[0]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (shares it)."""
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# ---------------------------------------------------------------------------
# registration


def _create(opts: Any, backend_options: Any = None) -> VarcommProcessGroup:
    return VarcommProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                               global_ranks=list(opts.global_ranks_in_group or []), group_id=str(opts.group_id),
                               options=_group_options(backend_options))


_registered = False


def register() -> None:
    """Register the ``"varcomm"`` backend with torch.distributed (idempotent).

    Under mpirun or srun it also sets torch's env:// variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) from the launcher's, where
    unset (varcomm.bootstrap.LAUNCHERS): torch reads them in
    ``init_process_group`` before any backend is asked."""
    global _registered
    if not _registered:
        bootstrap.export_for_torch()
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def comm_of(group: dist.ProcessGroup | None = None) -> Communicator:
    """The varcomm Communicator of a torch.distributed group on the varcomm
    backend (default: the default group). Its ranks are the group's ranks."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, VarcommProcessGroup):
        raise ValueError(f"group {pg!r} is not on the varcomm backend (init_process_group('varcomm'))")
    return pg.comm


register()
