"""Who am I, who are my peers, and how do we meet: launcher environments and
the rendezvous store."""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import ipaddress
import math
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from .errors import InvalidArgument, TimeoutError

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
#: Where to meet: torchrun's address and port. Under SLURM without MASTER_ADDR,
#: the first node of the step (where task 0, the store's host, runs under
#: srun's block and cyclic distributions), else the node srun ran on.
MASTER_ADDR_VAR = "MASTER_ADDR"
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_LAUNCH_ADDR_VAR = "SLURM_LAUNCH_NODE_IPADDR"
MASTER_PORT_VAR = "MASTER_PORT"
#: A job id every rank shares, to derive a port from when no MASTER_PORT is set
#: (with SLURM_STEP_ID: two steps of one job running at once meet apart).
JOB_ID_VARS = ("OMPI_COMM_WORLD_JOBID", "PMIX_NAMESPACE", "SLURM_JOB_ID", "PMI_JOBID")
STEP_ID_VAR = "SLURM_STEP_ID"
#: Open MPI's node count: more than one needs a MASTER_ADDR (rank 0's host).
OMPI_NODES_VAR = "OMPI_MCA_orte_num_nodes"
#: Set by torchrun when its agent hosts the store at MASTER_ADDR:MASTER_PORT:
#: every rank is then a client (as torch's own env:// is).
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"


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
        if size and r:
            n = env_int((la.world_size or "",), env)
            if n is not None and n > 1:
                return n, env_int((la.rank,), env) or 0
    return None


def _default_port(seed: str) -> int:
    # Launchers that do not set MASTER_PORT (mpirun, srun) still give every
    # rank the same job id: derive the same port from it everywhere.
    return 20000 + int(hashlib.sha1(seed.encode()).hexdigest(), 16) % 20000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "gpu[03-05,07],cpu1" -> "gpu03"."""
    m = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not m:
        raise InvalidArgument(f"cannot read the SLURM node list {nodelist!r}: set MASTER_ADDR")
    return m.group(1) + (m.group(2) or "")


def _master_addr(env: Mapping[str, str]) -> str:
    if env.get(MASTER_ADDR_VAR):
        return env[MASTER_ADDR_VAR]
    if env.get("SLURM_PROCID"):
        nodes = next((env[k] for k in SLURM_NODELIST_VARS if env.get(k)), "")
        if nodes:
            return first_host(nodes)
        if env.get(SLURM_LAUNCH_ADDR_VAR):
            return env[SLURM_LAUNCH_ADDR_VAR]
    nodes_n = env_int((OMPI_NODES_VAR,), env)
    if nodes_n is not None and nodes_n > 1:
        raise InvalidArgument(f"mpirun started ranks on {nodes_n} nodes and MASTER_ADDR is not set: pass rank 0's "
                              "host, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`")
    return "127.0.0.1"  # one host


def placement(rank: int | None = None, world_size: int | None = None, have_store: bool = False,
              environ: Mapping[str, str] | None = None) -> Placement:
    """Read the LAUNCHERS' variables, in that order.
    With a store of the caller's, no rendezvous address is needed."""
    env = os.environ if environ is None else environ
    r = rank if rank is not None else env_int(RANK_VARS, env)
    w = world_size if world_size is not None else env_int(WORLD_SIZE_VARS, env)
    if r is None or w is None:
        # (WORLD_SIZE=2 without a rank is a launch gone wrong, not a world of one)
        if rank is None and world_size is None and not any(env.get(k) for k in RANK_VARS) and (w or 1) <= 1:
            r, w = 0, 1  # a lone process: a world of one
        else:
            raise InvalidArgument("cannot tell rank and world_size: pass varcomm.init(rank=..., world_size=...) "
                                  "or launch with varcomm-run / torchrun / mpirun / srun")
    if not 0 <= r < w:
        where = "init(rank=, world_size=)" if rank is not None or world_size is not None else \
            "the launcher's variables (" + ", ".join(k for k in (*RANK_VARS, *WORLD_SIZE_VARS) if env.get(k)) + ")"
        raise InvalidArgument(f"rank {r} out of range for world_size {w}, from {where}: ranks are 0 .. world_size-1 "
                              "(the other ranks will report this rank missing)")
    lr = env_int(LOCAL_RANK_VARS, env)
    lw = env_int(LOCAL_WORLD_SIZE_VARS, env)
    addr = _master_addr(env) if not have_store else env.get(MASTER_ADDR_VAR) or "127.0.0.1"
    port = env_int((MASTER_PORT_VAR,), env)
    if port is not None and not 0 < port < 65536:
        # 99999 wrapped to 34463 in getaddrinfo while TCPStore(port=99999) raised a raw TypeError on rank 0,
        # and the others were told another program owned the port
        raise InvalidArgument(f"{MASTER_PORT_VAR}={port}: not a TCP port (1..65535)")
    if port is None:
        job = next((env[k] for k in JOB_ID_VARS if env.get(k)), "")
        if not job and w > 1 and not have_store:
            raise InvalidArgument("no rendezvous: set MASTER_ADDR and MASTER_PORT, or pass store=")
        port = _default_port(job + ("." + env[STEP_ID_VAR] if env.get(STEP_ID_VAR) else ""))
    return Placement(r, w, lr if lr is not None else r, lw if lw is not None else w, addr, port)


