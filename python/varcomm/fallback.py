"""The fallback's byte mover: torch.distributed gloo threads that carry the
``fallback`` transport's writes (transport/fallback) for peers no native
transport reaches, or everywhere with VARCOMM_TRANSPORT=fallback. Also the
baseline the benchmarks beat.

The core decides everything about a message, as for shm: slot, header, order,
matching, fit and errors. The C++ transport turns each one-sided write (a
message into the receiver's slot, or a credit back) into an op with a
fixed-size frame; this module only moves frames and payloads.

How it works, and why this shape:

* Our own ``ProcessGroupGloo`` over ``PrefixStore("fallback/", store)``: the
  user's default process group is never touched. Creating it is collective:
  every rank of the job creates it as soon as any pair needs it.
* gloo's send/recv works cannot be polled: ``is_completed()`` only turns true
  inside ``wait()``, and a ``wait(timeout)`` that expires poisons every pair
  of the group ("Application timeout caused pair closure"). So the group is
  made with an effectively infinite timeout, and only blocking ``wait()``
  (which releases the GIL) is ever called, on the threads below; callers
  wait in the core, with varcomm's own timeout.
* Per fallback peer one sender thread: ``next_op`` (waits without the GIL),
  gloo-send the frame, then the payload straight from the sender's buffer,
  then ``op_sent`` (the core may hand the buffer back). And one receiver
  thread that always has a frame recv posted: ``landing`` checks the frame
  and names our slot, the payload is received straight into it, ``landed``
  publishes it. One gloo tag: each direction of a pair has one thread on each
  side, so frames and payloads pair up by order.
* A dead peer closes its TCP connections: the always-posted frame recv fails
  at once, and the core fails every request with that peer (PeerFailure).
* close() queues a goodbye behind what is queued to each peer; the peer's
  receiver answers it once, so every thread here ends (needed before
  interpreter exit; see close()).
* Self-sends never get here (the route to self is local memory).
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

from .errors import VarcommError

#: close() waits at most this long for each live peer to answer its goodbye.
_CLOSE_WAIT_S = 10.0
_FOREVER = timedelta(days=3650)  # gloo's own timeout must never fire (it poisons the whole group)
_TAG = 0


def _gloo_reason(e: BaseException) -> str:
    """gloo's message without its source-path prefix and first line only."""
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if s.startswith("[") and "] " in s:
        s = s.split("] ", 1)[1]
    return s.split(" This is typically", 1)[0]


class Fallback:
    """The gloo group, and the mover threads for the peers the core routed
    through the fallback (``mover.peers``; see the module doc)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float | None, mover: Any):
        import torch.distributed as dist

        self._mover = mover
        self._pg: Any = None
        self._threads: list[threading.Thread] = []
        self._closed = False
        # Rendezvous through the store under our own timeout first: the group
        # itself is made with a practically infinite one (see the module doc).
        store.set(f"fallback_meta/rank/{rank}", "1")
        keys = [f"fallback_meta/rank/{r}" for r in range(world_size)]
        wait_s = timeout if timeout is not None else 300.0
        try:
            store.wait(keys, timedelta(seconds=wait_s))
        except Exception as e:  # DistStoreError / RuntimeError, depending on the store
            raise VarcommError(
                f"fallback: timed out after {wait_s:.3g} s waiting for all {world_size} ranks to create the "
                "torch.distributed fallback (every rank must create it, even one that uses no fallback route) "
                f"({_gloo_reason(e)})") from None
        try:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("fallback/", store), rank, world_size, _FOREVER)
        except Exception as e:
            raise VarcommError(f"fallback: could not create the gloo process group: {_gloo_reason(e)} "
                               "(GLOO_SOCKET_IFNAME selects the interface)") from None
        _live.add(self)
        for p in mover.peers:
            for loop, what in ((_send_loop, "send"), (_recv_loop, "recv")):
                th = threading.Thread(target=loop, args=(self._pg, mover, p), name=f"varcomm-fallback-{what}-{p}",
                                      daemon=True)
                th.start()
                self._threads.append(th)

    def close(self) -> None:
        """Say goodbye to every peer, behind what is still queued to it, and wait
        (bounded) until each live peer answered, so that every thread has ended.
        This matters at exit: a thread woken inside gloo while the interpreter
        finalizes is killed with pthread_exit, which aborts the process
        ("terminate called without an active exception")."""
        if self._closed:
            return
        self._closed = True
        if self._pg is None:
            return
        self._mover.shutdown()
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        # Threads still running (a hung peer) hold their own reference to the group.
        self._pg = None
        _live.discard(self)


def _send_loop(pg: Any, mover: Any, dst: int) -> None:
    import torch

    frame = torch.empty(mover.frame_bytes, dtype=torch.uint8)
    fview = frame.numpy()  # next_op writes each op's frame here
    while True:
        op = mover.next_op(dst, fview)
        if op is None:
            return
        ticket, payload = op
        try:
            works = [pg.send([frame], dst, _TAG)]
            if payload is not None:
                works.append(pg.send([torch.frombuffer(payload, dtype=torch.uint8)], dst, _TAG))
            for w in works:
                w.wait()  # releases the GIL; never times out (see the module doc)
        except Exception as e:  # gloo raises RuntimeError subclasses
            mover.op_failed(dst, _gloo_reason(e))
            return
        mover.op_sent(dst, ticket)


def _recv_loop(pg: Any, mover: Any, src: int) -> None:
    import torch

    frame = torch.empty(mover.frame_bytes, dtype=torch.uint8)
    fview = frame.numpy()
    while True:
        try:
            pg.recv([frame], src, _TAG).wait()
            slot = mover.landing(src, fview)
            if slot is True:
                continue
            if slot is False:
                return  # src closed: nothing more comes from it
            if len(slot):
                pg.recv([torch.frombuffer(slot, dtype=torch.uint8)], src, _TAG).wait()
            mover.landed(src)
        except VarcommError:
            return  # a frame landing() refused: it failed src already
        except Exception as e:  # gloo raises RuntimeError subclasses
            mover.fail(src, _gloo_reason(e))
            return


_live: weakref.WeakSet[Fallback] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Communicators left open at exit: say goodbye to peers and let the mover
    threads end before the interpreter finalizes (see Fallback.close)."""
    for fb in list(_live):
        try:
            fb.close()
        except Exception:
            pass


__all__ = ["Fallback"]
