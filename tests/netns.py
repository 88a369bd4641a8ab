"""Separate network stacks on one machine, for tests that need "other hosts".

    from netns import Netns, require_netns   # tests/ is on sys.path (conftest.py)
    require_netns()                      # pytest.skip with the reason when not possible
    with Netns(3) as net:                # 3 namespaces on one bridge, 10.77.0.1 .. 10.77.0.3
        p = net.popen(0, [sys.executable, "worker.py"], env=...)
        net.link_down(2)                 # pull rank 2's cable: it can reach no one
        net.link_up(2)

Layout: a hidden hub namespace holds a bridge; member i has one veth, named
`eth0` inside it, address 10.77.0.<i+1>/24, and loopback up. All addresses live
only inside namespaces this helper creates, so nothing outside is touched.
Everything is deleted on exit (deleting a namespace deletes its veths).
Needs root and iproute2; `available()` says why not.

A namespace alone is not another host to varcomm: ranks count as one host
when their host name and boot id agree (csrc/registry.cpp host_key), so
under transport=auto they still pick shm / nvlink. Force the route
(VARCOMM_TRANSPORT=rdma), or give a member its own host name as well
(`unshare --uts` and `hostname`, as tests/test_rdma_gpu.py does).
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

IFACE = "eth0"  # the member's interface name: pass it as VARCOMM_FI_IFACE
_counter = itertools.count()
_probe: tuple[bool, str] | None = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> tuple[bool, str]:
    """(True, "") when namespaces + veth + bridge can be made here, else (False, why)."""
    global _probe
    if _probe is not None:
        return _probe
    if not sys.platform.startswith("linux"):
        _probe = (False, "network namespaces need Linux")
    elif os.geteuid() != 0:
        _probe = (False, "creating network namespaces needs root")
    elif not shutil.which("ip"):
        _probe = (False, "iproute2 `ip` not found")
    else:
        try:
            with Netns(1):
                pass
            _probe = (True, "")
        except (subprocess.CalledProcessError, OSError) as e:
            err = getattr(e, "stderr", "") or str(e)
            _probe = (False, f"cannot create namespaces/veth/bridge here: {err.strip()}")
    return _probe


def require_netns() -> None:
    """Skip the calling pytest test cleanly when namespaces are unavailable."""
    ok, why = available()
    if not ok:
        import pytest

        pytest.skip(why)


class Netns:
    def __init__(self, n: int = 2, subnet: str = "10.77.0"):
        if not 1 <= n <= 250:
            raise ValueError("1 <= n <= 250")
        self.n = n
        self.subnet = subnet
        tag = f"vc{os.getpid()}x{next(_counter)}"
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-{i}" for i in range(n)]
        self._made: list[str] = []

    # -- addressing -------------------------------------------------------
    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside member i."""
        return ["ip", "netns", "exec", self.names[i]]

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(i), *argv], **kw)

    def run(self, i: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(i), *argv], **kw)

    # -- faults -------------------------------------------------------------
    def link_down(self, i: int) -> None:
        """Take member i's link down: its traffic to every other member stops."""
        _ip("-n", self.names[i], "link", "set", IFACE, "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", IFACE, "up")
        _ip("-n", self.names[i], "route", "replace", f"{self.subnet}.0/24", "dev", IFACE, check=False)

    def down_command(self, i: int) -> str:
        """The shell command link_down(i) runs, for programs that pull the cable themselves."""
        return f"ip -n {self.names[i]} link set {IFACE} down"

    # -- lifetime -----------------------------------------------------------
    def __enter__(self) -> Netns:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self._add(ns)
                _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", f"v{i}", "netns", self.hub)
                _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"v{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFACE)
                _ip("-n", ns, "link", "set", IFACE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)


_PROBE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
s.close()
"""
_LISTEN = """
import socket, sys
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], 7777)); l.listen(8); print("up", flush=True)
while True:
    l.accept()[0].close()
"""


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Every member process's (exit status, output), killing those still running at `timeout`."""
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
            o += "\n[killed at the test timeout]"
        out.append((p.returncode, o))
    return out


def wait_flag(path: Path, timeout: float) -> None:
    """Until a member process creates `path` (its way of saying it got somewhere)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def lose_member_mid_stream(net: Netns, procs: list[subprocess.Popen], flags: Path, how: str,
                           timeout: float, members: int = 2) -> list[tuple[int, str]]:
    """Members 0 and 1 exchange messages with member 2 until it is lost (`how`:
    its link pulled, or the process killed): each of them must print "OK <rank>"
    and when it saw PeerFailure ("PeerFailure after <s>s"), within seconds.
    `members` 3: member 2 (its link pulled, alive) must print "OK 2" too.
    Returns every waited member's (exit status, output)."""
    import signal

    def lose() -> None:
        if how == "link_down":
            net.link_down(2)
        else:
            procs[2].send_signal(signal.SIGKILL)

    res = run_after_ready(procs, flags, lose, timeout, members)
    took = float(res[0][1].split("PeerFailure after ")[1].split("s")[0])
    assert took < 15, f"dead peer detected only after {took} s"
    return res


def run_after_ready(procs: list[subprocess.Popen], flags: Path, act: Callable[[], None], timeout: float,
                    members: int) -> list[tuple[int, str]]:
    """Once members 0 and 1 flagged "ready", act(); then the first `members`
    must each exit 0 printing "OK <rank>" (all are killed at the end, done or
    not). Returns their (exit status, output)."""
    try:
        wait_flag(flags / "ready0", timeout)
        wait_flag(flags / "ready1", timeout)
        act()
        res = finish(procs[:members], timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (code, out) in enumerate(res):
        assert code == 0 and f"OK {r}" in out, f"rank {r} (exit {code}):\n{out[-3000:]}"
    return res


def selfcheck() -> None:
    """Three members: all reach each other; member 2's link down cuts only member 2; back up heals it."""
    ok, why = available()
    if not ok:
        print(f"netns selfcheck skipped: {why}")
        return
    with Netns(3) as net:
        servers = [net.popen(i, [sys.executable, "-c", _LISTEN, net.addr(i)], stdout=subprocess.PIPE, text=True)
                   for i in range(3)]
        try:
            for s in servers:
                assert s.stdout.readline().strip() == "up"

            def reach(a: int, b: int) -> bool:
                r = net.run(a, [sys.executable, "-c", _PROBE, net.addr(b), "7777"], capture_output=True)
                return r.returncode == 0

            assert reach(0, 1) and reach(0, 2) and reach(2, 1), "members cannot reach each other"
            net.link_down(2)
            assert reach(0, 1), "link down on 2 cut 0-1 too"
            assert not reach(0, 2) and not reach(2, 1), "link down on 2 did not cut it off"
            net.link_up(2)
            assert reach(0, 2), "link up on 2 did not heal it"
        finally:
            for s in servers:
                s.kill()
                s.wait()
    print("netns selfcheck passed: 3 members, link down/up isolates and heals one member")


if __name__ == "__main__":
    selfcheck()