def export_for_torch(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Under a launcher other than torchrun (mpirun, srun), set the variables
    torch.distributed's env:// reads (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from the launcher's, where
    unset, so that ``dist.init_process_group("varcomm")`` works unchanged.
    Returns what it set; sets nothing outside a launched job or when they
    cannot be read (torch then says what is missing)."""
    env = os.environ if environ is None else environ
    if env.get("RANK") or launched(env) is None:
        return {}
    try:
        p = placement(environ=env)
    except InvalidArgument:
        return {}
    values = {"RANK": p.rank, "WORLD_SIZE": p.world_size, "LOCAL_RANK": p.local_rank,
              "LOCAL_WORLD_SIZE": p.local_world_size, "MASTER_ADDR": p.master_addr, "MASTER_PORT": p.master_port}
    done = {k: str(v) for k, v in values.items() if not env.get(k)}
    env.update(done)
    return done


# ---------------------------------------------------------------------------
# the store and the rendezvous

#: How long a listener at MASTER_ADDR:MASTER_PORT may take to answer a store
#: client's first request (a TCPStore answers in milliseconds).
HANDSHAKE_S = 5.0
#: How long a failing rank that hosts the store keeps it up so the others can read why.
_LINGER_S = 0.5

_instances = 0
_tcp_stores: dict[tuple[str, int], TCPStore] = {}


class _Deadline:
    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.at = math.inf if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def __str__(self) -> str:
        return "forever" if self.seconds is None else f"{self.seconds:.3g} s"


def _where(p: Placement) -> str:
    return f"{p.master_addr}:{p.master_port}"


def _says_loopback(addr: str) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen(p: Placement) -> int:
    """A socket listening at MASTER_ADDR's own address (loopback for
    127.0.0.1), not on every interface as a TCPStore binding by itself does;
    its fd, for TCPStore(master_listen_fd=)."""
    try:
        infos = socket.getaddrinfo(p.master_addr, p.master_port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidArgument(f"MASTER_ADDR={p.master_addr!r} does not resolve ({e}): set it to rank 0's host") \
            from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # an IPv4 address first: what clients try first
    family, _, _, _, sockaddr = infos[0]
    anywhere = ("::" if family == socket.AF_INET6 else "0.0.0.0", p.master_port)
    # A host name that /etc/hosts maps to loopback (Debian's 127.0.1.1 for
    # `hostname`) still names this host to the others: only an explicit
    # loopback address or "localhost" keeps the store on loopback.
    if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback and not _says_loopback(p.master_addr):
        sockaddr = anywhere
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT by the last job
    try:
        try:
            sock.bind(sockaddr)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            # MASTER_ADDR reaches this host through an address it does not
            # hold (NAT, a load balancer): listen everywhere, as torch does.
            sock.bind(anywhere)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InvalidArgument(f"rank 0 cannot host the store at {_where(p)}: {_port_owner(p)}") from None
        raise InvalidArgument(f"rank 0 cannot listen at {_where(p)}: {e}") from None
    return sock.detach()


def _port_owner(p: Placement) -> str:
    """Why MASTER_PORT is taken, for rank 0's error."""
    try:
        _client(p, None, _Deadline(HANDSHAKE_S))
    except (InvalidArgument, TimeoutError) as e:  # (TimeoutError: bound, but nothing listens)
        if "does not answer like" in str(e):
            return (f"another program listens on port {p.master_port} (`ss -ltnp 'sport = :{p.master_port}'` "
                    "names it): choose another MASTER_PORT")
        return f"port {p.master_port} is in use: choose another MASTER_PORT"
    return (f"a store already answers there: a second process with rank 0 (check RANK and the launcher's "
            f"variables), or another job on MASTER_PORT {p.master_port} (choose another)")


