"""Framework arrays in and out. torch tensors and numpy arrays are described
directly; any other array (cupy, JAX, ...) enters through DLPack (`native`) as
a zero-copy numpy array or torch tensor. The core only ever sees (pointer,
bytes, dtype word, shape, stream)."""
from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Union, overload

import numpy as np

from . import _C, dtypes
from .errors import InvalidArgument

if TYPE_CHECKING:
    from typing_extensions import TypeIs

try:  # torch is optional: numpy-only users never import it
    import torch as torch  # re-exported: the package reaches torch as arrays.torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]

#: What varcomm sends and receives: a numpy array or a torch tensor.
Array = Union["np.ndarray[Any, Any]", "torch.Tensor"]
#: Per-rank row counts of an all-to-all: ints, or a 1-d CPU tensor or array of them.
Splits = Union[Sequence[int], "np.ndarray[Any, Any]", "torch.Tensor"]


def is_torch(x: object) -> TypeIs[torch.Tensor]:
    return torch is not None and isinstance(x, torch.Tensor)


#: Array kinds a message names its sender's by (csrc/protocol.h kArrayShift),
#: so that a receiver with array="auto" answers in kind. 0: not said (descriptors,
#: collectives, an array of another library).
KINDS = ("", "numpy", "torch", "cupy")
NUMPY, TORCH, CUPY = 1, 2, 3
_KIND_OF_MODULE = {"numpy": NUMPY, "torch": TORCH, "cupy": CUPY}
# DLPack device types (dlpack.h DLDeviceType) whose memory the host reads.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3
_DL_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
               11: "rocm_host", 13: "cuda_managed", 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}


def kind_of(x: object) -> int:
    """x's entry in KINDS (0 for a library not listed there)."""
    if is_torch(x):
        return TORCH
    if isinstance(x, np.ndarray):
        return NUMPY
    return _KIND_OF_MODULE.get(type(x).__module__.partition(".")[0], 0)


def is_native(x: object) -> bool:
    """A torch tensor or numpy array: described without DLPack."""
    return isinstance(x, np.ndarray) or is_torch(x)


def native(x: Any, what: str) -> Any:
    """x as a numpy array or torch tensor sharing its memory: x itself when it
    is one, else through DLPack (`__dlpack__`, `__dlpack_device__`): host memory
    as numpy (torch for dtypes numpy lacks, e.g. bfloat16), CUDA memory as a
    torch tensor (torch's DLPack import orders the producer's stream before
    torch's current one, which every device transfer here is ordered on).
    `what` names x in errors."""
    if is_native(x):
        return x
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        raise InvalidArgument(f"{what} must be a torch.Tensor, a numpy.ndarray or an array with __dlpack__ and "
                              f"__dlpack_device__ (cupy, JAX, ...), not {type(x).__name__}")
    dev = int(x.__dlpack_device__()[0])
    name = type(x).__name__
    why: Exception | None = None  # why numpy could not take host memory
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, ValueError, RuntimeError) as e:
            if torch is None:
                raise InvalidArgument(f"{what} ({name}) cannot be read as a numpy array ({e}); "
                                      "install torch for dtypes numpy lacks") from None
            why = e
    elif dev != _DL_CUDA:
        raise InvalidArgument(f"{what} ({name}) is in {_DL_DEVICES.get(dev, f'DLPack device type {dev}')} memory: "
                              "varcomm moves host and CUDA memory; copy it to one of those first")
    elif torch is None:
        raise InvalidArgument(f"{what} ({name}) is in CUDA memory: varcomm handles device arrays through torch; "
                              "install torch with CUDA, or copy the array to the host")
    try:
        return torch.from_dlpack(x)
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise InvalidArgument(f"{what} ({name}) cannot be imported through DLPack: {why or e}") from None


def like(out: Any, nout: Any, got: Any) -> Any:
    """A receive into `nout` (native(out)) as out's own kind: out itself when
    the message filled it (`got is nout`), else a view of out's front with the
    message's shape where out can reshape (cupy), else `got`, the native view
    (a Status passes through)."""
    if got is nout:
        return out
    if not is_native(got) or not hasattr(out, "reshape"):
        return got
    return out.reshape(-1)[:math.prod(got.shape)].reshape(tuple(got.shape))


