"""A job that strangers cannot write into (issue 14, "Security").

The attacker is another user of the host (uid 65534 through setpriv; the job
runs as root, as CI does) who reads the job's TCPStore, where every rank
publishes its set-up records (keys varcomm/<n>/setup/<round>/<rank>, see
Communicator._setup), and plants records or one-sided writes of its own. It
knows the record format (csrc/registry.cpp PeerInfo::encode, transport/shm and
transport/rdma expose()) but not the job key. A same-user process, which can
read a rank's memory anyway, is the attacker only where the test says so
(the lying bound: a bug or a confused peer rather than an adversary).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import varcomm
from varcomm import bootstrap
from varcomm.testing import world

HERE = Path(__file__).resolve().parent
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
KEY = "5ec2e7a1b0c4d9f8e7a6b5c4d3e2f1a0"

as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="the attacker is another user: needs root and setpriv")
rdma_built = pytest.mark.skipif("rdma" not in varcomm.build_info()["transports"],
                                reason="varcomm was built without the rdma transport")

# What the attacker runs: the store client, the record format, the layout
# (csrc/protocol.h Layout), and the planted shm peer. Standard library and
# torch only, as any user of the host has.
ATTACKER = r'''
import datetime, mmap, os, struct, sys, time
from torch.distributed import TCPStore

host, port, prefix, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
MARK = b"\nvarcomm-mac "

def get(key):
    blob = bytes(store.get(prefix + key))
    at = blob.rfind(MARK)
    return blob[:at] if at >= 0 else blob

def fields(rec):
    head = b"varcomm-peer3 "
    assert rec.startswith(head), rec[:40]
    out, at = [], len(head)
    while at < len(rec):
        colon = rec.index(b":", at)
        n = int(rec[at:colon])
        out.append(rec[colon + 1:colon + 1 + n])
        at = colon + 1 + n
    return out

def put(v):
    return str(len(v)).encode() + b":" + v

def layout_total(world, nslots, bound):
    up = lambda n, a: (n + a - 1) // a * a
    slot = 256 + up(bound, 256)
    rings = up(4096 + world * up(nslots * 8, 64), 4096)
    return rings + world * nslots * slot, rings, slot

def publish(rnd, record):
    store.set(prefix + f"setup/{rnd}/1", record + MARK + b"none")

def unseal(rnd, rank, key):
    """What a rank published, decrypted with the job key (csrc/routes.cpp keystream_xor)."""
    import hashlib, hmac
    world = 2
    job = hashlib.sha256(b"".join(str(len(b)).encode() + b":" + b
                                  for b in (bytes(store.get(prefix + f"setup/0/{r}")) for r in range(world)))).digest()
    ctx = b"varcomm-pad1" + b"".join(b"\0" + p
                                     for p in (str(rnd).encode(), str(rank).encode(), str(world).encode(), job))
    body = get(f"setup/{rnd}/{rank}")
    pad = b"".join(hmac.new(key.encode(), ctx + b"\0" + str(i).encode(), "sha256").digest()
                   for i in range((len(body) + 31) // 32))
    return bytes(a ^ b for a, b in zip(body, pad))

if mode in ("shm", "lie", "lie-layout"):
    # Play rank 1: check in at the rendezvous as rank 1 would (bootstrap._arrive),
    # then copy the host key from rank 0's round-0 record.
    store.add(prefix + "rdzv/rank/1", 1)
    store.compare_set(prefix + "rdzv/world_size", "", "2")
    store.add(prefix + "rdzv/arrived", 1)
    host_key = get("setup/0/0").split(b"\n")[0]
    publish(0, host_key + b"\n" + os.urandom(16).hex().encode())
    f = fields(get("setup/1/0"))
    world, nslots, bound = int(f[1]), int(f[2]), int(f[3])
    descs = dict(zip(f[8::2], f[9::2]))
    # "lie": descriptor and control block claim 64x the memfd; "lie-layout":
    # they are honest, the published layout (what rank 0 writes by) lies.
    claimed = bound * 64 if mode.startswith("lie") else bound
    real, _, _ = layout_total(world, nslots, bound)
    mapped = claimed if mode == "lie" else bound
    total, rings, slot = layout_total(world, nslots, mapped)
    fd = os.memfd_create("attacker")
    os.ftruncate(fd, real)
    mem = mmap.mmap(fd, real)
    pid = os.getpid()
    start = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    # A control block that agrees with the descriptor: magic, rank, world, slots, pid, bound.
    mem[:32] = struct.pack("<QiiiiQ", 0x316d6d6f63726176, 1, world, nslots, pid, mapped)
    # the last field: where the region is mapped (for CMA); refused before anyone reads it
    descs[b"shm"] = f"{pid}:{fd}:{total}:{start}:{nslots}:{mapped}:0:0".encode()
    # landing 0: the attacker region has no landing area (its control block says 0 too)
    rec = b"varcomm-peer3 " + b"".join(put(x) for x in (f[0], f[1], f[2], str(claimed).encode(), b"0", f[5], f[6]))
    rec += put(str(len(descs)).encode()) + b"".join(put(k) + put(v) for k, v in sorted(descs.items()))
    publish(1, rec)
    get("setup/2/0")
    publish(2, b"acks:")
    print("planted", flush=True)
    # What rank 0 sends to "rank 1" lands in rank 0's ring of our region.
    until = time.time() + 20
    while time.time() < until:
        got = sum(1 for k in range(nslots) if struct.unpack_from("<Q", mem, rings + k * slot)[0])
        print("captured", got, flush=True)
        time.sleep(0.2)

elif mode == "rdma":
    forge = sys.argv[5]
    # The store shows the descriptors encrypted: this attacker learned the
    # region keys elsewhere (off the wire, say), which the job key (given to
    # it for that alone) stands in for. It still cannot compute a pair tag.
    recs = [fields(unseal(1, r, sys.argv[6])) for r in (0, 1)]
    def rdma_desc(f):
        d = dict(zip(f[8::2], f[9::2]))[b"rdma"].decode()
        return dict(tok.split("=", 1) for tok in d.split())
    d0, d1 = rdma_desc(recs[0]), rdma_desc(recs[1])
    world, nslots, bound = int(recs[0][1]), int(recs[0][2]), int(recs[0][3])
    _, rings, slot = layout_total(world, nslots, bound)
    off = rings + (1 * nslots + 0) * slot  # rank 1's first slot in rank 0's region
    payload = struct.pack("<4d", 666, 666, 666, 666)
    # MsgHeader: seq, nbytes, tag, dtype (float64), ndim, shape[8], flags, auth (unknown: 0)
    hdr = struct.pack("<QQqII8qQQ", 1, len(payload), 99, (2 << 16) | (64 << 8) | 1, 1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    r = __import__("subprocess").run(
        [forge, d0["prov"], "lo", d0["ep"], d0["addr"], d0["key"], str(off), hdr.hex(), payload.hex()],
        capture_output=True, text=True, timeout=30)
    print(__import__("json").dumps({"rc": r.returncode, "out": r.stdout + r.stderr,
                                    "keys": [int(d0["key"], 16), int(d1["key"], 16)],
                                    "hkeys": [int(d0["hkey"], 16), int(d1["hkey"], 16)]}), flush=True)

elif mode == "forge-store":
    # Barrier arrivals and close's "left" of rank 1, as the records look
    # without a key, the old counters too; and a failure note of our own text.
    for n in range(2, 6):  # (not the first: the test's ranks meet there)
        store.set(prefix + f"barrier/{n}/1", "none")
        store.add(prefix + f"barrier/{n}", 1)
    store.set(prefix + "left/1", "none")
    print("planted", flush=True)

elif mode == "bad-notes":
    # Failure notes that are not even text, where every rank looks for a
    # failure while it waits for the others.
    store.set(prefix + "rdzv/conflict", b"\xff\xfe not text")
    store.set(prefix + "setup/failed", b"\xff\xfe not text")
    print("planted", flush=True)

elif mode == "bad-count":
    # The rendezvous' arrival count (not authenticated: only a count) set back.
    store.add(prefix + "rdzv/arrived", -100)
    print("planted", flush=True)

elif mode == "tamper":
    # Over a genuine message waiting in rank 1's slot 0 of rank 0's ring: a
    # plain one-sided write of the payload only (the header and its pair tag
    # stay the sender's), with rank 1's region key and address as published.
    forge = sys.argv[5]
    try:
        f = fields(get("setup/1/1"))
        d = dict(tok.split("=", 1) for tok in dict(zip(f[8::2], f[9::2]))[b"rdma"].decode().split())
    except Exception as e:  # no readable descriptor: nothing to aim at
        print(__import__("json").dumps({"rc": -1, "out": f"no rdma descriptor in the store: {e!r}"}), flush=True)
        sys.exit(0)
    world, nslots, bound = int(f[1]), int(f[2]), int(f[3])
    _, rings, slot = layout_total(world, nslots, bound)
    off = rings + 0 * slot + 256  # sender 0, slot 0, kPayloadOff
    r = __import__("subprocess").run(
        [forge, d["prov"], "lo", d["ep"], d["addr"], d["key"], str(off), "", struct.pack("<4d", *[666.0] * 4).hex(),
         "raw"], capture_output=True, text=True, timeout=30)
    print(__import__("json").dumps({"rc": r.returncode, "out": r.stdout + r.stderr}), flush=True)
'''


def _attacker(mode: str, *extra: str, as_nobody: bool = True, made: bool = False) -> subprocess.Popen[str]:
    """The attacker against this process's communicator: the one just `made`,
    else the one about to be made (bootstrap.make_store names their prefixes)."""
    prefix = f"varcomm/{bootstrap._instances + (0 if made else 1)}//"  # PrefixStore joins with "/"
    cmd = [*(NOBODY if as_nobody else []), sys.executable, "-c", ATTACKER, os.environ["MASTER_ADDR"],
           os.environ["MASTER_PORT"], prefix, mode, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")


def _stop(p: subprocess.Popen[str]) -> str:
    p.kill()
    out, _ = p.communicate()
    return out


@contextlib.contextmanager
def _attacked_while_rank_1_is_late(mode: str, late: float) -> Iterator[None]:
    """In a world of 2: rank 0 starts the attacker (it plants as soon as rank
    0's store listens), rank 1 comes `late` s after, so that rank 0 waits in
    set-up over what was planted; the body makes the communicator. Then the
    attacker must have planted (else the test tested nothing)."""
    attacker = _attacker(mode) if int(os.environ["RANK"]) == 0 else None
    if attacker is None:
        time.sleep(late)
    yield
    if attacker is not None:
        out, _ = attacker.communicate(timeout=30)
        assert "planted" in out, out


def _planted_peer_refused(match: str, mode: str = "shm", as_nobody: bool = True, **kw: object) -> None:
    """Rank 0 of a world of 2 whose rank 1 the attacker plays: init must fail
    with `match`, so nothing is ever sent to the attacker."""
    attacker = _attacker(mode, as_nobody=as_nobody)
    try:
        with pytest.raises(varcomm.VarcommError, match=match):
            comm = varcomm.init(rank=0, world_size=2, transport="shm", bound=4096, slots=4, timeout=15,
                                array="numpy", **kw)
            # Unchanged code gets here: every message lands in the attacker's memory
            # (as many as rank 1's slots hold, so none of them blocks).
            for i in range(4):
                comm.send(np.full(4, float(i)), dst=1, tag=7)
            time.sleep(0.5)
    finally:
        out = _stop(attacker)
    print("attacker:", out[-2000:])
    assert "planted" in out or "Error" not in out, out  # it attacked, not crashed
    captured = [int(line.split()[1]) for line in out.splitlines() if line.startswith("captured")]
    assert not captured or max(captured) == 0, out


@as_root
@world(1, timeout=40)
def test_planted_shm_peer_of_another_user_is_refused():
    """Without a key: the planted descriptor names a process of uid 65534 (and
    its memfd, which root could open): refused for its owner, nothing mapped."""
    _planted_peer_refused(r"runs as uid 65534, this rank as uid 0: refused")


@as_root
@world(1, timeout=40)
def test_planted_record_fails_the_job_key():
    """With a key: the attacker cannot authenticate its records; refused at
    the first round, with what to do."""
    _planted_peer_refused(r"not authenticated.*same VARCOMM_JOB_KEY on every rank", job_key=KEY)


@pytest.mark.parametrize("mode, match", [
    ("lie", r"is not a region of \d+ bytes.*lie"),
    ("lie-layout", r"published a layout of \d+ bytes .* but its shm region holds \d+: refused"),
])
@world(1, timeout=40)
def test_descriptor_with_a_lying_bound_is_refused(mode, match):
    """A same-user peer that claims a bound 64x what its memfd holds, in its shm
    descriptor and control block ("lie") or only in its published layout
    ("lie-layout"): refused at connect (before, the first send past the file's
    end killed the rank with SIGBUS)."""
    _planted_peer_refused(match, mode=mode, as_nobody=False)


@pytest.fixture(scope="module")
def forge() -> str:
    """The rdma attacker (tests/attack/rdma_forge.cpp), somewhere uid 65534 may run it."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the rdma attacker")
    d = tempfile.mkdtemp(prefix="varcomm-forge-")
    os.chmod(d, 0o755)
    exe = os.path.join(d, "rdma_forge")
    r = subprocess.run([cxx, "-std=c++17", "-O1", str(HERE / "attack" / "rdma_forge.cpp"), "-lfabric", "-o", exe],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot build the rdma attacker: {r.stderr[-500:]}")
    return exe


@as_root
@rdma_built
@world(2, timeout=50)
def test_forged_rdma_write_is_discarded(forge):
    """With a key, over rdma (tcp;ofi_rxm on loopback): the attacker reads rank
    0's endpoint, region address and key from the store and writes a complete
    message (header, seq 1, tag 99, payload) into rank 1's first slot with one
    fi_writedata. Rank 0 must not deliver it, count it, and still receive the
    genuine message that follows. The region keys are random, not 1, 2, ..."""
    with varcomm.init(transport="rdma", job_key=KEY, bound=4096, slots=4, timeout=30, array="numpy") as comm:
        if comm.rank == 1:
            comm.recv(src=0, tag=1)  # until the attack is over
            comm.send(np.arange(4.0), dst=0, tag=99)
            return
        attacker = _attacker("rdma", forge, KEY, made=True)
        delivered = []
        # Keep receiving while it attacks: rxm accepts its connection only
        # while rank 0 drives progress, as a rank blocked in recv does.
        until = time.monotonic() + 30
        while attacker.poll() is None and time.monotonic() < until:
            try:
                delivered.append(comm.recv(src=1, tag=99, timeout=0.05))
            except varcomm.TimeoutError:
                pass
        out, _ = attacker.communicate(timeout=5)
        report = json.loads(out.strip().splitlines()[-1])
        assert report["rc"] == 0, report  # the forged write reached rank 0's region
        try:
            delivered.append(comm.recv(src=1, tag=99, timeout=1.0))
        except varcomm.TimeoutError:
            pass
        assert delivered == [], f"a forged message was delivered: {delivered}"
        assert comm.forged_headers == 1
        comm.send(np.zeros(1), dst=1, tag=1)
        np.testing.assert_array_equal(comm.recv(src=1, tag=99), np.arange(4.0))
        keys = report["keys"] + report["hkeys"]
        assert len(set(keys)) == 4 and min(keys) >= 1 << 16, f"guessable rdma keys {keys}"


@as_root
@rdma_built
@world(2, timeout=50)
def test_outsider_cannot_rewrite_a_genuine_message_over_rdma(forge):
    """With a key, over rdma: a genuine message (valid header and pair tag)
    waits in rank 1's slot; the attacker, with only what the store shows
    (rank 1's endpoint, region address and key), overwrites its payload with
    one plain fi_write. Rank 1 must receive what rank 0 sent. Before the fix
    the store showed the region key in clear, and rank 1 got [666, 666, ...]."""
    with varcomm.init(transport="rdma", job_key=KEY, bound=4096, slots=4, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.send(np.arange(4.0), dst=1, tag=5)  # seq 1: rank 1's slot 0 of our ring
            comm.send(np.zeros(1), dst=1, tag=6)
            comm.recv(src=1, tag=1)  # until the attack is over
            return
        comm.recv(src=0, tag=6)  # tag 5 is now in its slot, unreceived
        attacker = _attacker("tamper", forge, made=True)
        until = time.monotonic() + 30
        while attacker.poll() is None and time.monotonic() < until:  # drive progress (rxm)
            try:
                comm.recv(src=0, tag=77, timeout=0.05)
            except varcomm.TimeoutError:
                pass
        out, _ = attacker.communicate(timeout=5)
        report = json.loads(out.strip().splitlines()[-1])
        print("attacker:", report)
        got = comm.recv(src=0, tag=5)
        comm.send(np.zeros(1), dst=0, tag=1)
        np.testing.assert_array_equal(got, np.arange(4.0), err_msg=f"payload rewritten by an outsider: {report}")
        assert report["rc"] != 0, f"an outsider wrote into rank 1's region: {report}"


@pytest.mark.parametrize("array", ["torch", "numpy"])
@world(2, timeout=30)
def test_header_whose_shape_understates_its_size_is_refused(array):
    """A peer (a confused one, or without a key a forger) writes a header whose
    shape and dtype say 8 bytes but whose nbytes is 32 KiB. The receiver must
    refuse it, not copy 32 KiB into the 8-byte tensor its allocator made from
    the shape (before: a heap overflow, SIGSEGV, on the default torch kind):
    the header is malformed, and the pair fails naming it (Engine::sane)."""
    with varcomm.init(transport="shm", array=array, timeout=20) as comm:
        if comm.rank == 0:
            buf = np.full(4096, 7.0)
            word = (2 << 16) | (64 << 8) | 1  # float64
            comm._c.send(1, 5, buf.ctypes.data, buf.nbytes, word, [1], 10.0, -1, buf, 0)
            comm.barrier()
            return
        guard = [np.zeros(4) for _ in range(64)]
        with pytest.raises(varcomm.PeerFailure, match=r"malformed message header.*float64 of shape \(1,\)"):
            comm.recv(src=0, tag=5)
        assert not any(g.any() for g in guard)
        comm.barrier()


@world(2, timeout=30)
def test_ranks_with_different_job_keys_refuse_each_other():
    """A rank with another key is refused at the first set-up round, with what to do."""
    with pytest.raises(varcomm.InvalidArgument, match="fails authentication.*same VARCOMM_JOB_KEY on every rank"):
        varcomm.init(transport="shm", job_key=f"key-of-rank-{os.environ['RANK']}", timeout=15)
    _keep_store_up()


def _keep_store_up() -> None:
    # Rank 0 serves the store: it stays until rank 1 has read the records it refuses.
    if os.environ["RANK"] == "0":
        time.sleep(2)


@world(2, timeout=30)
def test_a_keyed_rank_refuses_an_unkeyed_one():
    key = KEY if os.environ["RANK"] == "0" else ""
    with pytest.raises(varcomm.InvalidArgument, match="VARCOMM_JOB_KEY"):
        varcomm.init(transport="shm", job_key=key, timeout=15)
    _keep_store_up()


def _launch(n: int, env: dict[str, str]) -> list[str]:
    """What each rank of `varcomm-run -n n` saw as its job key (its hash: never printed)."""
    # One os.write per rank: the ranks share the pipe, and whole lines stay whole.
    prog = ("import hashlib, os; k = os.environ.get('VARCOMM_JOB_KEY', ''); "
            "os.write(1, f'{len(k)} {hashlib.sha256(k.encode()).hexdigest()}\\n'.encode())")
    r = subprocess.run([sys.executable, "-m", "varcomm.run", "-n", str(n), sys.executable, "-c", prog],
                       env={**env, "PYTHONPATH": str(Path(varcomm.__file__).resolve().parents[1])},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return sorted(r.stdout.split("\n")[:-1])


def test_varcomm_run_gives_each_job_its_own_key():
    env = {k: v for k, v in os.environ.items() if k != "VARCOMM_JOB_KEY"}
    first, second = _launch(3, env), _launch(3, env)
    assert len(set(first)) == 1 and first[0].startswith("32 "), first  # one 128-bit key, the same on every rank
    assert first != second  # a fresh one per job
    mine = _launch(2, {**env, "VARCOMM_JOB_KEY": KEY})  # a key the user set is kept
    assert set(mine) == {f"{len(KEY)} {hashlib.sha256(KEY.encode()).hexdigest()}"}


@world(2, timeout=30)
def test_unsupported_numpy_dtype_on_the_fast_path_is_refused_by_the_sender():
    """np.clongdouble (32-byte items, buffer format 'Zg') has no dtype word:
    8 bits hold its 256 bits as 0, so the fast path sent "complex, 0 bits".
    Since headers' shapes must account for their bytes (Engine::sane), the
    receiver then failed the whole pair as malformed (PeerFailure, every later
    message lost) for what is the sender's argument error. The sender must
    refuse it (InvalidArgument, as the general path does) and the pair stay up."""
    with varcomm.init(transport="shm", array="numpy", timeout=20) as comm:
        if comm.rank == 0:
            with pytest.raises(varcomm.InvalidArgument, match="clongdouble|not supported|unsupported"):
                comm.send(np.zeros(4, np.clongdouble), dst=1, tag=5)
            comm.send(np.arange(3.0), dst=1, tag=6)
            return
        np.testing.assert_array_equal(comm.recv(src=0, tag=6), np.arange(3.0))


@contextlib.contextmanager
def _setup_store(rewrite=lambda k, v: v, on_set=lambda k, v: None):
    """Communicator set-up meets an outsider at the store: a get of key k
    returns rewrite(k, value), and on_set(k, v) runs before each set."""
    from varcomm import comm as comm_mod

    class Rewritten:
        def __init__(self, inner):
            self.inner = inner

        def set(self, k, v):
            on_set(k, v)
            self.inner.set(k, v)

        def get(self, k):
            return rewrite(k, bytes(self.inner.get(k)))

        def check(self, keys):
            return self.inner.check(keys)

    real = comm_mod.Communicator._setup

    def patched(self):
        inner, self._store = self._store, Rewritten(self._store)
        try:
            real(self)
        finally:
            self._store = inner

    comm_mod.Communicator._setup = patched
    try:
        yield
    finally:
        comm_mod.Communicator._setup = real


@world(2, timeout=40)
def test_replayed_round0_records_do_not_reuse_a_keystream():
    """The store is writable by anyone who reaches it, and round-0 records are
    authenticated without a job (there is none yet): an outsider who kept an
    earlier job's round-0 records can put them back in the store, so every rank
    derives that job again, and with it the same keystream for the encrypted
    rounds (csrc/routes.cpp keystream_xor: a two-time pad; the same pair tags
    too). Each rank must find its own fresh record in the store, else refuse."""
    with varcomm.init(transport="shm", job_key=KEY, timeout=20) as comm:
        s = comm._store
        old0 = [bytes(s.get(f"setup/0/{r}")) for r in range(2)]
        old1 = bytes(s.get(f"setup/1/{comm.rank}"))
        comm.barrier()

    # the outsider overwrote setup/0/* with the old job's records
    with _setup_store(lambda k, v: old0[int(k.rsplit("/", 1)[1])] if k.startswith("setup/0/") else v):
        try:
            comm = varcomm.init(transport="shm", job_key=KEY, timeout=20)
        except varcomm.InvalidArgument as e:
            assert "own set-up record of round 0" in str(e), e
            time.sleep(3)  # rank 0 hosts the store: let rank 1 find its own record first
            return
    with comm:
        new1 = bytes(comm._store.get(f"setup/1/{comm.rank}"))
        comm.barrier()
    head = len(b"varcomm-peer3 ")
    assert new1[:head] != old1[:head], "the same keystream encrypted two jobs' records (replayed round 0)"


@rdma_built
@world(2, timeout=40)
def test_rdma_descriptor_without_liveness_token_is_refused_as_malformed():
    """A peer whose rdma descriptor has no ltok (an older varcomm, whose
    dialer sends its rank alone) must be refused at set-up with what is wrong,
    as a descriptor without its other fields is: not a bare "stoull" from
    std::stoull("") escaping RdmaTransport::connect."""
    MARK = b"\nvarcomm-mac "

    def strip_ltok(blob):
        rec = blob[:blob.rfind(MARK)]
        head = b"varcomm-peer3 "
        out, at = [], len(head)
        while at < len(rec):
            colon = rec.index(b":", at)
            n = int(rec[at:colon])
            out.append(rec[colon + 1:colon + 1 + n])
            at = colon + 1 + n
        assert any(b" ltok=" in f for f in out), out
        out = [b" ".join(t for t in f.split(b" ") if not t.startswith(b"ltok=")) for f in out]
        return head + b"".join(str(len(f)).encode() + b":" + f for f in out) + MARK + b"none"

    try:
        with _setup_store(lambda k, v: strip_ltok(v) if k.startswith("setup/1/") else v):
            with pytest.raises(varcomm.InvalidArgument, match="malformed descriptor"):
                varcomm.init(transport="rdma", timeout=20)
    finally:
        time.sleep(2)  # rank 0 hosts the store


@rdma_built
@world(2, timeout=40)
def test_rdma_liveness_port_stalled_by_a_stranger_does_not_hang_setup():
    """Anyone who reaches a rank's liveness port (its address is on the wire,
    and in the store without a key) connects first and sends 1 of the 16
    bytes of the handshake (rank, token), then nothing. The acceptor polled for
    readability, then blocked in recv(MSG_WAITALL) for the other 15 for ever,
    holding the transport's lock: set-up never ended. It must drop that
    connection and take rank 0's. Then a crowd of strangers, silent or
    partial, connects first: each held the acceptor for its whole 2 s
    handshake limit, one after another (12 of them: 24 s); they must be
    waited on together."""
    import re
    import socket

    held = []

    def stall(k, v):
        if k == "setup/1/1":  # before rank 0 can read it (and dial us)
            m = re.search(rb"live=(\S+) port=(\d+)", bytes(v))
            for i in range(12):
                s = socket.create_connection((m.group(1).decode(), int(m.group(2))))
                if i % 2:
                    s.sendall(b"\x01")
                held.append(s)

    t0 = time.monotonic()
    with _setup_store(on_set=stall):
        comm = varcomm.init(transport="rdma", timeout=20, array="numpy")
    took = time.monotonic() - t0
    assert took < 12, f"set-up took {took:.1f} s beside 12 stalled strangers"
    for s in held:  # dropped by the acceptor once its peers had come (they were kept open for good)
        s.settimeout(5)
        try:
            assert s.recv(1) == b"", "a stranger got bytes from the liveness port"
        except ConnectionResetError:  # (closed with the stranger's byte unread)
            pass
        except TimeoutError:
            raise AssertionError("a stranger's connection to the liveness port is still open after set-up") from None
    with comm:
        if comm.rank == 0:
            comm.send(np.arange(3.0), dst=1)
        else:
            np.testing.assert_array_equal(comm.recv(src=0), np.arange(3.0))
            assert held


@as_root
@world(2, timeout=60)
def test_failure_notes_that_are_not_text_are_ignored_as_forged():
    """Another user wrote bytes that are not UTF-8 as the set-up's failure
    notes: every rank died of a UnicodeDecodeError in init. A note that does
    not verify under the key is ignored (README: security), so the job goes
    on. Rank 1 comes late, so rank 0 waits, reading the notes (the attacker
    plants them as soon as rank 0's store listens)."""
    with _attacked_while_rank_1_is_late("bad-notes", 3.0), \
            varcomm.init(transport="shm", job_key=KEY, timeout=30, array="numpy") as comm:
        if comm.rank == 0:
            comm.send(np.arange(3.0), 1)
        else:
            np.testing.assert_array_equal(comm.recv(0), np.arange(3.0))


@as_root
@world(2, timeout=60)
def test_a_forged_arrival_count_is_named_as_such():
    """Another user set the rendezvous' arrival count back while rank 1 was
    late: init timed out saying "rank  of 2 never arrived" (no rank named:
    every rank had checked in). Now it says the count was changed, and what to
    do. Catches: the blank, misleading message."""
    with _attacked_while_rank_1_is_late("bad-count", 2.0), \
            pytest.raises(varcomm.TimeoutError, match=r"every rank of 2 checked in .* arrival count says -\d+: "
                                                      r"another process changed it"):
        varcomm.init(transport="shm", job_key=KEY, timeout=30, init_timeout=5, array="numpy")


@as_root
@world(2, timeout=60)
def test_forged_barrier_and_left_records_are_not_believed():
    """With a key, another user bumped the store's barrier counters, and rank
    0's barriers returned at once while rank 1 was still 1.5 s away; it
    planted rank 1's "left" record, and rank 0's close() stopped flushing and
    dropped the isends rank 1 had not yet received. Now every rank's records
    carry a MAC under the key (Setup::store_mac), and forged ones count as
    absent."""
    comm = varcomm.init(transport="shm", job_key=KEY, slots=4, bound=4096, timeout=30, array="numpy")
    if comm.rank == 0:
        attacker = _attacker("forge-store", made=True)
        out, _ = attacker.communicate(timeout=30)
        assert "planted" in out, out
    comm.barrier()  # (rank 1 waits here until the records are planted)
    if comm.rank == 1:
        time.sleep(1.5)
    t0 = time.monotonic()
    comm.barrier()
    took = time.monotonic() - t0
    if comm.rank == 0:
        assert took > 1.0, f"barrier returned after {took:.2f} s: a forged arrival was believed"
        for i in range(20):  # past the 4-slot ring: queued, flushed by close()
            comm.isend(np.full(4, float(i)), 1)
        comm.close()
    else:
        time.sleep(1.5)
        got = [float(comm.recv(0, timeout=20)[0]) for _ in range(20)]
        assert got == [float(i) for i in range(20)], got
        comm.close()
