"""Who am I, who are my peers, and how do we meet: launcher environments and
the rendezvous store."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from .errors import InvalidArgument

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore


@dataclasses.dataclass
class Placement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


@dataclasses.dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets in each rank (None: it sets none)."""

    name: str
    rank: str
    world_size: str | None
    local_rank: str | None
    local_world_size: str | None


#: Every launcher varcomm understands, in order of preference; bootstrap and
#: varcomm.testing read ranks through this one list.
LAUNCHERS = (
    Launcher("torchrun / varcomm-run", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    Launcher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Launcher("MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Launcher("PMIx", "PMIX_RANK", None, None, None),
    Launcher("SLURM srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)
RANK_VARS = tuple(la.rank for la in LAUNCHERS)
WORLD_SIZE_VARS = tuple(la.world_size for la in LAUNCHERS if la.world_size)
LOCAL_RANK_VARS = tuple(la.local_rank for la in LAUNCHERS if la.local_rank)
LOCAL_WORLD_SIZE_VARS = tuple(la.local_world_size for la in LAUNCHERS if la.local_world_size)
#: Where to meet: torchrun's address and port; the launch node under SLURM.
MASTER_ADDR_VARS = ("MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR")
MASTER_PORT_VAR = "MASTER_PORT"
#: A job id every rank shares, to derive a port from when no MASTER_PORT is set.
JOB_ID_VARS = ("OMPI_COMM_WORLD_JOBID", "PMIX_NAMESPACE", "SLURM_JOB_ID", "PMI_JOBID")


def env_int(names: Sequence[str], environ: Mapping[str, str] | None = None) -> int | None:
    """The first of `names` set (non-empty) in the environment, as an int."""
    env = os.environ if environ is None else environ
    for n in names:
        v = env.get(n)
        if v:
            try:
                return int(v)
            except ValueError:
                raise InvalidArgument(f"{n}={v!r}: the launcher's variable is not an integer") from None
    return None


def launched(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(world_size, rank) when a launcher started this process in a job of more than one rank."""
    env = os.environ if environ is None else environ
    for la in LAUNCHERS:
        size, r = env.get(la.world_size or ""), env.get(la.rank)
        if size and r and int(size) > 1:
            return int(size), int(r)
    return None


def _default_port(seed: str) -> int:
    # Launchers that do not set MASTER_PORT (mpirun, srun) still give every
    # rank the same job id: derive the same port from it everywhere.
    return 20000 + int(hashlib.sha1(seed.encode()).hexdigest(), 16) % 20000


def placement(rank: int | None = None, world_size: int | None = None, have_store: bool = False) -> Placement:
    """Read the LAUNCHERS' variables, in that order.
    With a store of the caller's, no rendezvous address is needed."""
    r = rank if rank is not None else env_int(RANK_VARS)
    w = world_size if world_size is not None else env_int(WORLD_SIZE_VARS)
    if r is None or w is None:
        if rank is None and world_size is None and not any(os.environ.get(k) for k in RANK_VARS):
            r, w = 0, 1  # a lone process: a world of one
        else:
            raise InvalidArgument("cannot tell rank and world_size: pass varcomm.init(rank=..., world_size=...) "
                                  "or launch with varcomm-run / torchrun / mpirun / srun")
    if not 0 <= r < w:
        raise InvalidArgument(f"rank {r} out of range for world_size {w}")
    lr = env_int(LOCAL_RANK_VARS)
    lw = env_int(LOCAL_WORLD_SIZE_VARS)
    addr = next((os.environ[k] for k in MASTER_ADDR_VARS if os.environ.get(k)), "127.0.0.1")
    port = env_int((MASTER_PORT_VAR,))
    if port is None:
        job = next((os.environ[k] for k in JOB_ID_VARS if os.environ.get(k)), "")
        if not job and w > 1 and not have_store:
            raise InvalidArgument("no rendezvous: set MASTER_ADDR and MASTER_PORT, or pass store=")
        port = _default_port(job)
    return Placement(r, w, lr if lr is not None else r, lw if lw is not None else w, addr, port)


_instances = 0
_tcp_stores: dict[tuple[str, int], TCPStore] = {}


def make_store(p: Placement, store: Store | None, timeout: float, prefix: str | None = None
               ) -> tuple[Store, TCPStore | None]:
    """(store, owner): a prefix store unique to this communicator, and the
    TCPStore we connected to, if we made it. Without `prefix`, ranks create
    communicators in the same order, so the n-th one shares a prefix; groups
    whose ranks made different numbers of communicators pass their own. One
    TCPStore per address per process: a second communicator reuses it rather
    than re-binding the port."""
    import torch.distributed as dist

    global _instances
    _instances += 1
    if prefix is not None and store is not None:
        return dist.PrefixStore(prefix, store), None
    owner = None
    if store is None:
        key = (p.master_addr, p.master_port)
        owner = _tcp_stores.get(key)
        if owner is None:
            owner = dist.TCPStore(p.master_addr, p.master_port, p.world_size, p.rank == 0,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=False)
            _tcp_stores[key] = owner
        store = owner
    return dist.PrefixStore(f"varcomm/{_instances}/", store), owner
