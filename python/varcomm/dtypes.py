"""Dtype words on the wire: DLPack (code << 16 | bits << 8 | lanes).

One table for torch and numpy, so a message sent from either kind of array is
received as the same dtype by the other (where that kind has it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

# DLPack type codes (dlpack.h, DLDataTypeCode).
INT, UINT, FLOAT, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 4, 5, 6
F8_E4M3FN, F8_E4M3FNUZ, F8_E5M2, F8_E5M2FNUZ, F8_E8M0FNU, F4_E2M1FN = 10, 11, 12, 13, 14, 17
OPAQUE = 0x80  # varcomm-private: raw bits types with no arithmetic meaning


def word(code: int, bits: int, lanes: int = 1) -> int:
    return (code << 16) | (bits << 8) | lanes


def itemsize(w: int) -> int:
    return (((w >> 8) & 0xFF) * max(w & 0xFF, 1) + 7) // 8


_NUMPY: dict[np.dtype[Any], int] = {
    np.dtype(np.bool_): word(BOOL, 8),
    np.dtype(np.int8): word(INT, 8),
    np.dtype(np.int16): word(INT, 16),
    np.dtype(np.int32): word(INT, 32),
    np.dtype(np.int64): word(INT, 64),
    np.dtype(np.uint8): word(UINT, 8),
    np.dtype(np.uint16): word(UINT, 16),
    np.dtype(np.uint32): word(UINT, 32),
    np.dtype(np.uint64): word(UINT, 64),
    np.dtype(np.float16): word(FLOAT, 16),
    np.dtype(np.float32): word(FLOAT, 32),
    np.dtype(np.float64): word(FLOAT, 64),
    np.dtype(np.complex64): word(COMPLEX, 64),
    np.dtype(np.complex128): word(COMPLEX, 128),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}

_TORCH: dict[torch.dtype, int] = {}
_FROM_TORCH: dict[int, torch.dtype] = {}


def _torch_table() -> None:
    import torch

    names = {
        "bool": word(BOOL, 8),
        "int8": word(INT, 8), "int16": word(INT, 16), "int32": word(INT, 32), "int64": word(INT, 64),
        "uint8": word(UINT, 8), "uint16": word(UINT, 16), "uint32": word(UINT, 32), "uint64": word(UINT, 64),
        "float16": word(FLOAT, 16), "float32": word(FLOAT, 32), "float64": word(FLOAT, 64),
        "bfloat16": word(BFLOAT, 16),
        "complex32": word(COMPLEX, 32), "complex64": word(COMPLEX, 64), "complex128": word(COMPLEX, 128),
        "float8_e4m3fn": word(F8_E4M3FN, 8), "float8_e4m3fnuz": word(F8_E4M3FNUZ, 8),
        "float8_e5m2": word(F8_E5M2, 8), "float8_e5m2fnuz": word(F8_E5M2FNUZ, 8),
        "float8_e8m0fnu": word(F8_E8M0FNU, 8), "float4_e2m1fn_x2": word(F4_E2M1FN, 4, 2),
        "bits8": word(OPAQUE, 8), "bits16": word(OPAQUE, 16),
    }
    for name, w in names.items():
        dt = getattr(torch, name, None)
        if dt is not None:
            _TORCH[dt] = w
            _FROM_TORCH[w] = dt


def torch_words() -> dict[torch.dtype, int]:
    """Every torch dtype varcomm carries, with its dtype word."""
    if not _TORCH:
        _torch_table()
    return _TORCH


def from_torch(dtype: torch.dtype) -> int:
    try:
        return _TORCH[dtype]
    except KeyError:
        if not _TORCH:
            _torch_table()
            return from_torch(dtype)
        from .errors import InvalidArgument

        raise InvalidArgument(f"dtype {dtype} is not supported by varcomm (quantized and sub-byte types are not); "
                              "send a tensor of a fixed-size dtype, e.g. t.int_repr()") from None


def to_torch(w: int) -> torch.dtype:
    if not _TORCH:
        _torch_table()
    try:
        return _FROM_TORCH[w]
    except KeyError:
        from .errors import InvalidArgument

        raise InvalidArgument(f"received dtype word {w:#x} has no torch equivalent in this torch version") from None


def from_numpy(dtype: npt.DTypeLike) -> int:
    try:
        return _NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        from .errors import InvalidArgument

        raise InvalidArgument(f"numpy dtype {dtype} is not supported by varcomm; "
                              "use a fixed-size numeric or bool dtype") from None


def to_numpy(w: int) -> np.dtype[Any]:
    try:
        return _FROM_NUMPY[w]
    except KeyError:
        from .errors import InvalidArgument

        raise InvalidArgument(f"received dtype {describe(w)} has no numpy equivalent; receive it as a torch "
                              "tensor: recv(..., array='torch') for this call, varcomm.init(array='torch') for "
                              "all, or a torch out= of that dtype (the message was kept for the next recv)") from None


def describe(w: int) -> str:
    """The dtype word's name (torch's spelling: "bfloat16", "float8_e4m3fn"); the
    core's table (csrc/dtypes.h), which names dtypes in every error."""
    from . import _C

    return _C.dtype_name(w)
