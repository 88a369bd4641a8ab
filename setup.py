"""Builds varcomm._C with ninja: parallel and incremental, C++17, no torch.

Optional parts are detected here and reported in one line:
libfabric (pkg-config) -> rdma transport; the nvlink transport needs no CUDA
to build (it loads the driver at run time), and nvcc adds its small-message
kernel (transport/nvlink/kernels.cu -> a fatbin embedded in the extension).

CUDA knobs: VARCOMM_NO_CUDA=1 (no nvlink transport), VARCOMM_NVCC=path (or
"none"), VARCOMM_CUDA_ARCHS (default "80;90": sm_80 and sm_90 machine code,
compute_90 PTX for newer GPUs; entries like "8.6", "90a", "80+PTX").
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _pkg_config(name: str) -> tuple[list[str], str, str] | None:
    """(cflags, libdir, version) of an installed package, or None."""
    if os.environ.get("VARCOMM_NO_RDMA") or not shutil.which("pkg-config"):
        return None

    def query(*args: str) -> str:
        return subprocess.check_output(["pkg-config", *args, name], text=True, stderr=subprocess.DEVNULL).strip()

    try:
        return shlex.split(query("--cflags")), query("--variable=libdir"), query("--modversion")
    except (subprocess.CalledProcessError, OSError):
        return None


def _real_nvcc(path: Path) -> Path:
    """`path`, or the nvcc that it execs when it is a wrapper script (a
    /usr/local/bin/nvcc that runs /usr/local/cuda-X/bin/nvcc)."""
    path = path.resolve()
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return path
    if not head.startswith(b"#!"):
        return path
    for m in re.finditer(rb"(/[^\s\"'`;|&<>()$]*/bin/nvcc)(?![\w.-])", head):
        cand = Path(m.group(1).decode(errors="replace"))
        try:
            if cand.is_file() and cand.resolve() != path and not cand.read_bytes()[:2] == b"#!":
                return cand.resolve()
        except OSError:
            continue
    return path  # a wrapper we cannot see through: it still runs


def _nvcc() -> tuple[str | None, str]:
    """(the real nvcc or None, its version or why none). Order: VARCOMM_NVCC,
    CUDA_HOME / CUDA_PATH, /usr/local/cuda/bin/nvcc, then nvcc on PATH."""
    forced = os.environ.get("VARCOMM_NVCC")
    if forced is not None:
        if forced.lower() in ("", "0", "none", "no"):
            return None, "VARCOMM_NVCC=none"
        cands = [Path(forced)]
    else:
        cands = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
        cands.append(Path("/usr/local/cuda/bin/nvcc"))
        which = shutil.which("nvcc")
        if which:
            cands.append(Path(which))
    for c in cands:
        if not c.is_file():
            continue
        real = _real_nvcc(c)
        try:
            ver = subprocess.run([str(real), "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"release (\d+\.\d+)", ver.stdout)
        if ver.returncode == 0 and m:
            return str(real), m.group(1)
    return None, (f"VARCOMM_NVCC={forced} is not a usable nvcc" if forced is not None else "no nvcc")


def _cuda_archs(spec: str) -> tuple[list[str], list[str]]:
    """VARCOMM_CUDA_ARCHS -> (nvcc -gencode flags, images). Machine code for each
    entry; PTX for those marked +PTX, or else for the last one (newer GPUs JIT it)."""
    items = [x for x in re.split(r"[;,\s]+", spec) if x]
    archs = []
    for it in items:
        ptx = it.upper().endswith("+PTX")
        core = (it[:-4] if ptx else it).lower()
        for pre in ("sm_", "compute_"):
            core = core[len(pre):] if core.startswith(pre) else core
        core = core.replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", core):
            raise SystemExit(f"VARCOMM_CUDA_ARCHS={spec!r}: bad entry {it!r} "
                             "(use e.g. '80;90', '8.6', '90a', '90+PTX')")
        archs.append([core, ptx])
    if not archs:
        raise SystemExit(f"VARCOMM_CUDA_ARCHS={spec!r}: no architecture")
    if not any(ptx for _, ptx in archs):
        archs[-1][1] = True
    flags, images = [], []
    for core, ptx in archs:
        codes = [f"sm_{core}"] + ([f"compute_{core}"] if ptx else [])
        flags.append(f"-gencode=arch=compute_{core},code=[{','.join(codes)}]")
        images += codes
    return flags, images


def sources() -> dict[str, list[Path]]:
    return {
        "core": sorted((ROOT / "csrc").glob("*.cpp")) + sorted((ROOT / "csrc" / "python").glob("*.cpp")),
        "shm": sorted((ROOT / "transport" / "shm").glob("*.cpp")),
        "fallback": sorted((ROOT / "transport" / "fallback").glob("*.cpp")),
        "rdma": [p for p in sorted((ROOT / "transport" / "rdma").glob("*.cpp")) if p.name != "selftest.cpp"],
        "nvlink": sorted((ROOT / "transport" / "nvlink").glob("*.cu"))
        + sorted((ROOT / "transport" / "nvlink").glob("*.cpp")),
    }


class NinjaBuildExt(build_ext):
    """Writes build/<tag>/build.ninja and runs ninja on it."""

    def build_extension(self, ext: Extension) -> None:
        if isinstance(ext, _Built):
            # Its own ninja target, after varcomm._C's: a torch whose headers it
            # does not compile against (an older or newer C++ API) leaves the
            # torch paths in Python, it does not fail the build.
            out = Path(self.get_ext_fullpath(ext.name)).resolve()
            if subprocess.call([*self._ninja, str(out)]) != 0:
                print("varcomm: torch adapter: FAILED to build against this torch (above): torch tensors take the "
                      "Python paths; varcomm itself is built", flush=True)
                out.unlink(missing_ok=True)
                (ROOT / "python" / "varcomm" / out.name).unlink(missing_ok=True)  # (an earlier build's)
                self.extensions.remove(ext)  # (the last one: nothing to copy in place)
            return
        import pybind11

        src = sources()
        parts = ["shm", "fallback"]
        defines: list[str] = []
        cflags: list[str] = []
        ldflags: list[str] = []
        files = src["core"] + src["shm"] + src["fallback"]
        notes = []

        # The rdma transport loads libfabric at run time (transport/rdma/fabric_lib.h):
        # its headers are needed to build, the library only where rdma is used.
        fab = _pkg_config("libfabric")
        if fab and src["rdma"]:
            parts.append(f"rdma (libfabric {fab[2]}, loaded at run time)")
            defines += ["-DVARCOMM_HAVE_RDMA", shlex.quote(f'-DVARCOMM_LIBFABRIC_DIR="{fab[1]}"')]
            cflags += fab[0]
            ldflags += ["-ldl"]
            files += src["rdma"]
        else:
            notes.append("rdma: no (libfabric-dev not found by pkg-config)" if not fab else "rdma: no sources")

        # The nvlink transport loads the CUDA driver at run time (dlopen) and
        # needs no CUDA header or library to build. nvcc, when found, adds its
        # kernels: kernels.cu -> a fatbin -> bytes in a generated .cpp, loaded
        # with cuModuleLoadData (no libcudart), so the package still imports
        # and builds without a GPU, a driver or nvcc.
        cu_src = ROOT / "transport" / "nvlink" / "kernels.cu"
        fatbin_images: list[str] = []
        gencode: list[str] = []
        nvcc: str | None = None
        if src["nvlink"] and not os.environ.get("VARCOMM_NO_CUDA"):
            defines.append("-DVARCOMM_HAVE_CUDA")
            ldflags += ["-ldl"]
            files += [p for p in src["nvlink"] if p.suffix == ".cpp"]
            nvcc, nvcc_note = _nvcc() if cu_src.exists() else (None, "no kernels.cu")
            if nvcc:
                gencode, fatbin_images = _cuda_archs(os.environ.get("VARCOMM_CUDA_ARCHS", "80;90"))
                parts.append(f"nvlink (driver loaded at run time; kernels: nvcc {nvcc_note} {nvcc}, "
                             f"{' '.join(fatbin_images)})")
            else:
                parts.append(f"nvlink (driver loaded at run time; {nvcc_note}: copy-engine path only)")
        else:
            notes.append("nvlink: no sources" if not src["nvlink"] else "nvlink: no (VARCOMM_NO_CUDA)")

        if fab and src["rdma"] and "-DVARCOMM_HAVE_CUDA" in defines:
            parts.append("rdma-gpu (CUDA tensors over rdma, pipelined: GPUDirect RDMA where the provider "
                         "offers FI_HMEM at run time, else staged through pinned memory)")
        print(f"varcomm: building transports: {', '.join(parts)}" + (f"; {'; '.join(notes)}" if notes else ""),
              flush=True)

        build_dir = ROOT / "build" / f"{sys.implementation.cache_tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)

        includes = [f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'transport' / 'shm'}", f"-I{ROOT / 'transport' / 'fallback'}",
                    f"-I{ROOT / 'transport' / 'rdma'}",
                    f"-I{ROOT / 'transport' / 'nvlink'}", f"-I{pybind11.get_include()}",
                    f"-I{sysconfig.get_paths()['include']}"]
        opt = os.environ.get("VARCOMM_OPT", "-O2")
        cxx = os.environ.get("CXX", "g++")
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
            f"cxxflags = -std=c++17 -fPIC -fvisibility=hidden {opt} -g -Wall -Wextra -Wno-unused-parameter "
            + " ".join(includes + defines + cflags),
            f"ldflags = -shared {' '.join(dict.fromkeys(ldflags))} -lpthread",
            "rule cxx",
            "  command = $cxx -MMD -MF $out.d $cxxflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = CXX $in",
            "rule link",
            "  command = $cxx $in -o $out $ldflags",
            "  description = LINK $out",
        ]
        objs = []
        for f in files:
            obj = build_dir / (f.relative_to(ROOT).as_posix().replace("/", "_") + ".o")
            lines.append(f"build {obj}: cxx {f}")
            if nvcc and f.name in ("nvlink.cpp", "a2a_device.cpp"):  # only they see the embedded fatbin
                lines.append("  cxxflags = $cxxflags -DVARCOMM_HAVE_FATBIN")
            objs.append(obj)
        if nvcc:
            # kernels.cu -> kernels.fatbin (device code only, one image per
            # architecture) -> a .cpp holding its bytes -> an object in the link.
            embed = ROOT / "transport" / "nvlink" / "embed_fatbin.py"
            fatbin = build_dir / "transport_nvlink_kernels.fatbin"
            fatbin_cpp = build_dir / "transport_nvlink_kernels.fatbin.cpp"
            fatbin_obj = build_dir / "transport_nvlink_kernels.fatbin.cpp.o"
            lines += [
                f"nvcc = {shlex.quote(nvcc)}",
                f"nvccflags = -std=c++17 -O3 {' '.join(map(shlex.quote, gencode))} -I{ROOT / 'transport' / 'nvlink'}",
                f"python = {shlex.quote(sys.executable)}",
                "rule fatbin",
                "  command = $nvcc -MD -MF $out.d -MT $out $nvccflags -fatbin $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                f"  description = NVCC $in ({' '.join(fatbin_images)})",
                "rule embed",
                "  command = $python $embed $in $out $images",
                "  description = EMBED $in",
                f"build {fatbin}: fatbin {cu_src}",
                f"build {fatbin_cpp}: embed {fatbin} | {embed}",
                f"  embed = {embed}",
                f"  images = {shlex.quote(' '.join(fatbin_images))}",
                f"build {fatbin_obj}: cxx {fatbin_cpp}",
            ]
            objs.append(fatbin_obj)
        lines.append(f"build {out}: link {' '.join(map(str, objs))}")
        lines += self._torch_hooks(build_dir)
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
        subprocess.check_call([ninja, "-C", str(build_dir), str(out)])
        self._ninja = [ninja, "-C", str(build_dir)]

    def _torch_hooks(self, build_dir: Path) -> list[str]:
        """ninja lines for varcomm._torch_hooks (csrc/adapters/torch_hooks.cpp),
        the torch adapter of the fast paths, built against the torch installed
        here; the module names that torch's version, and arrays.py uses it only
        under that torch (the C++ ABI is one version's)."""
        torch = _torch_for_hooks()
        if torch is None:
            return []
        out = Path(self.get_ext_fullpath("varcomm._torch_hooks")).resolve()
        root = Path(torch.__file__).resolve().parent
        abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
        obj = build_dir / "csrc_adapters_torch_hooks.cpp.o"
        # torch's headers as system headers: their warnings are not ours.
        tflags = [f"-isystem {root / 'include'}", f"-isystem {root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
                  f"-D_GLIBCXX_USE_CXX11_ABI={abi}", shlex.quote(f'-DVARCOMM_TORCH_VERSION="{torch.__version__}"')]
        lib = root / "lib"
        return [
            f"build {obj}: cxx {TORCH_HOOKS_SRC}",
            f"  cxxflags = $cxxflags -I{ROOT / 'csrc' / 'python'} {' '.join(tflags)}",
            f"build {out}: link {obj}",
            f"  ldflags = -shared -L{lib} -Wl,-rpath,{lib} -ltorch_python -ltorch -ltorch_cpu -lc10",
        ]

    def run(self) -> None:
        torch = _torch_for_hooks()
        print("varcomm: torch adapter: " + (f"yes (torch {torch.__version__})" if torch is not None else
                                            "no (no torch, or VARCOMM_NO_TORCH_HOOKS=1): torch tensors take the "
                                            "Python paths"), flush=True)
        super().run()


TORCH_HOOKS_SRC = ROOT / "csrc" / "adapters" / "torch_hooks.cpp"


def _torch_for_hooks():  # type: ignore[no-untyped-def]
    """torch, when the torch adapter is to be built (it is installed and not
    turned off with VARCOMM_NO_TORCH_HOOKS=1), else None."""
    if os.environ.get("VARCOMM_NO_TORCH_HOOKS") or not TORCH_HOOKS_SRC.exists():
        return None
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return None
    return torch


class _Built(Extension):
    """An extension the ninja file of varcomm._C builds too."""


setup(
    ext_modules=[Extension("varcomm._C", sources=[])]
    + ([_Built("varcomm._torch_hooks", sources=[])] if _torch_for_hooks() is not None else []),
    cmdclass={"build_ext": NinjaBuildExt},
)