def _client(p: Placement, timeout: float | None, deadline: _Deadline) -> TCPStore:
    """A TCPStore client of MASTER_ADDR:MASTER_PORT, once something listens
    there and answers like a store; InvalidArgument naming what is wrong."""
    import torch.distributed as dist

    while True:  # until something listens: rank 0 may start after us
        try:
            socket.create_connection((p.master_addr, p.master_port), timeout=max(0.05, min(1.0, deadline.left())
                                                                                    )).close()
            break
        except OSError as e:
            if deadline.left() <= 0:
                # (A name that does not resolve is retried too: on Kubernetes rank 0's resolves once its pod is up.)
                if isinstance(e, socket.gaierror):
                    raise TimeoutError(f"rank {p.rank}: MASTER_ADDR={p.master_addr!r} does not resolve after "
                                       f"{deadline} (VARCOMM_INIT_TIMEOUT; {e.strerror}): set it to rank 0's host"
                                       ) from None
                raise TimeoutError(
                    f"rank {p.rank}: nothing listens at {_where(p)} after {deadline} (VARCOMM_INIT_TIMEOUT): rank 0, "
                    f"which hosts the store, never arrived ({e.strerror or e}); are all {p.world_size} ranks started, "
                    "with the same MASTER_ADDR and MASTER_PORT?") from None
            time.sleep(0.05)
    # torch's client waits for a listener's answer without a limit: make it in
    # a thread and give up after the handshake time.
    shake = max(0.05, min(HANDSHAKE_S, deadline.left()))
    made: list[TCPStore | BaseException] = []

    def make() -> None:
        try:
            made.append(dist.TCPStore(p.master_addr, p.master_port, p.world_size, False,
                                      timeout=timedelta(seconds=shake), wait_for_workers=False))
        except BaseException as e:  # handed to the caller
            made.append(e)

    t = threading.Thread(target=make, name="varcomm-store-connect", daemon=True)
    t.start()
    t.join(shake + 1.0)
    if not made or isinstance(made[0], BaseException):
        why = f"no answer in {shake:.3g} s" if not made else str(made[0]).splitlines()[0]
        raise InvalidArgument(
            f"rank {p.rank}: something listens at {_where(p)} but does not answer like a torch TCPStore ({why}): "
            f"another program owns MASTER_PORT {p.master_port} (choose another), or MASTER_ADDR names the "
            "wrong host")
    store = made[0]
    store.set_timeout(timedelta(seconds=_store_seconds(timeout)))
    return store


def _store_seconds(timeout: float | None) -> float:
    return 300.0 if timeout is None else max(timeout, 1.0)


def _tcp_store(p: Placement, timeout: float | None, deadline: _Deadline) -> TCPStore:
    import torch.distributed as dist

    if p.rank == 0 and os.environ.get(AGENT_STORE_VAR) != "True":
        return dist.TCPStore(p.master_addr, p.master_port, p.world_size, True,
                             timeout=timedelta(seconds=_store_seconds(timeout)), wait_for_workers=False,
                             master_listen_fd=_listen(p))
    return _client(p, timeout, deadline)


def seal_note(job_key: str, text: str) -> str:
    """A failure note a rank leaves in the store for the others (rdzv/conflict,
    setup/failed), with a MAC under the job key: the store answers anyone who
    reaches its port, and its text is shown to the user as varcomm's."""
    return _note_mac(job_key, text) + " " + text if job_key else text


def _note_mac(job_key: str, text: str) -> str:
    return hmac.new(job_key.encode(), b"varcomm-note\0" + text.encode(), "sha256").hexdigest()


