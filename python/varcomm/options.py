"""Every varcomm option, declared and read in one place.

`Options` holds the library's options: each field names its environment
variable, default, accepted values and meaning once, and `varcomm.init(**kw)`
and the environment both map onto those fields (a keyword beats the
environment). `ToolOptions` holds the launcher's and test harness's variables.
Nothing else in the package reads a ``VARCOMM_*`` variable; launcher variables
(RANK, WORLD_SIZE, ...) are read by `varcomm.bootstrap`, build options
(VARCOMM_NO_CUDA, ...) by setup.py.

``python -m varcomm.options`` prints the options as resolved here;
``--markdown`` prints the README's options table.

This module uses only the standard library (the launcher and harness import
it without torch).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, TypedDict, TypeVar, cast

from .errors import InvalidArgument

KiB = 1 << 10
MiB = 1 << 20

# ---------------------------------------------------------------------------
# value kinds: one parser each


class _Bad(ValueError):
    """A value a kind does not accept; the caller names where it came from."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """How an option's value is written. `convert` takes an environment string
    or a keyword's value and returns the typed value, or raises _Bad."""

    accepts: str = ""

    def convert(self, value: object) -> Any:  # pragma: no cover - every kind overrides it
        raise NotImplementedError


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte count: 8388608, 64K, 64KiB, 64KB, 1.5M, 1G (suffixes are binary, any case)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise _Bad(f"{text!r} is not a size in bytes")
    scale = _SCALE[m.group(2).lower()]
    x = float(m.group(1)) * scale
    if scale == 1 and x != int(x):  # (0.5 was 0: with a suffix, 1.1M rounds down to whole bytes)
        raise _Bad(f"{text!r} is not a whole number of bytes")
    return int(x)


