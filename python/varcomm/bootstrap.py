"""Who am I, who are my peers, and how do we meet: launcher environments and
the rendezvous store."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from datetime import timedelta
from typing import Any

from .errors import InvalidArgument


@dataclasses.dataclass
class Placement:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def _default_port(seed: str) -> int:
    # Launchers that do not set MASTER_PORT (mpirun, srun) still give every
    # rank the same job id: derive the same port from it everywhere.
    return 20000 + int(hashlib.sha1(seed.encode()).hexdigest(), 16) % 20000


def placement(rank: int | None = None, world_size: int | None = None, have_store: bool = False) -> Placement:
    """Read torchrun, Open MPI, MPICH/PMI and SLURM variables, in that order.
    With a store of the caller's, no rendezvous address is needed."""
    r = rank if rank is not None else _env_int("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
    w = world_size if world_size is not None else _env_int(
        "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
    if r is None or w is None:
        if rank is None and world_size is None and not any(
                k in os.environ for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")):
            r, w = 0, 1  # a lone process: a world of one
        else:
            raise InvalidArgument("cannot tell rank and world_size: pass varcomm.init(rank=..., world_size=...) "
                                  "or launch with varcomm-run / torchrun / mpirun / srun")
    if not 0 <= r < w:
        raise InvalidArgument(f"rank {r} out of range for world_size {w}")
    lr = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
    lw = _env_int("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    addr = os.environ.get("MASTER_ADDR") or os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    port = _env_int("MASTER_PORT")
    if port is None:
        job = (os.environ.get("OMPI_COMM_WORLD_JOBID") or os.environ.get("PMIX_NAMESPACE")
               or os.environ.get("SLURM_JOB_ID") or os.environ.get("PMI_JOBID") or "")
        if not job and w > 1 and not have_store:
            raise InvalidArgument("no rendezvous: set MASTER_ADDR and MASTER_PORT, or pass store=")
        port = _default_port(job)
    return Placement(r, w, lr if lr is not None else r, lw if lw is not None else w, addr, port)


_instances = 0
_tcp_stores: dict[tuple[str, int], Any] = {}


def make_store(p: Placement, store: Any | None, timeout: float, prefix: str | None = None) -> tuple[Any, Any]:
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