def open_note(job_key: str, raw: bytes) -> str | None:
    """The text of a note of seal_note (the store's bytes), None where it is
    forged (with a job key: a MAC that does not verify, or bytes that are not
    text; the ranks go on, and the real note, if one comes, overwrites it).
    Without a key, control characters and length are trimmed: anything that
    reaches the store may have written it."""
    try:
        note = raw.decode()
    except UnicodeDecodeError:  # not a note of ours: seal_note writes text
        if job_key:
            return None
        note = raw.decode(errors="replace")
    if job_key:
        mac, _, text = note.partition(" ")
        # (bytes: compare_digest refuses a str with non-ASCII characters)
        return text if hmac.compare_digest(mac.encode(), _note_mac(job_key, text).encode()) else None
    text = "".join(c if c.isprintable() else " " for c in note)
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _arrive(store: Store, p: Placement, deadline: _Deadline, where: str, hosting: bool = False,
            job_key: str = "") -> None:
    """Every rank of the communicator checks in; a rank that comes twice, or
    with another world size, fails the whole set-up at once, and after the
    init timeout the ranks that never came are named. Whoever fails first
    leaves why in the store for the others (`hosting`: we are the store, so
    we stay a moment for them to read it)."""
    conflict = "rdzv/conflict"

    def fail(msg: str, late: bool = False) -> NoReturn:
        # (late: ranks that never came, a TimeoutError on every rank; the first letter tells the others)
        try:
            store.set(conflict, seal_note(job_key, ("T" if late else "I") + msg))
            if hosting:
                time.sleep(_LINGER_S)
        except RuntimeError:
            pass
        raise (TimeoutError if late else InvalidArgument)(msg)

    try:
        if int(store.add(f"rdzv/rank/{p.rank}", 1)) > 1:
            fail(f"rank {p.rank} arrived twice at {where}: two processes have rank {p.rank} (check RANK or the "
                 "launcher's rank variables, and that no earlier job still runs on this port)")
        agreed = store.compare_set("rdzv/world_size", "", str(p.world_size)).decode(errors="replace")
        if agreed != str(p.world_size):
            fail(f"world_size disagrees between ranks at {where}: rank {p.rank} has {p.world_size}, a rank before "
                 f"it has {agreed} (check WORLD_SIZE or the launcher's size variable on every rank)")
        store.add("rdzv/arrived", 1)
        def failed_elsewhere() -> None:
            if store.check([conflict]) and (why := open_note(job_key, store.get(conflict))) is not None:
                raise (TimeoutError if why[:1] == "T" else InvalidArgument)(f"rank {p.rank}: set-up failed: "
                                                                            + why[1:])

        pause = 0.002
        while int(store.add("rdzv/arrived", 0)) < p.world_size:
            failed_elsewhere()
            if deadline.left() <= 0:
                missing = [r for r in range(p.world_size) if not store.check([f"rdzv/rank/{r}"])]
                if not missing:
                    fail(f"every rank of {p.world_size} checked in at {where}, but the store's arrival count says "
                         f"{int(store.add('rdzv/arrived', 0))}: another process changed it (the count is not "
                         "authenticated): start the job again, on a port that only it uses", late=True)
                names = ", ".join(map(str, missing))
                fail(f"rank{'s' if len(missing) > 1 else ''} {names} of {p.world_size} never arrived at {where} "
                     f"after {deadline} (VARCOMM_INIT_TIMEOUT / init_timeout): are they started, with the same "
                     "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and do they create the same communicators in the "
                     "same order?", late=True)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        # A second process with a rank that had come counts nothing (it failed
        # on its own count), so the count may be complete with its note left:
        # the whole job is misconfigured, not only that process.
        failed_elsewhere()
    except (InvalidArgument, TimeoutError):
        raise
    except RuntimeError as e:  # torch's store errors: the rank hosting it is gone
        raise InvalidArgument(f"rank {p.rank}: the store at {where} stopped answering during the rendezvous "
                              f"({str(e).splitlines()[0]}): rank 0, which hosts it, gave up or exited; its error "
                              "says why") from None


def torch_default_group() -> tuple[Store, int, int] | None:
    """(store, rank, world_size) of torch.distributed's default group where this
    process initialized one, else None: binding MASTER_PORT again would find
    that group's store already there."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _get_default_store(), dist.get_rank(), dist.get_world_size()


def make_store(p: Placement, store: Store | None, timeout: float | None, init_timeout: float | None = None,
               prefix: str | None = None, job_key: str = "") -> tuple[Store, TCPStore | None]:
    """(store, owner): a prefix store unique to this communicator, once every
    rank arrived in it, and the TCPStore we connected to, if we made it.
    Without `prefix`, ranks create communicators in the same order, so the
    n-th one shares a prefix; groups whose ranks made different numbers of
    communicators pass their own. One TCPStore per address per process: a
    second communicator reuses it rather than re-binding the port.
    timeout: the store's operations; init_timeout: connecting and arriving
    (None: no limit), after which the error names what is missing."""
    import torch.distributed as dist

    global _instances
    _instances += 1
    deadline = _Deadline(init_timeout)
    owner = None
    if prefix is not None and store is not None:
        s: Store = dist.PrefixStore(prefix, store)
        where = "the given store"
    else:
        if store is None:
            key = (p.master_addr, p.master_port)
            owner = _tcp_stores.get(key)
            if owner is None:
                owner = _tcp_store(p, timeout, deadline)
                _tcp_stores[key] = owner
            store = owner
            where = _where(p)
        else:
            where = "the given store"
        s = dist.PrefixStore(f"varcomm/{_instances}/", store)
    if p.world_size > 1:
        _arrive(s, p, deadline, where, hosting=owner is not None and p.rank == 0, job_key=job_key)
    return s, owner
