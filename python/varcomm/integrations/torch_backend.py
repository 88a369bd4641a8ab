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
message of another size or dtype is refused with an error naming both, before
anything is written, and kept for the next receive; a non-contiguous tensor
receives the same way, through a contiguous copy (never a cast). The
variable-size forms (receive without knowing the size) are in
``varcomm.distributed``. A message of any size travels: over varcomm's
receive bound (``VARCOMM_BOUND``) the core sends it by rendezvous (README,
"Large messages"), as for every varcomm send.

``dist.batch_isend_irecv`` of CPU tensors on one varcomm group is one
``Communicator.batch_isend_irecv``: every op is checked before any is posted
(a bad one posts nothing), and receives are posted before sends. Importing
this module puts ``batch_isend_irecv`` below in place of torch's for that
(torch hands a batch to no ProcessGroup subclass); every other batch goes to
torch's as before.

Each group's keys in the store torch hands the backend are under a prefix of
their own per incarnation of the group (``_generation``), so init, destroy and
init again on a store that outlives the group (``store=``, torchrun's agent
store) does not meet the keys the earlier group left.

varcomm's options come from the environment, or from a ``varcomm.Options``
passed as ``pg_options`` (``dist.init_process_group("varcomm",
pg_options=varcomm.Options.resolve(bound=...))``); groups made later without
one take the default group's. The wait timeout is varcomm's ``timeout`` where
one is set (``VARCOMM_TIMEOUT``, or ``pg_options``), else the group's
``timeout`` (torch's default: 30 minutes).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, cast

import numpy as np
import torch
import torch.distributed as dist

from .. import _C, bootstrap
from ..collectives import alltoall as _a2a
from ..comm import Communicator, P2POp, connect, rank_int
from ..errors import InvalidArgument, MessageMismatch, MessageTooLarge, VarcommError
from ..options import Options

BACKEND = "varcomm"

__all__ = ["BACKEND", "VarcommProcessGroup", "VarcommWork", "register", "comm_of", "placeholder",
           "recv_into_placeholder", "batch_isend_irecv"]


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
            secs = _seconds(timeout)
            _C.check_timeout(secs)  # a bad one is refused with the Work still pending
            f, self._finish = self._finish, None
            try:
                f(secs)
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
    """A Communicator over `size` ranks meeting in `store` (one of _generation's)."""
    return connect(options, rank=rank, world_size=size, store=store, prefix="comm/")


def _generation(store: dist.Store, rank: int) -> dist.Store:
    """The part of a group's store that this incarnation of the group owns.

    torch names groups by a count that destroy_process_group resets, so a group
    made after a destroy gets the same store prefix as the one before it; and
    the store itself may outlive both (a store= passed to each init, torchrun's
    agent store). Keys the earlier group left there would then be read as this
    one's (a rank "arriving twice", stale gloo addresses). Each rank counts the
    groups it made in this store, in the store, so the n-th group every rank
    makes here gets the same fresh prefix, whatever the process."""
    n = int(store.add(f"varcomm/generations/{rank}", 1))
    return dist.PrefixStore(f"varcomm/{n}/", store)


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


_DEFAULT_TIMEOUT = next(f.default for f in dataclasses.fields(Options) if f.name == "timeout")


def _wait_timeout(options: Options, group_timeout: timedelta | None) -> float | None:
    """varcomm's `timeout` where one was set (VARCOMM_TIMEOUT or pg_options,
    600 included), else the group's (init_process_group's
    timeout=, torch's 30 min by default): VARCOMM_TIMEOUT=3 was silently
    ignored, a stuck peer held a recv for torch's 30 minutes."""
    if "timeout" in options.given() or options.timeout != _DEFAULT_TIMEOUT:
        return options.timeout
    return group_timeout.total_seconds() if group_timeout else None


def _want_nccl(options: Options) -> bool:
    return options.torch_nccl and bool(dist.is_nccl_available() and torch.cuda.is_available())


# ---------------------------------------------------------------------------
# the process group


def _check_tag(tag: int) -> None:
    if not 0 <= tag < 1 << 40:
        raise RuntimeError(f"varcomm backend: tag {tag} is out of range: use a tag in [0, 2**40)")


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
        store = _generation(store, rank)
        self.comm = _communicator(store, rank, size, self.options.replaced(
            timeout=_wait_timeout(self.options, timeout)))
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
        works = [self.comm.isend(t, dstRank, tag)]  # any size: the core takes it by rendezvous over the bound

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
        dst, work = _exact_recv(t, srcRank, tag)
        return work(self.comm.irecv(srcRank, tag, out=dst, exact=True))

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[dist.Work]:
        """torch.distributed.batch_isend_irecv on this group (CPU tensors; see
        register()): one Communicator.batch_isend_irecv, which checks every op
        before it posts any and posts the receives first. Each op means what
        dist.isend/irecv would: a placeholder() takes a message of any shape,
        another tensor exactly its own size, complex tensors as their real view."""
        posts: list[P2POp] = []
        makers: list[Callable[[Any], VarcommWork]] = []
        # The class's methods: batch_isend_irecv accepts those, and an instance
        # attribute (a spy, instrumentation) may shadow them on self.comm.
        isend, irecv = types.MethodType(Communicator.isend, self.comm), types.MethodType(Communicator.irecv, self.comm)
        for op in ops:
            t = op.tensor
            if t.is_complex():
                t = torch.view_as_real(t)
            peer = _group_peer(op, self)
            _check_tag(op.tag)
            if op.op is dist.isend:
                posts.append(P2POp(isend, t, peer, op.tag))
                makers.append(functools.partial(_send_work, tensor=t))
            elif getattr(t, _ANY_SHAPE, False):
                posts.append(P2POp(irecv, None, peer, op.tag))
                makers.append(functools.partial(_fill_placeholder, t=t, src=peer, tag=op.tag))
            else:
                dst, work = _exact_recv(t, peer, op.tag)
                posts.append(P2POp(irecv, dst, peer, op.tag, exact=True))
                makers.append(work)
        works = self.comm.batch_isend_irecv(posts)
        return [make(w) for make, w in zip(makers, works)]

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
        if dst is not output:
            def copy_in(_: Any) -> None:
                with torch.no_grad():
                    output.copy_(dst)

            # the Work's own: dropped unwaited, it still fills output (it was left unwritten)
            w = cast(_a2a.AllToAllWork, w)._then(copy_in)
        # poll: is_completed() turns True once every pair's data is in (without
        # it a loop polling is_completed() never ended: it stayed False until wait)
        return VarcommWork(w.wait, w.is_completed, [output])

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

        def copy_in(got: Any) -> Any:
            with torch.no_grad():
                for o, d in zip(output_tensors, dsts):
                    if d is not o:
                        o.copy_(d)
            return got

        if any(d is not o for o, d in zip(output_tensors, dsts)):
            w = cast(_a2a.AllToAllWork, w)._then(copy_in)  # as all_to_all_single's
        return VarcommWork(w.wait, w.is_completed, list(output_tensors))

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
    check sees before the wait); the message's dtype wins. Any size travels
    (over varcomm's bound by rendezvous, in the core). Only for groups of the
    varcomm backend: another backend sees an empty tensor (gloo aborts the
    process on a message that does not fit it)."""
    t = torch.empty(0, dtype=dtype, requires_grad=requires_grad)
    setattr(t, _ANY_SHAPE, True)
    return t


def recv_into_placeholder(comm: Communicator, t: torch.Tensor, src: int, tag: int = 0) -> VarcommWork:
    """Post a receive from ``src`` on ``comm`` that fills ``t`` (a placeholder())
    with the message when waited: ``t.data`` becomes the received tensor, of
    the sender's shape, dtype and device (a GPU tensor sent from GPU memory
    arrives on this rank's GPU)."""
    _check_tag(tag)
    return _fill_placeholder(comm.irecv(src, tag), t, src, tag)


def _send_work(w: Any, tensor: torch.Tensor) -> VarcommWork:
    return VarcommWork(w.wait, w.is_completed, [tensor])


def _fill_placeholder(w: Any, t: torch.Tensor, src: int, tag: int) -> VarcommWork:
    """The VarcommWork of a posted receive without out= whose message becomes placeholder t."""

    def finish(timeout: float | None) -> None:
        got = w.wait(timeout)
        if not isinstance(got, (torch.Tensor, np.ndarray)):
            raise RuntimeError(f"varcomm backend: recv from rank {src} (tag {tag}) into a placeholder got a "
                               f"descriptor of {got.nbytes} bytes, which carries no data")
        # .data: the tensor object the caller holds (its requires_grad, its attributes) now is the message
        t.data = got if isinstance(got, torch.Tensor) else torch.from_numpy(got)

    return VarcommWork(finish, w.is_completed, [t], source=src)


def _exact_recv(t: torch.Tensor, src: int, tag: int) -> tuple[torch.Tensor, Callable[[Any], VarcommWork]]:
    """torch.distributed.recv's contract for a receive into `t`: where to post
    it (with exact=True) and how its Work finishes.

    The core writes contiguous memory only, so a strided `t` receives into a
    contiguous tensor of its shape and dtype, copied into `t` once the message
    is in. The core's exact match (same dtype, same number of bytes) refuses
    any other message before it is consumed, so a refused one is kept for the
    next receive and `t` is left as it was; nothing is ever cast."""
    dst = t if t.is_contiguous() else strided_stand_in(t, f"recv from rank {src}")

    def refuse(what: str) -> RuntimeError:
        return RuntimeError(
            f"varcomm backend: recv from rank {src} (tag {tag}) into a tensor of shape {tuple(t.shape)} and "
            f"dtype {t.dtype} ({t.nbytes} bytes): {what}. torch.distributed.recv needs a tensor of exactly the "
            "message's dtype and size (nothing is cast); to receive a message whose dtype or size the receiver "
            "does not know, use varcomm.distributed.recv(src=...), which returns it as sent")

    def copy_in(got: Any) -> Any:
        if isinstance(got, torch.Tensor):
            with torch.no_grad():
                t.copy_(dst)
        return got

    def work(w: Any) -> VarcommWork:
        if dst is not t:
            w = w._then(copy_in)  # the Work's own: dropped unwaited, it still runs once the message is in

        def finish(timeout: float | None) -> None:
            try:
                got = w.wait(timeout)
            except MessageTooLarge as e:
                raise refuse(f"the message is larger ({e})") from e
            except MessageMismatch as e:
                raise refuse(f"the message does not match it ({e})") from e
            if not isinstance(got, torch.Tensor):  # a descriptor's Status: it carries no data
                raise refuse(f"the message is a descriptor of {got.nbytes} bytes")

        return VarcommWork(finish, w.is_completed, [t], source=src)

    return dst, work


def strided_stand_in(t: torch.Tensor, what: str) -> torch.Tensor:
    """The contiguous tensor a receive into strided `t` lands in (then copied
    into `t`). A `t` whose elements share memory (an expand()ed view) is
    refused first: the copy in would fail after the message was consumed."""
    if torch._debug_has_internal_overlap(t) == 1:
        raise InvalidArgument(f"{what}: the tensor of shape {tuple(t.shape)} and strides {t.stride()} has elements "
                              "that share memory (an expand()ed or as_strided view), so it cannot hold a message; "
                              "receive into t.clone() or a tensor that owns its elements")
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _group_peer(op: dist.P2POp, group: dist.ProcessGroup) -> int:
    """A P2POp's peer as a rank of its group (torch before 2.6 has only the global peer)."""
    peer = getattr(op, "group_peer", None)
    if peer is not None:
        return rank_int(peer, "P2POp group_peer")
    return dist.get_group_rank(group, rank_int(op.peer, "P2POp peer"))


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


# ---------------------------------------------------------------------------
# registration


def _create(opts: Any, backend_options: Any = None) -> VarcommProcessGroup:
    return VarcommProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                               global_ranks=list(opts.global_ranks_in_group or []), group_id=str(opts.group_id),
                               options=_group_options(backend_options))