@dataclasses.dataclass(frozen=True)
class Bytes(Kind):
    minimum: int = 0
    auto: bool = False  # None (or "auto") means: decided by the core

    def convert(self, value: object) -> int | None:
        if self.auto and (value is None or (isinstance(value, str) and value.strip().lower() == "auto")):
            return None
        if isinstance(value, str):
            n = parse_bytes(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            n = int(value)
        else:
            raise _Bad
        if n >= 1 << 63:  # (the core's sizes are 64-bit: its error named no option)
            raise _Bad(f"{value!r} is more than 2**63 bytes")
        if n < self.minimum:
            raise _Bad
        return n


@dataclasses.dataclass(frozen=True)
class Int(Kind):
    minimum: int = 0
    maximum: int | None = None
    auto: bool = False  # None (or "auto") means: decided at init

    def convert(self, value: object) -> int | None:
        if self.auto and (value is None or (isinstance(value, str) and value.strip().lower() == "auto")):
            return None
        if isinstance(value, str):
            try:
                n = int(value.strip())
            except ValueError:
                raise _Bad from None
        elif isinstance(value, int) and not isinstance(value, bool):
            n = int(value)
        else:
            raise _Bad
        if n < self.minimum or (self.maximum is not None and n > self.maximum):
            raise _Bad
        return n


#: A timeout longer than this (inf included) is no timeout: the core's own
#: rule for per-call timeouts (kForeverS, csrc/python/bindings.cpp), here for
#: the options (this module is also read by setup.py, before the core exists).
FOREVER_S = 1e9  # ~31 years


@dataclasses.dataclass(frozen=True)
class Seconds(Kind):
    minimum: float = 0.0
    forever: bool = False  # None, "none" or "inf" mean: no limit

    def convert(self, value: object) -> float | None:
        if isinstance(value, str):
            text = value.strip().lower()
            if self.forever and text in ("none", "inf", "infinity"):
                return None
            try:
                value = float(text)
            except ValueError:
                raise _Bad from None
        if value is None and self.forever:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise _Bad
        if value > FOREVER_S and self.forever:  # inf, or a deadline past the clock's range
            return None
        if not self.minimum <= value < math.inf:
            raise _Bad
        return float(value)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Bool(Kind):
    def convert(self, value: object) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            text = value.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
        raise _Bad


@dataclasses.dataclass(frozen=True)
class Choice(Kind):
    values: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()  # (spelling, the value it means)

    def convert(self, value: object) -> str:
        if isinstance(value, bool):  # nvlink=True / False
            value = "1" if value else "0"
        if not isinstance(value, str):
            raise _Bad
        text = value.strip().lower()
        text = dict(self.aliases).get(text, text)
        if text not in self.values:
            raise _Bad
        return text


@dataclasses.dataclass(frozen=True)
class Text(Kind):
    def convert(self, value: object) -> str:
        if not isinstance(value, str):
            raise _Bad
        return value.strip()


def _bytes(minimum: int = 0, auto: bool = False, why: str = "") -> Bytes:
    what = "a size in bytes (e.g. 8388608, 64K, 64MiB, 1.5M, 1G)"
    return Bytes(what + (f", at least {minimum}" if minimum else "") + (f" ({why})" if why else "")
                 + (", or auto" if auto else ""), minimum, auto)


def _int(minimum: int, maximum: int | None = None, auto: bool = False) -> Int:
    what = f"an integer in [{minimum}, {maximum}]" if maximum is not None else f"an integer >= {minimum}"
    return Int(what + (", or auto" if auto else ""), minimum, maximum, auto)


def _choice(*values: str, aliases: tuple[tuple[str, str], ...] = ()) -> Choice:
    return Choice(", ".join(values[:-1]) + " or " + values[-1], values, aliases)


_BOOL = Bool("1 or 0 (also true/false, yes/no, on/off)")
_TEXT = Text("a string")

# ---------------------------------------------------------------------------
# declaring a field


@dataclasses.dataclass(frozen=True)
class Spec:
    """One option: its variable, how it is written, what it means."""

    env: str
    kind: Kind
    doc: str
    default_doc: str  # the default as the README states it
    none_is_value: bool = False  # a None keyword is a value (timeout: wait forever), not "unset"
    secret: bool = False  # never shown: not in repr, reports or `python -m varcomm.options`


def _opt(env: str, kind: Kind, default: Any, doc: str, default_doc: str | None = None,
         none_is_value: bool = False, secret: bool = False) -> Any:
    spec = Spec(env, kind, doc, default_doc if default_doc is not None else f"`{default}`", none_is_value, secret)
    return dataclasses.field(default=default, metadata={"spec": spec}, repr=not secret)


def shown(spec: Spec, value: object) -> object:
    """`value` as reports may print it: a secret is only said to be set."""
    return ("<set>" if value else "<unset>") if spec.secret else value


T = TypeVar("T", bound="_Declared")


class CoreOptions(TypedDict):
    """What the C++ core takes: exactly the fields of csrc/options.h (the
    binding refuses a missing or unknown key)."""

    bound: int
    slots: int
    spin_us: int
    transport: str
    rdma_provider: str
    rdma_iface: str
    peer_timeout: float
    rdma_strict: bool
    rdma_eager_credits: bool
    liveness_addr: str
    debug: bool
    nvlink: str
    cuda_device: int
    nvlink_flags: str
    nvlink_kernel_max: int
    eager_max: int
    landing: int
    max_message: int
    job_key: str
    rdma_chunk: int
    rdma_hmem: str
    cma: str
    shm_stores: str
    a2a_algorithm: str


class _Declared:
    """Resolution shared by Options and ToolOptions: every field carries a Spec."""

    _what: ClassVar[str] = "option"

    def __post_init__(self) -> None:
        for name, spec in self.specs().items():
            value = getattr(self, name)
            object.__setattr__(self, name, _convert(spec, value, f"{type(self).__name__}({name}=...)"))

    @classmethod
    def specs(cls) -> dict[str, Spec]:
        return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def resolve(cls: type[T], environ: Mapping[str, str] | None = None, *, keyword_origin: str = "",
                **overrides: Any) -> T:
        """The options from `environ` (default: os.environ), with `overrides`
        (keyword values) winning; see `override`."""
        env = os.environ if environ is None else environ
        if environ is None:
            _warn_unknown(env)
        values = {name: _convert(spec, env[spec.env], spec.env)
                  for name, spec in cls.specs().items() if env.get(spec.env, "").strip()}
        return cls(**values)._given_too(values).override(keyword_origin=keyword_origin, **overrides)

    def given(self) -> frozenset[str]:
        """The fields set by the environment or a keyword (resolve, override),
        even to their default value: a layer with a default of its own (the
        torch backend's group timeout) yields only to a value the user set."""
        return cast("frozenset[str]", getattr(self, "_given", frozenset()))

    def _given_too(self: T, names: Iterable[str]) -> T:
        object.__setattr__(self, "_given", self.given() | frozenset(names))
        return self

    def replaced(self: T, **values: Any) -> T:
        """dataclasses.replace that keeps given() (replace drops what is not a
        field: comm.options.given() came back empty). The values replaced are
        not counted as given: use override() for a user's keywords."""
        return dataclasses.replace(self, **values)._given_too(self.given())  # type: ignore[type-var]  # a dataclass

    def override(self: T, *, keyword_origin: str = "", **overrides: Any) -> T:
        """These options with keyword values in place. A None value leaves the
        field as it is, except where None is a value (timeout: wait forever).
        An unknown name raises TypeError naming the valid ones; a bad value,
        InvalidArgument naming `keyword_origin(name=value)`."""
        specs = self.specs()
        unknown = sorted(set(overrides) - set(specs))
        if unknown:
            raise TypeError(f"{keyword_origin or type(self).__name__}() got unknown "
                            f"{self._what}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"valid: {', '.join(specs)}")
        values = {name: _convert(specs[name], value, f"{keyword_origin or type(self).__name__}({name}=...)")
                  for name, value in overrides.items() if value is not None or specs[name].none_is_value}
        if not values:
            return self
        return dataclasses.replace(self, **values)._given_too(self.given() | set(values))  # type: ignore[type-var]  # a dataclass


def _convert(spec: Spec, value: object, where: str) -> Any:
    try:
        return spec.kind.convert(value)
    except _Bad:
        text = "(not shown: a secret)" if spec.secret else repr(value)
        shown = f"{where}={text}" if where == spec.env else where.replace("...", text)
        raise InvalidArgument(f"{shown}: use {spec.kind.accepts}") from None


# ---------------------------------------------------------------------------
# the library's options


@dataclasses.dataclass(frozen=True)
class Options(_Declared):
    """varcomm's options, resolved once at init (`comm.options`)."""

    # Under 64 bytes every message streamed in chunks of a few bytes (4 MiB at VARCOMM_BOUND=1 took 4M chunks and
    # timed out as if the receiver were stuck), and a typo of 1 for 1M is likelier than a wish for such slots.
    bound: int = _opt("VARCOMM_BOUND", _bytes(64, why="a bare number is bytes: 1M for a MiB"), 8 * MiB,
                      "payload bytes of one receive slot: a message up to it is sent eagerly (copied into the "
                      "slot); a larger one goes by rendezvous (see `eager_max`), an all-to-all chunk of host memory "
                      "too; a GPU payload or chunk over the receiver's bound is refused (MessageTooLarge, on every "
                      "rank for an all-to-all)", "8 MiB")
    slots: int = _opt("VARCOMM_SLOTS", _int(1, 1024), 8, "messages in flight per sending peer (ring depth)")
    transport: str = _opt("VARCOMM_TRANSPORT", _choice("auto", "shm", "rdma", "fallback"), "auto",
                          "`shm`, `rdma` (force it, e.g. on one host for tests) or `fallback` for every peer; "
                          "`auto`: shm on the same host, else rdma, else the fallback")
    timeout: float | None = _opt("VARCOMM_TIMEOUT", Seconds("seconds (a number >= 0), or none/inf for no limit",
                                                            0.0, forever=True), 600.0,
                                 "default timeout of every wait, seconds; None (`none`) waits forever", "600",
                                 none_is_value=True)
    init_timeout: float | None = _opt("VARCOMM_INIT_TIMEOUT",
                                      Seconds("seconds (a number > 0), or none/inf for no limit", 1e-3, forever=True),
                                      30.0, "how long init waits for every rank to arrive at the rendezvous and for "
                                      "the store to answer, seconds; then it names the ranks missing", "30",
                                      none_is_value=True)
    array: str = _opt("VARCOMM_ARRAY", _choice("auto", "torch", "numpy", "cupy"), "auto",
                      "kind returned by `recv` without `out`; `auto`: the kind the sender sent (numpy, torch, "
                      "cupy), else `torch` if importable, else `numpy`")
    spin_us: int | None = _opt("VARCOMM_SPIN_US", _int(0, auto=True), None,
                               "microseconds a wait busy-polls before it sleeps",
                               "50 if this host's ranks have a core each, else 0")
    rdma_provider: str = _opt("VARCOMM_FI_PROVIDER", _TEXT, "",
                              "libfabric provider (e.g. `verbs;ofi_rxm`, `efa`, `tcp;ofi_rxm`); same on every rank",
                              "verbs / efa / cxi if present, else `tcp;ofi_rxm`")
    rdma_iface: str = _opt("VARCOMM_FI_IFACE", _TEXT, "",
                           "libfabric domain: a NIC (`mlx5_0`) or a network interface (`eth0`) for tcp",
                           "the first non-loopback IPv4 domain")
    peer_timeout: int = _opt("VARCOMM_PEER_TIMEOUT", _int(2), 5,
                             "seconds of silence an rdma link survives (longer: down, within 2 s more)")
    rdma_strict: bool = _opt("VARCOMM_RDMA_STRICT", _BOOL, False,
                             "rdma: register local buffers as verbs/efa require, on any provider (tests)", "`0`")
    rdma_eager_credits: bool = _opt("VARCOMM_RDMA_EAGER_CREDITS", _BOOL, False,
                                    "rdma: post each credit at once instead of with the next write "
                                    "(or within ~5 ms)", "`0`")
    rdma_chunk: int = _opt("VARCOMM_RDMA_CHUNK", _bytes(4096), 1 * MiB,
                           "rdma: GPU messages move in chunks of this size, so the device-to-host copy, the wire "
                           "and the host-to-device copy overlap; host messages over twice it go by rendezvous in "
                           "such chunks, so the receiver copies one out of its slot while the next is on the wire",
                           "1 MiB")
    rdma_hmem: str = _opt("VARCOMM_RDMA_HMEM", _choice("auto", "on", "off", aliases=(
        ("1", "on"), ("true", "on"), ("yes", "on"), ("0", "off"), ("false", "off"), ("no", "off"))), "auto",
        "rdma: GPUDirect RDMA for GPU messages (the NIC reads and writes GPU memory: staging and receive slots "
        "there, world x slots x bound of it); `auto`: when the provider is verbs/efa/cxi and offers FI_HMEM for "
        "CUDA, taking at most 1 GiB of GPU memory, else staged through pinned host memory (1/0 mean on/off; on "
        "takes all it needs)")
    liveness_addr: str = _opt("VARCOMM_LIVENESS_ADDR", _TEXT, "",
                              "rdma: IP of the liveness socket when the fabric address is not one (efa, cxi)",
                              "the first non-loopback IPv4 address")
    debug: bool = _opt("VARCOMM_DEBUG", _BOOL, False, "print transport choices and why, to stderr", "`0`")
    nvlink: str = _opt("VARCOMM_NVLINK", _choice("auto", "on", "off", aliases=(
        ("1", "on"), ("true", "on"), ("yes", "on"), ("0", "off"), ("false", "off"), ("no", "off"))), "auto",
        "GPU tensors on GPU transports (nvlink: same host, CUDA IPC; rdma-gpu: over rdma); `auto`: when this "
        "process used CUDA before init; off: staged through host memory (1/0 mean on/off)")
    nvlink_device: int | None = _opt("VARCOMM_NVLINK_DEVICE", _int(0, auto=True), None,
                                     "GPU ordinal holding this rank's device receive slots",
                                     "torch's current device")
    nvlink_flags: str = _opt("VARCOMM_NVLINK_FLAGS", _choice("device", "host"), "device",
                             "where nvlink's data flags live (same on every rank)")
    nvlink_kernel_max: int = _opt("VARCOMM_NVLINK_KERNEL_MAX", _bytes(0), 0,
                                  "largest nvlink message sent by one copy-and-flag kernel; 0: copy engine only")
    cma: str = _opt("VARCOMM_CMA", _choice("auto", "on", "off", "chunks", aliases=(
        ("1", "on"), ("true", "on"), ("yes", "on"), ("0", "off"), ("false", "off"), ("no", "off"))), "auto",
        "shm: single-copy reads of the sender's memory (CMA, process_vm_readv) for large messages; `auto`: where "
        "allowed and where one such copy beats two memcpys (measured once at set-up: "
        "`route_info(peer)[\"cma_probe\"]`), "
        "else messages over the bound stream through the slots (unless the sender's slot copies are slow: "
        "`shm_stores`) and only a collective's chunks from 128 KiB are copied "
        "once (what `chunks` forces: by their sender into an output in the landing area, else by CMA, which beats two "
        "memcpys once the data is out of cache) (1/0 mean on/off)")
    shm_stores: str = _opt("VARCOMM_SHM_STORES", _choice("auto", "ordinary", "streaming"), "auto",
                           "shm: how a sender copies a message from 16 KiB into the receiver's slots or landing "
                           "area: ordinary stores (the receiver then reads it from cache) or non-temporal ones, "
                           "which skip taking the lines from the reader's core (on some VMs, in spells of minutes, "
                           "ordinary stores there run ~10x slower: bench/results/shm-cross-write.c); `auto`: timed "
                           "(slots and landing area apart), whichever is faster now. While slot copies are slow "
                           "(and always under `streaming`) a message over `eager_max` into an ordinary `out` is read "
                           "once by CMA where `cma` allows chunks, instead of streaming through the slots")
    eager_max: int | None = _opt("VARCOMM_EAGER_MAX", _bytes(1, auto=True), None,
                                 "largest message sent eagerly where the pair can copy once (a landing area, or shm "
                                 "with CMA); a larger one goes by rendezvous: the data is copied once, by the sender "
                                 "into the receiver's landing area or by the receiver out of the sender's memory, and "
                                 "the send completes when it has; all-to-all chunks go so from min(this, 32 KiB) where "
                                 "the receiver copies by CMA; `auto`: the transport's, where a rendezvous round trip "
                                 "costs less than the copy out of the slot. Over rdma a host message into a GPU "
                                 "`out` must be within it (a rendezvous cannot land there: refused, and kept)",
                                 "shm 256 KiB, rdma 2 x `rdma_chunk`, at least 256 KiB (2 MiB)")
    landing: int = _opt("VARCOMM_LANDING", _bytes(0), 64 * MiB,
                        "bytes of this rank's landing area (shm, rdma): a rendezvous message received without "
                        "`out`, or into a `comm.empty` buffer, is written there once by its sender and the result "
                        "is a view of it (freed when dropped); mapped, and touched only as used. 0: none (messages "
                        "over the bound stream through the slots)", "64 MiB")
    max_message: int = _opt("VARCOMM_MAX_MESSAGE", _bytes(0), 0,
                            "largest message this rank sends; a larger one raises MessageTooLarge before anything "
                            "is written (0: no limit; GPU memory is also held to the receiver's bound)", "0 (none)")
    a2a_algorithm: str = _opt("VARCOMM_A2A_ALGORITHM", _choice("auto", "one-phase", "two-phase"), "auto",
                              "all-to-all: `one-phase` (shapes travel with the data), `two-phase` (counts first); "
                              "`auto`: one-phase. The same on every rank (set-up refuses ranks that differ)")
    torch_nccl: bool = _opt("VARCOMM_TORCH_NCCL", _BOOL, True,
                            "torch backend: run CUDA tensors' collectives on NCCL", "`1`")
    job_key: str = _opt("VARCOMM_JOB_KEY", _TEXT, "",
                        "the job's shared secret: set-up records and message headers are authenticated with it "
                        "(same on every rank; never printed)", "none; `varcomm-run` sets a random one", secret=True)

    def placed(self, local_world_size: int, cores: int | None = None) -> Options:
        """These options with the choices that depend on the host filled in (spin_us)."""
        if self.spin_us is not None:
            return self
        # Busy-polling only pays when every local rank has a core; otherwise it
        # burns the time slice of the peer we are waiting for (Open MPI yields too).
        n = cores if cores is not None else (os.cpu_count() or 1)
        return self.replaced(spin_us=50 if local_world_size <= n else 0)

    def core(self, cuda_device: int) -> CoreOptions:
        """What the C++ core takes (csrc/options.h); cuda_device -1: none."""
        if self.spin_us is None:
            raise InvalidArgument("Options.spin_us is still auto: call Options.placed(local_world_size) first")
        return {
            "bound": self.bound, "slots": self.slots, "spin_us": self.spin_us, "transport": self.transport,
            "rdma_provider": self.rdma_provider, "rdma_iface": self.rdma_iface, "peer_timeout": self.peer_timeout,
            "rdma_strict": self.rdma_strict, "rdma_eager_credits": self.rdma_eager_credits,
            "liveness_addr": self.liveness_addr, "debug": self.debug, "nvlink": self.nvlink,
            "cuda_device": cuda_device, "nvlink_flags": self.nvlink_flags,
            "nvlink_kernel_max": self.nvlink_kernel_max, "eager_max": self.eager_max or 0,  # 0: the transport's
            "landing": self.landing,
            "max_message": self.max_message, "job_key": self.job_key,
            "rdma_chunk": self.rdma_chunk, "rdma_hmem": self.rdma_hmem, "cma": self.cma,
            "shm_stores": self.shm_stores, "a2a_algorithm": self.a2a_algorithm,
        }


# ---------------------------------------------------------------------------
# the launcher's and harness's variables


@dataclasses.dataclass(frozen=True)
class ToolOptions(_Declared):
    """varcomm-run's and varcomm.testing's variables (not the library's)."""

    _what: ClassVar[str] = "tool option"

    test_seed: int | None = _opt("VARCOMM_TEST_SEED", _int(0, auto=True), None,
                                 "seed of randomized tests; varcomm-run and `@world` give every rank the same one",
                                 "random (printed)")
    test_threads: int = _opt("VARCOMM_TEST_THREADS", _int(1), 1, "torch threads per `@world` rank")
    test_timeout_scale: float = _opt("VARCOMM_TEST_TIMEOUT_SCALE",
                                     Seconds("a number > 0", 1e-9), 1.0,
                                     "multiplies every `@world` timeout (slow machines)", "`1`")
    launcher: bool = _opt("VARCOMM_LAUNCHER", _BOOL, False, "set to 1 by varcomm-run in every rank", "`0`")
    launcher_warned: str = _opt("VARCOMM_LAUNCHER_WARNED", _TEXT, "",
                                "set by varcomm-run: the unknown VARCOMM_* variables it warned about for the job "
                                "(comma-separated; its ranks do not repeat them)", "none")
    launcher_status: str = _opt("VARCOMM_LAUNCHER_STATUS", _TEXT, "",
                                "set by varcomm-run: the file a rank creates when it meets a peer's failure, so "
                                "that the launcher names the rank that failed first (taken out of the rank's "
                                "environment at init: the processes it starts are no ranks)", "none")


#: Read by setup.py at build time, not here.
BUILD_VARIABLES = ("VARCOMM_NO_CUDA", "VARCOMM_NVCC", "VARCOMM_OPT", "VARCOMM_CUDA_ARCHS", "VARCOMM_NO_RDMA",
                   "VARCOMM_NO_TORCH_HOOKS")


_warned: set[str] = set()


def _warn_unknown(env: Mapping[str, str]) -> None:
    """A VARCOMM_ variable that no option, tool or build step reads is most
    likely a misspelled one (VARCOMM_BOUNDS=1K): say so once per process,
    with the nearest name, instead of ignoring it silently as before. (A
    keyword of init() that does not exist is a TypeError already.)
    VARCOMM_BENCH_* belong to varcomm-bench. Those varcomm-run said once for
    the job (VARCOMM_LAUNCHER_WARNED) are not repeated by every rank; one a
    rank sets itself still is."""
    said = set((env_value(ToolOptions, "launcher_warned", env) or "").split(","))
    names = [n for n in unknown_variables(env) if n not in _warned and n not in said]
    known = sorted(_known_variables()) if names else []
    for name in names:
        _warned.add(name)
        near = nearest_variable(name, known)
        hint = f" (did you mean {near}?)" if near else ""
        warnings.warn(f"{name} is not a varcomm variable{hint}: it is ignored (`varcomm-doctor` lists the options)",
                      stacklevel=4)  # the caller of init() (warn <- here <- resolve <- init)


def nearest_variable(name: str, known: Sequence[str] | None = None) -> str | None:
    """The varcomm variable a misspelt `name` most likely meant, or None."""
    near = difflib.get_close_matches(name, sorted(_known_variables()) if known is None else known, 1)
    return near[0] if near else None


def _known_variables() -> set[str]:
    return ({s.env for s in Options.specs().values()} | {s.env for s in ToolOptions.specs().values()}
            | set(BUILD_VARIABLES))


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """The VARCOMM_ variables in env that nothing reads (VARCOMM_BENCH_* are varcomm-bench's), sorted."""
    names = {n for n in env if n.startswith("VARCOMM_") and not n.startswith("VARCOMM_BENCH_")}
    return sorted(names - _known_variables()) if names else []


def env_name(cls: type[_Declared], field: str) -> str:
    """The environment variable of `field` (for writing a child's environment)."""
    return cls.specs()[field].env


def env_value(cls: type[_Declared], field: str, environ: Mapping[str, str] | None = None) -> Any:
    """`field` alone as the environment sets it (None when unset): for tools
    that must not resolve every option (the launcher imports nothing heavy)."""
    spec = cls.specs()[field]
    env = os.environ if environ is None else environ
    return _convert(spec, env[spec.env], spec.env) if env.get(spec.env, "").strip() else None


class InvalidEnvironment(InvalidArgument):
    """VARCOMM_* variables set to values their option does not accept.
    `problems` maps each such variable to what is wrong and what it accepts
    (the message holds those lines, one per variable); `options` are the
    options with those variables left at their defaults, for a report that
    goes on."""

    def __init__(self, problems: Mapping[str, str], options: Options) -> None:
        self.problems = dict(problems)
        self.options = options
        super().__init__("\n".join(self.problems.values()))


def resolve_valid(environ: Mapping[str, str] | None = None) -> Options:
    """The library's options from `environ` (default: os.environ), after
    checking every VARCOMM_* value, the tools' variables included.

    `Options.resolve` stops at the first bad value and leaves the tools'
    variables to the tools; a check of the whole environment (varcomm-doctor)
    should name every bad one at once. Raises InvalidEnvironment (a
    ValueError) with one line per bad variable: its value and what it accepts."""
    env = os.environ if environ is None else environ
    problems: dict[str, str] = {}
    for cls in (Options, ToolOptions):
        for spec in cls.specs().values():
            if env.get(spec.env, "").strip():
                try:
                    _convert(spec, env[spec.env], spec.env)
                except InvalidArgument as e:
                    problems[spec.env] = str(e)
    if problems:
        raise InvalidEnvironment(problems, Options.resolve({k: v for k, v in env.items() if k not in problems}))
    return Options.resolve(environ)


def environment(environ: Mapping[str, str] | None = None,
                prefixes: tuple[str, ...] = ("VARCOMM_", "FI_")) -> dict[str, str]:
    """The set variables that concern varcomm (its own and libfabric's), for reports."""
    env = os.environ if environ is None else environ
    secrets = {s.env: s for s in Options.specs().values() if s.secret}
    return {k: str(shown(secrets[k], v)) if k in secrets else v
            for k, v in sorted(env.items()) if k.startswith(prefixes)}


def known_variables() -> set[str]:
    return ({s.env for s in Options.specs().values()} | {s.env for s in ToolOptions.specs().values()}
            | set(BUILD_VARIABLES))


def markdown_table() -> str:
    """The README's options table (tests/test_options.py checks the README holds it)."""
    lines = ["| option | environment | default | values | meaning |", "|---|---|---|---|---|"]
    for name, spec in Options.specs().items():
        lines.append(f"| `{name}` | `{spec.env}` | {spec.default_doc} | {spec.kind.accepts} | {spec.doc} |")
    lines += ["", "| tool variable | default | meaning |", "|---|---|---|"]
    for spec in ToolOptions.specs().values():
        lines.append(f"| `{spec.env}` | {spec.default_doc} | {spec.doc} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        print(markdown_table())
        return 0
    if args:
        print("usage: python -m varcomm.options [--markdown]", file=sys.stderr)
        return 2
    opts = Options.resolve()
    for name, spec in Options.specs().items():
        print(f"{name:20} {shown(spec, getattr(opts, name))!r:24} {spec.env}")
    return 0


__all__ = ["Options", "ToolOptions", "Spec", "parse_bytes", "markdown_table", "environment", "env_name", "env_value",
           "BUILD_VARIABLES", "InvalidEnvironment", "resolve_valid"]

if __name__ == "__main__":
    sys.exit(main())
