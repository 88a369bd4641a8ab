"""Exceptions raised by varcomm. The C++ core maps its error kinds onto these."""
from __future__ import annotations

import builtins
from typing import Callable


class VarcommError(RuntimeError):
    """Base class of every varcomm error. `peer` names the rank involved, if any."""

    peer: int | None = None


class InvalidArgument(VarcommError, ValueError):
    """A bad argument: peer out of range, unsupported dtype, non-contiguous buffer..."""


class MessageTooLarge(VarcommError):
    """A message does not fit: over the receiver's bound (raised on the sender before
    anything is written), or over the capacity of a recv's `out` buffer (the message
    is kept for the next recv)."""


class MessageMismatch(VarcommError):
    """A recv's `out` buffer has another dtype than the message; the message is kept."""


class TimeoutError(VarcommError, builtins.TimeoutError):  # mirrors the builtin on purpose
    """An operation did not complete in time; it was cancelled and the channel stays usable."""


class PeerFailure(VarcommError):
    """A peer process died or became unreachable; every operation with it fails."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        if _on_peer_failure is not None:
            _on_peer_failure()


#: Under varcomm-run: tells the launcher that this rank met a peer's failure
#: (tools/run.py mark_peer_failures), whether or not its program catches it.
_on_peer_failure: Callable[[], None] | None = None


class ClosedError(VarcommError):
    """The communicator was closed."""


__all__ = [
    "VarcommError",
    "InvalidArgument",
    "MessageTooLarge",
    "MessageMismatch",
    "TimeoutError",
    "PeerFailure",
    "ClosedError",
]
