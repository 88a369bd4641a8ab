"""torch.distributed's point-to-point and all-to-all functions over varcomm,
under the same names, plus the variable-size forms torch cannot offer::

    import varcomm.distributed as dist      # was: import torch.distributed as dist

    dist.init_process_group("nccl")          # any backend name: torch.distributed runs on "varcomm"
    dist.send(x, dst=1)                      # x of any shape: the shape travels with the data
    y = dist.recv(src=0)                     # extension: returns the tensor, sized by the sender
    y = dist.recv(buf, src=0)                # buf is a bound: y is a prefix view of it, with the sender's shape
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, None, 0)])
    y = works[1].wait()                      # an irecv's wait() returns the received tensor
    out, splits = dist.all_to_all_v(x, send_splits)   # extension: no count exchange
    dist.all_reduce(g)                       # anything else is torch.distributed's (gloo/NCCL underneath)

It is a thin module over one global varcomm Communicator: the default group's
when ``init_process_group`` starts torch.distributed on the ``"varcomm"``
backend (the usual case), or one made from torch's default store when
torch.distributed was already started with another backend, or a standalone
one (``init_process_group(torch_distributed=False)``). Functions with
``group=`` accept groups of the ``"varcomm"`` backend (``new_group``, DeviceMesh)
and use that group's Communicator; ranks are global as in torch, or group
ranks with ``group_dst``/``group_src``/``group_peer``.

Differences from torch.distributed: ``recv`` returns the received tensor (not
the source rank) and accepts a larger contiguous tensor (a bound; a
non-contiguous one takes exactly its dtype and size); ``irecv(...).wait()``
returns the received tensor and ``isend(...).wait()`` returns None (varcomm
Works); receiving from any source (``src=None``) is not supported.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, cast, overload

import torch
import torch.distributed as _tdist

from .. import bootstrap
from ..arrays import Array, Splits
from ..collectives import alltoall as _a2a
from ..comm import Communicator, P2PWork, connect, rank_int
from ..comm import P2POp as _C2POp
from ..errors import InvalidArgument, MessageMismatch, MessageTooLarge
from ..options import Options
from ..work import Work
from . import torch_backend as _tb

if TYPE_CHECKING:
    from .._C import Status

#: A torch.distributed group (None: the default group).
Group = _tdist.ProcessGroup

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank", "get_world_size", "get_comm",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "all_to_all_single", "all_to_all",
    "all_to_all_v", "barrier",
]

_comm: Communicator | None = None
_started_torch = False  # this module started torch.distributed (and stops it)
_own_comm = False  # the global communicator is ours to close (not a torch group's)

def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: timedelta | None = None,
                       world_size: int = -1, rank: int = -1, store: _tdist.Store | None = None, group_name: str = "",
                       pg_options: Options | None = None, device_id: torch.device | int | None = None, *,
                       torch_distributed: bool = True, **varcomm_options: Any) -> None:
    """Start torch.distributed on the ``"varcomm"`` backend (whatever ``backend``
    names: gloo and NCCL still run the collectives varcomm does not have) and
    take its default group's Communicator as the global one.

    If torch.distributed is already running, it is kept: its default group's
    Communicator is used when it is on varcomm, else a Communicator is made
    from its store. ``torch_distributed=False``: only a varcomm Communicator
    (``varcomm.init(rank=, world_size=, store=, bound=, ...)``), no torch.distributed.
    varcomm_options: fields of varcomm.Options (bound=, slots=, transport=, ...;
    default: the VARCOMM_* environment); or pg_options=varcomm.Options(...)."""
    global _comm, _started_torch, _own_comm
    if _comm is not None:
        raise RuntimeError("varcomm.distributed is already initialized; call destroy_process_group() first")
    del backend  # every backend name means: varcomm, with gloo/NCCL underneath for the rest
    opts = _options(pg_options, varcomm_options)
    if not torch_distributed:
        _comm = connect(opts, rank=None if rank < 0 else rank, world_size=None if world_size < 0 else world_size,
                        store=store)
        _own_comm = True
        return
    if _tdist.is_initialized():
        pg = _tdist.distributed_c10d._get_default_group()
        if isinstance(pg, _tb.VarcommProcessGroup):
            _comm = pg.comm
        else:
            store = _tdist.PrefixStore("varcomm.distributed/", _tdist.distributed_c10d._get_default_store())
            rank = _tdist.get_rank()
            _comm = _tb._communicator(_tb._generation(store, rank), rank, _tdist.get_world_size(), opts)
            _own_comm = True
        return
    if init_method is None and store is None:
        # Meet as varcomm.init() does: any launcher's variables (mpirun,
        # srun, torchrun), the store on MASTER_ADDR's own address, and a
        # rendezvous that names what is missing.
        p = bootstrap.placement(None if rank < 0 else rank, None if world_size < 0 else world_size)
        store, _ = bootstrap.make_store(p, None, opts.timeout, opts.init_timeout, job_key=opts.job_key)
        rank, world_size = p.rank, p.world_size
    kwargs: dict[str, Any] = {"init_method": init_method, "world_size": world_size, "rank": rank, "store": store,
                              "group_name": group_name, "pg_options": opts, "device_id": device_id}
    if timeout is not None:
        kwargs["timeout"] = timeout
    _tdist.init_process_group(_tb.BACKEND, **kwargs)
    _started_torch = True
    _comm = _tb.comm_of(None)


def _options(pg_options: Options | None, overrides: dict[str, Any]) -> Options:
    """varcomm's options: pg_options (a varcomm.Options) or the environment's, then the keywords."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options must be a varcomm.Options, not {type(pg_options).__name__}")
    base = pg_options if pg_options is not None else Options.resolve()
    return base.override(keyword_origin="init_process_group", **overrides)


