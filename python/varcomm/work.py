"""The one protocol of a pending operation.

Whatever carries it (a point-to-point message, an all-to-all, a
``varcomm.distributed`` receive, the torch backend's ``dist.Work``), a
pending operation is a ``Work``: ``wait()`` finishes it and returns its
result, ``is_completed()`` polls, ``synchronize()`` also blocks the host
until device work the operation queued has run (for host memory it is
``wait()``), and ``result()`` is ``wait()`` without a timeout."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Work"]


@runtime_checkable
class Work(Protocol):
    """A pending operation. ``isinstance(w, varcomm.Work)`` holds for every
    object varcomm returns for one. ``timeout`` is in seconds (None: the
    communicator's); what ``wait`` returns depends on the operation (the
    received array, None for a send, an all-to-all's output)."""

    def wait(self, timeout: float | None = None) -> Any:
        """Finish the operation and return its result; raise its error (a
        TimeoutError cancels what had not started; waiting again raises the
        same error)."""

    def is_completed(self) -> bool:
        """True once wait() would return (or raise) at once."""

    def synchronize(self, timeout: float | None = None) -> Any:
        """wait(), then block the host until the GPU work it queued has run."""

    def result(self) -> Any:
        """wait() with the communicator's timeout."""