def _strided(x: Any, what: str) -> None:
    if x.is_nested:  # (its layout may say strided)
        raise InvalidArgument(f"{what} is a nested tensor: varcomm moves dense tensors; send each component "
                              "(x.unbind()), or x.to_padded_tensor(0)")
    if x.layout != torch.strided:
        raise InvalidArgument(f"{what} is a {x.layout} tensor: varcomm moves dense (strided) tensors; send "
                              "x.to_dense(), or its indices and values as separate messages")


def values(x: Any) -> Any:
    """A torch tensor whose bytes are its values: a conjugate or negative view
    (x.conj(), x.conj().imag) is materialized (one copy), since its raw bytes
    are not what it holds, and so is an efficient zero tensor, which has none.
    Numpy arrays in a foreign byte order are converted to native order for
    the same reason."""
    if is_torch(x):
        if x.is_conj():
            x = x.resolve_conj()
        if x._is_zerotensor():  # (autograd's zero gradients: no memory behind them, data_ptr 0)
            return x.clone()
        return x.resolve_neg() if x.is_neg() else x
    if not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


def _not_host(x: Any, what: str) -> InvalidArgument:
    """Why a torch tensor that is not in host memory reached a host-memory path."""
    kind = x.device.type
    if kind == "meta":
        return InvalidArgument(f"{what} is a meta tensor: it has no data to send or receive into")
    if kind == "cuda":
        return InvalidArgument(f"{what} on {x.device}: this build has no GPU transport (varcomm.build_info() says "
                               "what it has); move it to CPU, or rebuild with nvcc")
    return InvalidArgument(f"{what} on {x.device}: varcomm moves host and CUDA memory only; move it to CPU")


def describe_host(x: Any) -> tuple[int, int, int, tuple[int, ...], Any]:
    """(pointer, nbytes, dtype word, shape, keepalive) of a host array: its values.

    Non-contiguous inputs, conjugate or negative views and foreign byte orders
    are copied (the copy is the keepalive)."""
    if is_torch(x):
        _strided(x, "tensor")
        if not x.is_cpu:  # is_cpu, not device.type: the ping-pong path cannot afford a device object
            raise _not_host(x, "tensor")
        x = values(x)
        if not x.is_contiguous():
            x = x.contiguous()
        return x.data_ptr(), x.nbytes, dtypes.from_torch(x.dtype), x.shape, x
    if isinstance(x, np.ndarray):
        x = values(x)
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return x.ctypes.data, x.nbytes, dtypes.from_numpy(x.dtype), x.shape, x
    raise InvalidArgument(f"cannot send {type(x).__name__}: pass a torch.Tensor or numpy.ndarray")


def host_array(x: Any, what: str) -> Any:
    """`x` as a contiguous CPU torch tensor or numpy array of its values
    (copied if strided, a conjugate or negative view, or byte-swapped);
    `what` names it in errors."""
    if is_torch(x):
        _strided(x, what)
        if not x.is_cpu:
            raise _not_host(x, what)
        x = values(x)
        return x if x.is_contiguous() else x.contiguous()
    if isinstance(x, np.ndarray):
        x = values(x)
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    raise InvalidArgument(f"{what} must be a torch.Tensor or numpy.ndarray, not {type(x).__name__}")


def describe_send(x: Any) -> tuple[int, int, int, tuple[int, ...], Any, int]:
    """describe_host plus the CUDA stream that orders the send: -1 for host
    memory, else the handle of the tensor's device's current stream."""
    if is_torch(x) and x.is_cuda:
        _strided(x, "tensor")
        x = values(x)
        if not x.is_contiguous():
            x = x.contiguous()
        s = torch.cuda.current_stream(x.device)
        # The copy out of x is enqueued on s: the caching allocator must not
        # hand x's memory to another stream before it ran.
        x.record_stream(s)
        return x.data_ptr(), x.nbytes, dtypes.from_torch(x.dtype), tuple(x.shape), x, s.cuda_stream
    return (*describe_host(x), -1)


def check_device(x: Any, device: int | None, what: str, path: str) -> None:
    """A CUDA tensor for a GPU transport set up on cuda:`device` (None: no GPU
    transport) must be on that GPU: its flags, credits and copies live in
    that device's context, and another GPU's memory there is not what the
    peer was told. (x: the tensor, or its torch.device.)"""
    where = x if isinstance(x, torch.device) else getattr(x, "device", None)
    if not isinstance(where, torch.device):  # (another memory's place: the stand-in driver's, in tests)
        return
    if device is not None and where.index != device:
        raise InvalidArgument(f"{what} is on {where} but this communicator's {path} runs on cuda:{device}: move "
                              f"it there (.to('cuda:{device}')), or create the communicator on that GPU "
                              "(torch.cuda.set_device, or VARCOMM_NVLINK_DEVICE, before varcomm.init)")