def destroy_process_group(group: Group | None = None) -> None:
    """Stop what init_process_group started (a group: torch.distributed.destroy_process_group(group))."""
    global _comm, _started_torch, _own_comm
    if group is not None:
        _tdist.destroy_process_group(group)
        return
    comm, own, started = _comm, _own_comm, _started_torch
    _comm, _own_comm, _started_torch = None, False, False
    if own and comm is not None:
        comm.close()
    if started and _tdist.is_initialized():
        _tdist.destroy_process_group()


def is_initialized() -> bool:
    """Whether the functions here have a default group (their own
    init_process_group's, or torch.distributed's on the varcomm backend)."""
    return _comm is not None or _torch_default() is not None


def _torch_default() -> Communicator | None:
    """torch.distributed's default group's communicator, when it is on varcomm."""
    if _tdist.is_initialized() and isinstance(pg := _tdist.distributed_c10d._get_default_group(),
                                              _tb.VarcommProcessGroup):
        return pg.comm
    return None


def get_comm(group: Group | None = None) -> Communicator:
    """The varcomm Communicator behind ``group`` (default: the global one)."""
    if group is None:
        if _comm is not None:
            return _comm
        # torch.distributed.init_process_group("varcomm") made the default group ours: use it
        if (comm := _torch_default()) is not None:
            return comm
        raise RuntimeError("varcomm.distributed is not initialized: call varcomm.distributed.init_process_group(), "
                           "or torch.distributed.init_process_group('varcomm')")
    if isinstance(group, _tb.VarcommProcessGroup):
        return group.comm
    if group is _tdist.GroupMember.NON_GROUP_MEMBER:  # type: ignore[comparison-overlap]  # new_group() gives ranks outside it this
        raise ValueError("this rank is not a member of the group (new_group() returned it GroupMember."
                         "NON_GROUP_MEMBER): only the group's ranks may use it")
    raise ValueError(f"group {group!r} is not on the varcomm backend: make it with new_group() (or a DeviceMesh) "
                     "after init_process_group()")


def get_rank(group: Group | None = None) -> int:
    return get_comm(group).rank if group is None else _tdist.get_rank(group)


def get_world_size(group: Group | None = None) -> int:
    return get_comm(group).world_size if group is None else _tdist.get_world_size(group)


