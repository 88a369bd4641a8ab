"""Shared test helpers: which transports to run, dtype cases, payload checks."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import varcomm

TRANSPORTS = [t for t in ("shm", "rdma") if t in varcomm.build_info()["transports"]] + ["fallback"]

# Every torch dtype with a fixed element size that this torch has.
FIXED_DTYPES = [getattr(torch, n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
) if hasattr(torch, n)]


def dtype_cases(bound: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Per dtype: 0-d, empty, a small 3-d block, and exactly the bound."""
    cases = []
    for dt in FIXED_DTYPES:
        isz = torch.empty((), dtype=dt).element_size()
        cases += [(dt, ()), (dt, (0,)), (dt, (2, 0, 3)), (dt, (3, 5, 7)), (dt, (bound // isz,))]
    return cases


def make_tensor(dt: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic bytes for any dtype (built as raw bytes, so float8 and bool work)."""
    n = 1
    for s in shape:
        n *= s
    isz = torch.empty((), dtype=dt).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * isz,), dtype=torch.uint8, generator=g)
    if dt == torch.bool:
        raw &= 1
    return raw.view(dt).reshape(shape)


def same_bytes(a, b) -> bool:
    a = torch.as_tensor(a) if not isinstance(a, torch.Tensor) else a
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