def describe_recv(out: Any) -> tuple[int, int, int, int]:
    """describe_out plus the CUDA stream that orders the receive (-1: host memory)."""
    if is_torch(out) and out.is_cuda:
        _check_out_bits(out)
        if not out.is_contiguous():  # (first: an expanded tensor's storage is shorter than its span)
            raise InvalidArgument("out must be contiguous: the message is written into its prefix; receive into a "
                                  "contiguous buffer (buf = out.contiguous()) and copy it back (out.copy_(buf))")
        check_memory(out, "out")
        bump_version(out)
        return (out.data_ptr(), out.nbytes, dtypes.from_torch(out.dtype),
                torch.cuda.current_stream(out.device).cuda_stream)
    return (*describe_out(out), -1)


#: Addresses below this are never mapped (Linux's vm.mmap_min_addr): a data pointer there with bytes
#: has no memory behind it (torch's efficient zero tensor, or a view of one). The core's Engine::no_memory.
NO_MEMORY_BELOW = 65536

_EMPTY_BYTE = ctypes.c_char(0)  # (kept: the address of a temporary would be freed memory)
_EMPTY_OUT = ctypes.addressof(_EMPTY_BYTE)


def check_memory(out: Any, what: str) -> None:
    """A torch out must have memory to write into: an efficient zero tensor
    (and views of one) has none, and its data_ptr (0, or a small offset)
    would read as "no out" or as an address."""
    if out._is_zerotensor():
        raise InvalidArgument(f"{what} is a zero tensor (torch's efficient zeros, e.g. an unused gradient): it has "
                              f"no memory to receive into; pass torch.empty({tuple(out.shape)}, dtype={out.dtype})")
    n = out.nbytes
    if n:
        # A storage freed or shrunk under the tensor (FSDP frees parameters
        # with untyped_storage().resize_(0)): its data_ptr is 0, or short.
        have, need = out.untyped_storage().nbytes(), out.storage_offset() * out.element_size() + n
        if have < need:
            raise InvalidArgument(f"{what}'s storage holds {have} bytes but {what} spans {need}: it was freed or "
                                  "shrunk (untyped_storage().resize_(), as FSDP frees parameters); pass a tensor "
                                  "whose memory is allocated")


def bump_version(out: Any) -> None:
    """out is written, as torch's in-place ops count it: a backward that saved
    it raises instead of using the message's values (the torch adapter does
    the same in C++; an inference tensor has no counter)."""
    if not out.is_inference():
        # (what torch.autograd.graph.increment_version calls, without its
        # wrapper: half the cost on the irecv and collective paths)
        torch._C._increment_version((out,))


def _check_out_bits(out: Any) -> None:
    """An out whose bytes are not its values cannot take a message's bytes."""
    _strided(out, "out")
    if out.is_conj() or out.is_neg():
        raise InvalidArgument(f"out is a {'conjugate' if out.is_conj() else 'negative'} view: the message's bytes "
                              "would read back changed; receive into a plain tensor (e.g. torch.empty_like(out))")


def describe_out(out: Any) -> tuple[int, int, int]:
    """(pointer, capacity bytes, dtype word) of a bound-sized receive buffer."""
    if is_torch(out):
        _check_out_bits(out)
        if not out.is_cpu:
            raise _not_host(out, "out")
        if not out.is_contiguous():
            raise InvalidArgument("out must be contiguous: the message is written into its prefix; receive into a "
                                  "contiguous buffer (buf = out.contiguous()) and copy it back (out.copy_(buf))")
        check_memory(out, "out")
        bump_version(out)
        # An empty tensor has data_ptr 0, which the core reads as "no out":
        # any non-null address will do, nothing is written to a 0-byte out.
        return out.data_ptr() or _EMPTY_OUT, out.nbytes, dtypes.from_torch(out.dtype)
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgument("out must be a writeable C-contiguous numpy array: receive into "
                                  "np.ascontiguousarray(out) (or a new array) and copy it back")
        if not out.dtype.isnative:
            raise InvalidArgument(f"out has dtype {out.dtype.str}, not in this machine's byte order: messages carry "
                                  f"native values; receive into {out.dtype.newbyteorder('=').str} and byte-swap")
        return out.ctypes.data or _EMPTY_OUT, out.nbytes, dtypes.from_numpy(out.dtype)
    raise InvalidArgument(f"out must be a torch.Tensor or numpy.ndarray, not {type(out).__name__}")


