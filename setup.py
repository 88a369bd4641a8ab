"""Builds varcomm._C with ninja: parallel and incremental, C++17, no torch.

Optional parts are detected here and reported in one line:
libfabric (pkg-config) -> rdma transport, nvcc -> nvlink transport.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _pkg_config(name: str) -> tuple[list[str], list[str], str] | None:
    if os.environ.get("VARCOMM_NO_RDMA") or not shutil.which("pkg-config"):
        return None
    try:
        cflags = subprocess.check_output(["pkg-config", "--cflags", name], text=True, stderr=subprocess.DEVNULL)
        libs = subprocess.check_output(["pkg-config", "--libs", name], text=True, stderr=subprocess.DEVNULL)
        ver = subprocess.check_output(["pkg-config", "--modversion", name], text=True, stderr=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, OSError):
        return None
    return shlex.split(cflags), shlex.split(libs), ver.strip()


def _nvcc() -> str | None:
    if os.environ.get("VARCOMM_NO_CUDA"):
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [Path(home) / "bin" / "nvcc"] if home else []
    which = shutil.which("nvcc")
    if which:
        cands.append(Path(which))
    cands.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in cands:
        if c.exists():
            return str(c.resolve())
    return None


def sources() -> dict[str, list[Path]]:
    return {
        "core": sorted((ROOT / "csrc").glob("*.cpp")),
        "shm": sorted((ROOT / "transport" / "shm").glob("*.cpp")),
        "rdma": [p for p in sorted((ROOT / "transport" / "rdma").glob("*.cpp")) if p.name != "selftest.cpp"],
        "nvlink": sorted((ROOT / "transport" / "nvlink").glob("*.cu"))
        + sorted((ROOT / "transport" / "nvlink").glob("*.cpp")),
    }


class NinjaBuildExt(build_ext):
    """Writes build/<tag>/build.ninja and runs ninja on it."""

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        src = sources()
        parts = ["shm"]
        defines: list[str] = []
        cflags: list[str] = []
        ldflags: list[str] = []
        files = src["core"] + src["shm"]
        notes = []

        fab = _pkg_config("libfabric")
        if fab and src["rdma"]:
            parts.append(f"rdma (libfabric {fab[2]})")
            defines.append("-DVARCOMM_HAVE_RDMA")
            cflags += fab[0]
            ldflags += fab[1]
            files += src["rdma"]
        else:
            notes.append("rdma: no (libfabric-dev not found by pkg-config)" if not fab else "rdma: no sources")

        nvcc = _nvcc()
        cu_files: list[Path] = []
        cu_src = [p for p in src["nvlink"] if p.suffix == ".cu"]
        # The nvlink transport loads the CUDA driver at run time (dlopen) and
        # needs no CUDA header or library to build: only .cu files need nvcc.
        if src["nvlink"] and not os.environ.get("VARCOMM_NO_CUDA") and (nvcc or not cu_src):
            archs = os.environ.get("VARCOMM_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
            parts.append(f"nvlink (nvcc {nvcc}, sm_{'/'.join(archs)})" if cu_src else "nvlink (driver loaded at run time)")
            defines.append("-DVARCOMM_HAVE_CUDA")
            ldflags += ["-ldl"]
            cu_files = cu_src
            files += [p for p in src["nvlink"] if p.suffix == ".cpp"]
        else:
            archs = []
            notes.append("nvlink: no sources" if not src["nvlink"] else
                         "nvlink: no (VARCOMM_NO_CUDA)" if os.environ.get("VARCOMM_NO_CUDA") else
                         "nvlink: no (nvcc not found)")

        print(f"varcomm: building transports: {', '.join(parts)}" + (f"; {'; '.join(notes)}" if notes else ""),
              flush=True)

        build_dir = ROOT / "build" / f"{sys.implementation.cache_tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)

        includes = [f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'transport' / 'shm'}", f"-I{ROOT / 'transport' / 'rdma'}",
                    f"-I{ROOT / 'transport' / 'nvlink'}", f"-I{pybind11.get_include()}",
                    f"-I{sysconfig.get_paths()['include']}"]
        opt = os.environ.get("VARCOMM_OPT", "-O2")
        cxx = os.environ.get("CXX", "g++")
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
            f"cxxflags = -std=c++17 -fPIC -fvisibility=hidden {opt} -g -Wall -Wextra -Wno-unused-parameter "
            + " ".join(includes + defines + cflags),
            f"ldflags = -shared {' '.join(ldflags)} -lpthread",
            "rule cxx",
            "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = CXX $in",
            "rule link",
            "  command = $cxx $in -o $out $ldflags",
            "  description = LINK $out",
        ]
        if cu_files:
            gencode = " ".join(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)
            lines += [
                f"nvcc = {nvcc}",
                f"nvccflags = -std=c++17 -O2 -Xcompiler -fPIC {gencode} " + " ".join(includes + defines),
                "rule nvcc",
                "  command = $nvcc -MD -MF $out.d $nvccflags -c $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                "  description = NVCC $in",
            ]
        objs = []
        for f in files:
            obj = build_dir / (f.relative_to(ROOT).as_posix().replace("/", "_") + ".o")
            lines.append(f"build {obj}: cxx {f}")
            objs.append(obj)
        for f in cu_files:
            obj = build_dir / (f.relative_to(ROOT).as_posix().replace("/", "_") + ".o")
            lines.append(f"build {obj}: nvcc {f}")
            objs.append(obj)
        lines.append(f"build {out}: link {' '.join(map(str, objs))}")
        text = "\n".join(lines) + "\n"
        ninja_file = build_dir / "build.ninja"
        if not ninja_file.exists() or ninja_file.read_text() != text:
            ninja_file.write_text(text)
        ninja = shutil.which("ninja")
        if not ninja:
            try:
                import ninja as ninja_mod  # type: ignore[import-not-found]

                ninja = str(Path(ninja_mod.BIN_DIR) / "ninja")
            except ImportError as e:
                raise RuntimeError("ninja is needed to build varcomm: pip install ninja") from e
        subprocess.check_call([ninja, "-C", str(build_dir)])


setup(
    ext_modules=[Extension("varcomm._C", sources=[])],
    cmdclass={"build_ext": NinjaBuildExt},
)