def _peer(group: Group | None, peer: int | None, group_peer: int | None, what: str) -> tuple[Communicator, int]:
    if peer is None and group_peer is None:
        raise ValueError(f"{what} is required: a send names its destination" if what == "dst" else
                         f"{what} is required: a receive names its source (from any source is not supported)")
    comm = get_comm(group)
    if group_peer is not None:
        if peer is not None:
            raise ValueError(f"pass {what} or group_{what}, not both")
        return comm, rank_int(group_peer, f"group_{what}")
    assert peer is not None
    if group is None:
        return comm, rank_int(peer, what)
    return comm, _tdist.get_group_rank(group, rank_int(peer, what))


# ---------------------------------------------------------------------------
# point-to-point


def send(tensor: Array, dst: int | None = None, group: Group | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` (any shape, dtype: they travel with it); returns when it may be reused."""
    comm, peer = _peer(group, dst, group_dst, "dst")
    comm.send(tensor, peer, tag)


def recv(tensor: Array | None = None, src: int | None = None, group: Group | None = None, tag: int = 0,
         group_src: int | None = None) -> Array | Status:
    """Receive one message and return it: a new tensor of the sender's shape and
    dtype, or, with ``tensor`` (a bound: at least the message's size, same
    dtype), a view of its front with the sender's shape (a descriptor: its Status).
    A non-contiguous ``tensor`` (a torch tensor) is no bound: the message must
    have its dtype and number of elements, as in torch.distributed.recv, and is
    received into it (and returned); another is refused (MessageMismatch,
    MessageTooLarge) and kept for the next receive."""
    comm, peer = _peer(group, src, group_src, "src")
    if tensor is None or _contiguous(tensor):
        return cast("Array | Status", comm.recv(peer, tag, out=tensor))
    return _CopyInto.post(comm, tensor, peer, tag).wait()


def isend(tensor: Array, dst: int | None = None, group: Group | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Start a send; ``tensor`` must not change until ``wait()``."""
    comm, peer = _peer(group, dst, group_dst, "dst")
    return comm.isend(tensor, peer, tag)


def irecv(tensor: Array | None = None, src: int | None = None, group: Group | None = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Start a receive; ``wait()`` returns the received tensor (as recv does)."""
    comm, peer = _peer(group, src, group_src, "src")
    if tensor is None or _contiguous(tensor):
        return comm.irecv(peer, tag, out=tensor)
    return _CopyInto.post(comm, tensor, peer, tag)


class P2POp:
    """torch.distributed.P2POp's shape: ``op`` is this module's isend or irecv
    (torch.distributed's are accepted too); for irecv, ``tensor`` may be None."""

    def __init__(self, op: Callable[..., Any], tensor: Array | None, peer: int | None = None,
                 group: Group | None = None, tag: int = 0, group_peer: int | None = None):
        self.op: Callable[..., Work]
        if op in (isend, _tdist.isend):
            self.op = isend
        elif op in (irecv, _tdist.irecv):
            self.op = irecv
        else:
            raise ValueError("P2POp.op must be isend or irecv")
        if tensor is None and self.op is isend:
            raise ValueError("P2POp(isend, ...) needs a tensor")
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        t = None if self.tensor is None else tuple(self.tensor.shape)
        return f"P2POp({self.op.__name__}, {t}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every op at once, as one Communicator.batch_isend_irecv: every op is
    checked before any is posted (a bad one posts nothing) and receives go
    first, so rings cannot deadlock. Each op means what isend/irecv would.
    All ops must be on one group, as in torch (ValueError otherwise). The
    works come back in the list's order."""
    ops = list(p2p_op_list)
    for op in ops:
        if not isinstance(op, P2POp):
            raise TypeError(f"batch_isend_irecv takes varcomm.distributed.P2POp, got {type(op).__name__}")
    if not ops:
        return []
    comm = get_comm(ops[0].group)
    if any(get_comm(op.group) is not comm for op in ops[1:]):
        raise ValueError("batch_isend_irecv: all ops need to use the same group (one communicator carries a "
                         "batch); split the list into one batch per group")
    posts: list[_C2POp] = []
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # The class's methods: batch_isend_irecv accepts those, and an instance
    # attribute (a spy, instrumentation) may shadow them on comm.
    c_isend, c_irecv = types.MethodType(Communicator.isend, comm), types.MethodType(Communicator.irecv, comm)
    for i, op in enumerate(ops):
        recv = op.op is irecv
        _, peer = _peer(op.group, op.peer, op.group_peer, "src" if recv else "dst")
        if not recv:
            posts.append(_C2POp(c_isend, op.tensor, peer, op.tag))
        elif op.tensor is None or _contiguous(op.tensor):
            posts.append(_C2POp(c_irecv, op.tensor, peer, op.tag))
        else:
            t = cast(torch.Tensor, op.tensor)
            copies[i] = (t, _contiguous_like(t))
            posts.append(_C2POp(c_irecv, copies[i][1], peer, op.tag, exact=True))
    works = comm.batch_isend_irecv(posts)
    return [_CopyInto.of(w, *copies[i]) if i in copies else w for i, w in enumerate(works)]


# ---------------------------------------------------------------------------
# all-to-all


@overload
def all_to_all_single(output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None,
                      group: Group | None = None, async_op: Literal[False] = False) -> None: ...
@overload
def all_to_all_single(output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None,
                      group: Group | None = None, *, async_op: Literal[True]) -> Work: ...
@overload
def all_to_all_single(output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None,
                      group: Group | None = None, async_op: bool = False) -> Work | None: ...
def all_to_all_single(output: Array, input: Array,  # torch's name
                      output_split_sizes: Splits | None = None, input_split_sizes: Splits | None = None,
                      group: Group | None = None, async_op: bool = False) -> Work | None:
    """torch.distributed.all_to_all_single over varcomm (each chunk one message)."""
    comm = get_comm(group)
    return _a2a.all_to_all_single(comm, output, input, output_split_sizes, input_split_sizes, async_op=async_op)


@overload
def all_to_all(output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               group: Group | None = None, async_op: Literal[False] = False) -> list[Array]: ...
@overload
def all_to_all(output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               group: Group | None = None, *, async_op: Literal[True]) -> Work: ...
@overload
def all_to_all(output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               group: Group | None = None, async_op: bool = False) -> list[Array] | Work: ...
def all_to_all(output_tensor_list: list[Array | None] | None, input_tensor_list: Sequence[Array],
               group: Group | None = None, async_op: bool = False) -> list[Array] | Work:
    """torch.distributed.all_to_all over varcomm; outputs may be None (allocated
    from the arriving shapes) and the list is returned."""
    comm = get_comm(group)
    return _a2a.all_to_all(comm, output_tensor_list, input_tensor_list, async_op=async_op)


@overload
def all_to_all_v(input: Array, send_splits: Splits, group: Group | None = None,  # torch's name
                 async_op: Literal[False] = False, out: Array | None = None) -> tuple[Array, list[int]]: ...
@overload
def all_to_all_v(input: Array, send_splits: Splits, group: Group | None = None,  # torch's name
                 *, async_op: Literal[True], out: Array | None = None) -> Work: ...
@overload
def all_to_all_v(input: Array, send_splits: Splits, group: Group | None = None,  # torch's name
                 async_op: bool = False, out: Array | None = None) -> tuple[Array, list[int]] | Work: ...
def all_to_all_v(input: Array, send_splits: Splits, group: Group | None = None,  # torch's name
                 async_op: bool = False, out: Array | None = None) -> tuple[Array, list[int]] | Work:
    """Variable-size all-to-all: rows ``input[off[d]:off[d] + send_splits[d]]``
    go to rank d; returns ``(received, recv_splits)`` (the chunks from every
    rank, concatenated in rank order, and their row counts) with no count
    exchange: each chunk's shape travels in its message. ``out``: optional
    bound-sized buffer (the result is a view of its front)."""
    return _a2a.all_to_all_v(get_comm(group), input, send_splits, out=out, async_op=async_op)


def barrier(group: Group | None = None, async_op: bool = False) -> Work | None:
    get_comm(group).barrier()
    return _Done(None) if async_op else None


# ---------------------------------------------------------------------------
# helpers


def _contiguous(t: Array) -> bool:
    return bool(t.is_contiguous()) if isinstance(t, torch.Tensor) else bool(getattr(t, "flags", {"C": True})["C"])



def _contiguous_like(t: Array) -> torch.Tensor:
    """Where a receive into non-contiguous `t` lands: the core writes contiguous memory only."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"recv into a non-contiguous {type(t).__name__}: pass a contiguous array (a bound), "
                              "a torch tensor, or none")
    return _tb.strided_stand_in(t, "recv")


class _CopyInto:
    """A pending receive into a non-contiguous tensor (a varcomm.Work): posted
    with exact=True into a contiguous tensor of its shape and dtype, so any
    other message is refused by the core and kept (never cast); copied in on
    wait()."""

    def __init__(self, work: Work, tensor: torch.Tensor):
        self._work, self._tensor = work, tensor
        self._result: torch.Tensor | None = None

    @classmethod
    def post(cls, comm: Communicator, tensor: Array, peer: int, tag: int) -> _CopyInto:
        landed = _contiguous_like(tensor)
        return cls.of(comm.irecv(peer, tag, out=landed, exact=True), cast(torch.Tensor, tensor), landed)

    @classmethod
    def of(cls, work: Work, t: torch.Tensor, landed: torch.Tensor) -> _CopyInto:
        """The receive `work` into `landed`, copied on into `t`."""
        def copy_in(_: Any) -> torch.Tensor:
            with torch.no_grad():
                t.copy_(landed)
            return t

        # The copy in is the Work's own: dropped unwaited, it still runs (once the message is in).
        return cls(cast(P2PWork, work)._then(copy_in), t)

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._result is None:
            try:
                self._result = self._work.wait(timeout)
            except (MessageMismatch, MessageTooLarge) as e:
                t = self._tensor
                err = type(e)(f"recv into a non-contiguous tensor of shape {tuple(t.shape)} and dtype {t.dtype} "
                              f"({t.nbytes} bytes), which takes a message of exactly its dtype and size: {e}")
                err.peer = e.peer
                raise err from e
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work.is_completed()

    def synchronize(self, timeout: float | None = None) -> torch.Tensor:
        result = self.wait(timeout)  # first: a refusal is raised as wait() words it
        self._work.synchronize(timeout)
        return result

    def result(self) -> torch.Tensor:
        return self.wait()


class _Done:
    """An operation that finished when it was posted (a varcomm.Work)."""

    def __init__(self, result: Any):
        self._result = result

    def wait(self, timeout: float | None = None) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True

    def synchronize(self, timeout: float | None = None) -> Any:
        return self._result

    def result(self) -> Any:
        return self._result


class _TorchSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import varcomm.distributed.X`` (``from varcomm.distributed.pipelining
    import ...``) is torch.distributed.X, the same module object, as
    ``varcomm.distributed.X`` the attribute is. Without it the module showed
    torch.distributed's ``__path__`` and the import made a second copy of
    torch's module (its own classes, so isinstance failed; pipelining's
    registered its operators twice: RuntimeError)."""

    _PREFIXES = ("varcomm.distributed.", __name__ + ".")

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        for prefix in self._PREFIXES:
            if fullname.startswith(prefix):
                theirs = "torch.distributed." + fullname[len(prefix):]
                if importlib.util.find_spec(theirs) is None:
                    return None  # (ModuleNotFoundError names the module asked for)
                return importlib.util.spec_from_loader(fullname, self, origin=theirs)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(cast(str, spec.origin))
        spec.loader_state = module.__spec__  # (the import system sets __spec__ to ours next: exec_module restores)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__  # (torch's module, already run: only its own spec goes back)
        if spec is not None and spec.loader is self and spec.loader_state is not None:
            module.__spec__ = spec.loader_state


__path__: list[str] = []  # (a package, so that the import system asks _TorchSubmodules for its submodules)
if not any(isinstance(f, _TorchSubmodules) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchSubmodules())  # (first: torch's own finders would load a copy)


def __getattr__(name: str) -> Any:
    # Everything else (all_reduce, new_group, ReduceOp, get_backend, ...) is torch.distributed's.
    try:
        return getattr(_tdist, name)
    except AttributeError:
        raise AttributeError(f"module 'varcomm.distributed' has no attribute {name!r}") from None
