"""varcomm: variable-size point-to-point and all-to-all for pipeline- and
expert-parallel training. Receivers own bound-sized buffers; senders write into
them one-sidedly; size, dtype and shape travel with the data."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ClosedError,
    InvalidArgument,
    MessageMismatch,
    MessageTooLarge,
    PeerFailure,
    TimeoutError,
    VarcommError,
)
from .work import Work

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ._C import Status
    from .comm import Communicator, P2POp, P2PWork, init
    from .options import Options


def __getattr__(name: str) -> Any:
    # Lazy: `python -m varcomm.run` and the harness must start without torch.
    if name in ("init", "Communicator", "P2POp", "P2PWork"):
        from . import comm

        return getattr(comm, name)
    if name == "Options":  # lazy too, so `python -m varcomm.options` runs the module once
        from .options import Options

        return Options
    if name == "Status":  # a received message's header (recv_into, Work results' metadata)
        from ._C import Status

        return Status
    raise AttributeError(f"module 'varcomm' has no attribute {name!r}")


def build_info() -> dict[str, object]:
    """Which transports this build has (shm always; rdma with libfabric; nvlink with CUDA)."""
    from . import _C

    return dict(_C.build_info)


__all__ = [
    "init", "Communicator", "Work", "P2PWork", "P2POp", "Options", "Status", "build_info",
    "VarcommError", "InvalidArgument", "MessageTooLarge", "MessageMismatch", "TimeoutError", "PeerFailure",
    "ClosedError",
]