@overload
def prefix_view(out: np.ndarray[Any, Any], nbytes: int, shape: Sequence[int]) -> np.ndarray[Any, Any]: ...
@overload
def prefix_view(out: torch.Tensor, nbytes: int, shape: Sequence[int]) -> torch.Tensor: ...
@overload
def prefix_view(out: Array, nbytes: int, shape: Sequence[int]) -> Array: ...
def prefix_view(out: Array, nbytes: int, shape: Sequence[int]) -> Array:
    """The received message as a view of the front of `out`, with the sender's shape."""
    if tuple(out.shape) == tuple(shape):
        return out
    if isinstance(out, np.ndarray):
        n = nbytes // max(out.itemsize, 1)
        return out.reshape(-1)[:n].reshape(shape)
    # One op: a contiguous view of the front of out (out is contiguous, checked at post).
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return out.as_strided(tuple(shape), tuple(strides))


def dtype_word(dtype: Any) -> int:
    """The DLPack word of a dtype given as a torch dtype, a numpy dtype (or
    anything numpy takes for one), or a torch dtype's name ("bfloat16")."""
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtypes.from_torch(dtype)
    if isinstance(dtype, str) and torch is not None and isinstance(getattr(torch, dtype, None), torch.dtype):
        try:
            return dtypes.from_numpy(dtype)
        except InvalidArgument:  # bfloat16: no numpy dtype
            return dtypes.from_torch(getattr(torch, dtype))
    return dtypes.from_numpy(dtype)


def empty(kind: str, dtype_word: int, shape: Sequence[int],
          device: torch.device | None = None) -> tuple[Array, int]:
    """A fresh array for a message of unknown size, and its data pointer (a
    torch tensor on `device` when given)."""
    if kind == "torch":
        # (device "cpu", not torch's default device, which a program may have set to CUDA or meta)
        t = torch.empty(tuple(shape), dtype=dtypes.to_torch(dtype_word), device=device or "cpu")
        if t.nbytes and not t.data_ptr():
            raise _no_data(t)
        if t.is_cpu:  # huge pages from 4 MiB, as numpy's own arrays (csrc/hostmem.h)
            _C.advise_huge_pages(t.data_ptr(), t.nbytes)
        return t, t.data_ptr()
    a = np.empty(tuple(shape), dtype=dtypes.to_numpy(dtype_word))
    return a, a.ctypes.data


def _no_data(t: Any) -> InvalidArgument:
    return InvalidArgument(f"torch.empty made a {type(t).__name__} without memory for the message (a torch mode "
                           "such as FakeTensorMode is active): receive outside the mode, or into out=; the message "
                           "is kept")


def new_torch(dtype_word: int, shape: tuple[int, ...]) -> tuple[Array, int]:
    """empty("torch", ...) for the blocking recv's allocator (the core calls it)."""
    # Sizes as separate ints: torch's argument parser takes them ~0.4 us faster
    # than one tuple (timeit, 1.25 -> 0.86 us), a third of a small receive's cost.
    dt = dtypes.to_torch(dtype_word)
    # Host memory whatever torch's default device is (set_default_device, a
    # `with torch.device("meta")`): the core writes the message at data_ptr().
    t = torch.empty(*shape, dtype=dt, device="cpu") if shape else torch.empty((), dtype=dt, device="cpu")
    return t, t.data_ptr()


def new_numpy(dtype_word: int, shape: tuple[int, ...]) -> Array:
    """empty("numpy", ...) for the blocking recv's allocator (the core calls
    it and takes the data pointer through the buffer protocol)."""
    return np.empty(shape, dtype=dtypes.to_numpy(dtype_word))


