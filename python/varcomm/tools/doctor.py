"""`varcomm-doctor`: what this machine offers varcomm, as plain text to paste into a bug report.

Works without the C extension (reports why it is missing) and without torch;
every probe degrades to "not found" rather than failing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import options as _options
from ..errors import InvalidArgument


def _run(argv: list[str], timeout: float = 30) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _build() -> tuple[dict[str, Any] | None, ModuleType | None, str]:
    try:
        from .. import _C
    except Exception as e:  # any import failure is worth reporting
        return None, None, f"C extension not importable ({type(e).__name__}: {e})"
    info = dict(getattr(_C, "build_info", {}) or {})
    return info, _C, ""


def _libfabric(C: ModuleType | None, build: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(report lines, provider names found)."""
    lines: list[str] = []
    if C is not None and build and "rdma" in build.get("transports", ()) and hasattr(C, "rdma_info"):
        try:
            text = C.rdma_info(_options.Options.resolve().placed(1).core(-1))
            lines += text.rstrip().splitlines()
        except Exception as e:
            lines.append(f"rdma_info() failed: {e}")
    else:
        name = ctypes.util.find_library("fabric") or "libfabric.so.1"
        try:
            lib = ctypes.CDLL(name)
            lib.fi_version.restype = ctypes.c_uint32
            v = lib.fi_version()
            lines.append(f"libfabric {v >> 16}.{v & 0xFFFF} ({name})")
        except OSError:
            lines.append("libfabric: not found (Debian: apt-get install libfabric-dev libfabric-bin)")
    listing = _run(["fi_info", "-l"])
    provs = [ln.strip().rstrip(":") for ln in (listing or "").splitlines() if ln.strip().endswith(":")]
    if listing is None:
        lines.append("fi_info -l: " + ("failed or timed out" if shutil.which("fi_info")
                                       else "fi_info not found (libfabric-bin)"))
    else:
        lines.append("fi_info -l: " + (", ".join(provs) or "no providers"))
    return lines, provs


def _rdma_provider_choice(fab: list[str], want: str, C: ModuleType | None) -> str:
    if want:
        return f"{want} (VARCOMM_FI_PROVIDER)"
    for ln in fab:  # the extension's own answer, when it has rdma
        if ln.strip().startswith("default provider:"):
            return ln.split(":", 1)[1].strip()
    if _run(["fi_info", "-l"]) is None:
        return "unknown (no fi_info to ask)"
    for p in getattr(C, "rdma_providers", ()):  # the rdma transport's own order
        # fi_info -p takes the layered name; -c FI_RMA keeps only domains that can do RMA writes.
        out = _run(["fi_info", "-p", p, "-t", "FI_EP_RDM", "-c", "FI_RMA"])
        if out and "provider:" in out:
            why = "no verbs/efa/cxi provider found" if p == "tcp;ofi_rxm" else "first RDMA provider found"
            return f"{p} ({why})"
    return "none usable (no RDM provider with FI_RMA)"


def _rdma_devices() -> list[str]:
    lines: list[str] = []
    try:
        import pyverbs.device as d  # type: ignore[import-not-found]

        for dev in d.get_device_list():
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            lines.append(f"{name} (pyverbs)")
        if lines:
            return lines
    except Exception:  # pyverbs is optional
        pass
    for dev in sorted(glob.glob("/sys/class/infiniband/*")):
        ports = []
        for port in sorted(glob.glob(f"{dev}/ports/*")):
            state = _read(f"{port}/state").split(":")[-1].strip()
            layer = _read(f"{port}/link_layer")
            rate = _read(f"{port}/rate")
            ports.append(f"port {Path(port).name}: {state} {layer} {rate}".strip())
        lines.append(f"{Path(dev).name}: " + ("; ".join(ports) or "no ports"))
    return lines


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _cuda_devices() -> tuple[list[str], int]:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            lines = []
            for i in range(n):
                p = torch.cuda.get_device_properties(i)
                lines.append(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB "
                             f"(torch {torch.__version__})")
            return lines, n
    except Exception:  # torch is optional
        pass
    out = _run(["nvidia-smi", "-L"])
    if out:
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        return [ln + " (nvidia-smi)" for ln in lines], len(lines)
    return [], 0


def main(argv: list[str] | None = None) -> int:
    out: list[str] = []
    w = out.append
    w("varcomm doctor")
    w(f"host: {socket.gethostname()}  {platform.platform()}  python {platform.python_version()}  cpus {os.cpu_count()}")
    build, C, why = _build()
    try:
        from importlib.metadata import version

        w(f"varcomm: {version('varcomm')}")
    except Exception:
        w("varcomm: (not installed as a distribution)")
    transports = set(build.get("transports", ())) if build else set()
    if build is None:
        w(f"build: {why}")
    else:
        w("build: " + ", ".join(f"{k}={v}" for k, v in sorted(build.items())))

    w("")
    w("libfabric:")
    fab, _ = _libfabric(C, build)
    out += ["  " + ln for ln in fab]

    w("")
    w("RDMA devices:")
    devs = _rdma_devices()
    out += ["  " + d for d in devs] or ["  none (no /sys/class/infiniband entries; tcp;ofi_rxm still works)"]

    w("")
    w("CUDA devices:")
    gpus, ngpu = _cuda_devices()
    out += ["  " + g for g in gpus] or ["  none (no torch.cuda devices, no nvidia-smi)"]

    env = _options.environment()
    known = _options.known_variables()
    if env:
        w("")
        w("environment:")
        out += [f"  {k}={v}" + ("" if k in known or not k.startswith("VARCOMM_") or k.startswith("VARCOMM_BENCH_")
                                else "  (not a varcomm variable: misspelt?)") for k, v in env.items()]
    try:
        opts = _options.Options.resolve()
    except InvalidArgument as e:
        w(f"  bad option: {e}")
        opts = _options.Options()

    w("")
    w("transport per peer class:")
    forced = opts.transport
    fallback = ("fallback: varcomm's slot writes carried by torch.distributed gloo (transport/fallback; "
                "GPU tensors staged through host memory)")
    if forced == "fallback":
        w(f"  every pair: {fallback} (VARCOMM_TRANSPORT=fallback)")
    else:
        shm = "shm (mapped host memory)" if build is not None else f"unknown: {why}"
        if forced == "rdma":
            shm = "rdma (VARCOMM_TRANSPORT=rdma forces it on the same host too)"
        w(f"  same host, host memory:  {shm}")
        if "nvlink" in transports:
            gpu = "nvlink (CUDA IPC, stream-ordered)" + ("" if ngpu >= 2 else f"; {ngpu or 'no'} GPU visible here")
        else:
            gpu = "no device transport in this build (no CUDA): CUDA tensors are staged through host memory"
        w(f"  same host, GPU memory:   {gpu}")
        if "rdma" in transports:
            remote = "rdma, provider " + _rdma_provider_choice(fab, opts.rdma_provider, C)
        elif build is None:
            remote = f"unknown: {why}"
        else:
            remote = ("the fallback: this build has no rdma (pkg-config found no libfabric at build time, "
                      "or VARCOMM_NO_RDMA was set)")
        w(f"  other host:              {remote}")
        w(f"  nothing fits:            {fallback}")
        w("  (VARCOMM_TRANSPORT=shm|rdma|fallback forces one; rdma: VARCOMM_FI_PROVIDER, VARCOMM_FI_IFACE)")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