_registered = False
_torch_batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv


@functools.wraps(_torch_batch_isend_irecv)
def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    # torch hands a batch to its backend only where the group is exactly a
    # ProcessGroup whose backend coalesces (NCCL); a ProcessGroup subclass, as
    # varcomm's is, gets one isend/irecv call per op, in list order, and an op
    # that fails leaves the ones before it posted. A batch of CPU tensors on one
    # varcomm group goes to the group as one call instead.
    pg = _batch_group(p2p_op_list)
    if pg is None:  # torch's own: other groups, other devices, and its refusals (mixed groups, not P2POps)
        return _torch_batch_isend_irecv(p2p_op_list)
    return pg.batch_isend_irecv(p2p_op_list)


def _batch_group(ops: Any) -> VarcommProcessGroup | None:
    """The varcomm group a batch_isend_irecv runs on whole, else None."""
    if not isinstance(ops, list) or not ops or not all(isinstance(op, dist.P2POp) for op in ops):
        return None
    group = ops[0].group
    if any(op.group != group for op in ops):
        return None
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, VarcommProcessGroup):
        return None
    tensors = [op.tensor for op in ops]
    if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in tensors):
        return None
    if torch.overrides.has_torch_function(tensors):  # a tensor subclass dispatches it itself, as in dist.isend
        return None
    return pg


def register() -> None:
    """Register the ``"varcomm"`` backend with torch.distributed (idempotent).

    Under mpirun or srun it also sets torch's env:// variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) from the launcher's, where
    unset (varcomm.bootstrap.LAUNCHERS): torch reads them in
    ``init_process_group`` before any backend is asked.

    It also puts this module's ``batch_isend_irecv`` in place of
    ``torch.distributed.batch_isend_irecv``: on a varcomm group it posts the
    batch as one call; anything else is handed to torch's unchanged. A
    reference taken before this import keeps calling torch's, which works on
    varcomm too, one op at a time."""
    global _registered
    if not _registered:
        bootstrap.export_for_torch()
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
        dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
        _registered = True


def comm_of(group: dist.ProcessGroup | None = None) -> Communicator:
    """The varcomm Communicator of a torch.distributed group on the varcomm
    backend (default: the default group). Its ranks are the group's ranks."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, VarcommProcessGroup):
        raise ValueError(f"group {pg!r} is not on the varcomm backend (init_process_group('varcomm'))")
    return pg.comm


register()