def new_cupy(dtype_word: int, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The blocking recv's allocator for cupy: the message lands in host memory,
    then to_cupy copies it to the current GPU (the core calls the third item)."""
    to_cupy(None)  # refuses before the message is claimed when cupy is missing
    a = np.empty(shape, dtype=dtypes.to_numpy(dtype_word))
    return a, a.ctypes.data, to_cupy


def to_cupy(x: Any) -> Any:
    """x (numpy: copied to the current GPU; a CUDA torch tensor: shared) as a
    cupy array; None only checks that cupy imports."""
    try:
        import cupy
    except ImportError:
        raise InvalidArgument("array='cupy' needs cupy: pip install 'varcomm[cupy]' (cupy-cuda12x)") from None
    if x is None:
        return None
    return cupy.from_dlpack(x) if is_torch(x) else cupy.asarray(x)


#: An allocator returns the array (a buffer: numpy), or (array, data pointer[, then]).
#: The core also takes an array adapter's capsule in its place (torch_hooks()).
Alloc = Callable[[int, tuple[int, ...]], Any]
ALLOCATORS: dict[str, Alloc] = {
    "numpy": new_numpy, "torch": new_torch, "cupy": new_cupy}

_torch_hooks: Any = None  # the torch adapter's capsule while installed
_torch_hooks_why = "torch is not installed"  # why not, while not


def use_torch_hooks(on: bool = True) -> bool:
    """Installs (on) or removes the torch adapter of the core's fast paths
    (csrc/adapters/torch_hooks.cpp, built by setup.py against the torch it
    finds): blocking and nonblocking host send/recv describe torch tensors and
    make result tensors in C, ~1 us less per small message. It is installed at
    import when it was built for the torch in use; without it, the same results
    come from the Python paths. Communicators made later allocate by the new
    setting. Returns whether it is installed."""
    global _torch_hooks, _torch_hooks_why
    _C.clear_array_hooks(TORCH)
    _torch_hooks = None
    if not on:
        _torch_hooks_why = "turned off (varcomm.arrays.use_torch_hooks(False))"
        return False
    if torch is None:
        _torch_hooks_why = "torch is not installed"
        return False
    try:
        from . import _torch_hooks as module
    except ImportError as e:
        _torch_hooks_why = f"not built (make build, with torch installed): {e}"
        return False
    if module.torch_version != torch.__version__:  # its C++ ABI is that torch's: never call it under another
        _torch_hooks_why = (f"built for torch {module.torch_version}, running torch {torch.__version__}: rebuild "
                            "varcomm (make build) for the faster paths")
        return False
    _torch_hooks = module.install(torch.Tensor, list(dtypes.torch_words().items()), TORCH, InvalidArgument)
    _C.set_array_hooks(_torch_hooks)
    return True


def torch_hooks() -> str:
    """Whether the torch adapter is in use, and why not (varcomm-doctor)."""
    return "in use" if _torch_hooks is not None else f"not in use: {_torch_hooks_why}"


def default_kind() -> str:
    """What a receive answers with when neither the caller nor the sender says: torch when installed."""
    return "torch" if torch is not None else "numpy"


def allocators(array: str) -> tuple[Alloc, ...]:
    """The blocking recv's allocators, indexed by the sender's kind (KINDS; the
    core takes item 0 for a kind past the end): one for a fixed kind; for
    "auto" the sender's kind, where this process has it, else default_kind()."""
    new_t = _torch_hooks if _torch_hooks is not None else new_torch
    if array != "auto":
        return (new_t if array == "torch" else ALLOCATORS[array],)
    base = new_t if default_kind() == "torch" else ALLOCATORS[default_kind()]
    return (base, new_numpy, new_t if torch is not None else base, _new_cupy_or(ALLOCATORS[default_kind()]))


def _new_cupy_or(base: Alloc) -> Alloc:
    def new(dtype_word: int, shape: tuple[int, ...]) -> Any:
        # cupy only for a process that uses it: auto never imports cupy (nor needs a GPU) on its own.
        return (new_cupy if "cupy" in sys.modules else base)(dtype_word, shape)

    return new


def receive_kind(array: str, sent: int) -> str:
    """The kind a receive without out= answers with: `array`, or for "auto"
    the sender's kind (`sent`, KINDS) where this process has it."""
    if array != "auto":
        return array
    kind = KINDS[sent] if 0 < sent < len(KINDS) else ""
    if kind == "numpy" or (kind == "torch" and torch is not None) or (kind == "cupy" and "cupy" in sys.modules):
        return kind
    return default_kind()


def lenders(array: str) -> tuple[Any, ...]:
    """copy=False's makers for the core (recv_loan, loan), indexed by the
    sender's kind (KINDS; item 0 past the end) as allocators() are: lender(array)'s,
    or the torch adapter's capsule where the result is a torch tensor."""
    lend = lender(array)
    if _torch_hooks is None or array not in ("auto", "torch"):
        return (lend,)
    if array == "torch":
        return (_torch_hooks,)
    return (lend, lend, _torch_hooks, lend)


def lender(array: str) -> Callable[[Any, int, tuple[int, ...], int], Array | None]:
    """copy=False's maker: (Loan, dtype word, shape, sender's kind) -> a
    zero-copy array of the kind `array` asks for ("auto": the sender's) over a
    receive slot's bytes (a `_C.Loan`, a buffer). The array holds the Loan, and
    the slot goes back to its sender when the Loan is freed: when the array and
    every view of it are gone. A kind that cannot hold the dtype raises before
    anything holds the Loan, and the core keeps the message for the next recv.
    With loan None it only checks (returns None, or raises what it would)."""

    def lend(loan: Any, dtype_word: int, shape: tuple[int, ...], sent: int) -> Array | None:
        kind = receive_kind(array, sent)
        # frombuffer makes the 1-d array; any other shape is one reshape more.
        if kind == "torch":
            dt = dtypes.to_torch(dtype_word)
            if loan is None:
                return None
            if 0 in shape:
                # frombuffer refuses an empty buffer; no bytes to lend
                return torch.empty(shape, dtype=dt, device="cpu")
            t = torch.frombuffer(loan, dtype=dt)
            return t if len(shape) == 1 else t.reshape(shape)
        if kind == "cupy":
            raise InvalidArgument("copy=False lends a host receive slot; a cupy array lives on the GPU: receive "
                                  "with copy=True, or as numpy")
        ndt = dtypes.to_numpy(dtype_word)
        if loan is None:
            return None
        a: np.ndarray[Any, Any] = np.frombuffer(loan, dtype=ndt)
        return a if len(shape) == 1 else a.reshape(shape)

    return lend


class DeviceMemory:
    """Device memory as the collectives see it: torch CUDA tensors. The one
    seam between the all-to-all facade (collectives/alltoall.py, moe.py) and a
    framework's GPU arrays. A `place` is where an array lives (a torch.device
    for CUDA; None for host memory), a `stream` what orders work there.
    tests/test_gpu_alltoall.py installs a stand-in (set_device_memory): CPU
    tensors over the fake driver's device memory, so CI without a GPU runs
    this same facade code on the fake driver."""

    def place(self, x: Any) -> Any:
        """Where x lives when it is device memory, else None."""
        return x.device if is_torch(x) and x.is_cuda else None

    def stream(self, place: Any) -> Any:
        """The current stream of `place`: the caller's work is ordered on it."""
        return torch.cuda.current_stream(place)

    def handle(self, stream: Any) -> int:
        """The stream as the core takes it (a CUstream handle, >= 0)."""
        return int(stream.cuda_stream)

    def empty(self, shape: Sequence[int], dtype: Any, place: Any) -> Any:
        return torch.empty(tuple(shape), dtype=dtype, device=place)

    def to(self, t: Any, place: Any) -> Any:
        """t in place's memory: t itself when it is there already."""
        return t if t.device == place else t.to(place)

    def to_host(self, x: Any) -> Any:
        """A host copy of x once the work on its stream ran (staging: blocks the host)."""
        return x.detach().to("cpu")

    def record(self, x: Any, stream: Any) -> None:
        """x is read or written on `stream` later: the caching allocator must not reuse it before."""
        x.record_stream(stream)

    def wait(self, stream: Any, place: Any) -> None:
        """The caller's next work (on place's current stream) runs after `stream`'s."""
        cur = torch.cuda.current_stream(place)
        if cur != stream:
            cur.wait_stream(stream)

    def synchronize(self, stream: Any) -> None:
        """Block the host until `stream`'s work ran."""
        stream.synchronize()


_DEVICE_MEMORY = DeviceMemory()


def device_memory() -> DeviceMemory:
    """The DeviceMemory the collectives use."""
    return _DEVICE_MEMORY


def set_device_memory(d: DeviceMemory) -> DeviceMemory:
    """Replace it (tests: the fake driver's stand-in); returns the previous one."""
    global _DEVICE_MEMORY
    old, _DEVICE_MEMORY = _DEVICE_MEMORY, d
    return old


use_torch_hooks()
