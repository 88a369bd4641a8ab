"""varcomm.options: every option declared once, parsed once, and passed down
without touching os.environ (init, the torch backend, varcomm.distributed)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import varcomm
from varcomm import bootstrap, options, testing
from varcomm.options import Options, ToolOptions
from varcomm.testing import world
from varcomm.tools.run import free_port

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "varcomm"
CORE_KEYS = {"bound", "slots", "spin_us", "transport", "rdma_provider", "rdma_iface", "peer_timeout", "rdma_strict",
             "rdma_eager_credits", "liveness_addr", "debug", "nvlink", "cuda_device", "nvlink_flags",
             "nvlink_kernel_max", "eager_max", "max_message", "job_key", "rdma_chunk", "rdma_hmem", "cma", "landing",
             "shm_stores", "a2a_algorithm"}


# ---------------------------------------------------------------------------
# declared once


def test_readme_table_is_the_options_fields():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- options table:[^\n]*-->\n(.*?)\n<!-- end of options table -->", readme, re.S)
    assert m, "README.md lost its generated options table (python -m varcomm.options --markdown)"
    assert m.group(1) == options.markdown_table(), \
        "README options table differs from varcomm.options: regenerate it with python -m varcomm.options --markdown"
    for f in dataclasses.fields(Options):
        assert f"| `{f.name}` | `{f.metadata['spec'].env}` |" in readme


def test_each_field_has_one_distinct_variable():
    specs = {**Options.specs(), **ToolOptions.specs()}
    names = [s.env for s in specs.values()]
    assert len(names) == len(set(names)) and all(n.startswith("VARCOMM_") for n in names)
    assert not set(names) & set(options.BUILD_VARIABLES)
    assert {f.name for f in dataclasses.fields(Options)} == set(Options.specs())


def test_core_dict_has_exactly_the_core_keys():
    core = Options.resolve({}).placed(local_world_size=1, cores=4).core(cuda_device=3)
    assert set(core) == CORE_KEYS
    assert core["cuda_device"] == 3 and core["spin_us"] == 50 and core["bound"] == 8 << 20
    assert Options.resolve({}).placed(local_world_size=8, cores=4).core(-1)["spin_us"] == 0
    with pytest.raises(varcomm.InvalidArgument, match="spin_us"):
        Options.resolve({}).core(-1)  # auto until placed


def test_no_module_but_options_and_bootstrap_reads_the_environment():
    reads = re.compile(r"environ\.get\(|getenv\(|environ\[[^\]]+\](?!\s*=[^=])|in os\.environ")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("options.py", "bootstrap.py") or path.name.startswith("bench"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if reads.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not offenders, "read options through varcomm.options:\n" + "\n".join(offenders)


def test_alltoall_has_no_import_time_algorithm():
    from varcomm.collectives import alltoall

    assert not hasattr(alltoall, "ALGORITHM")


# ---------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("text, value", [
    ("8388608", 8 << 20), ("64K", 64 << 10), ("64k", 64 << 10), ("64M", 64 << 20), ("1G", 1 << 30),
    ("64MiB", 64 << 20), ("64KB", 64 << 10), ("1.5M", 3 << 19), (" 2 M ", 2 << 20), ("64", 64),
])
def test_bytes_parse(text, value):
    assert options.parse_bytes(text) == value
    assert Options.resolve({"VARCOMM_BOUND": text}).bound == value


@pytest.mark.parametrize("text", ["1", "8", "63"])
def test_a_bound_under_64_bytes_is_refused_naming_the_unit(text):
    """VARCOMM_BOUND=1 (meant as 1 MiB, or not) made 1-byte slots: a 4 MiB
    message then streamed in 4M chunks and timed out after 20 s saying the
    receiver had not freed a slot. A bound under 64 bytes is refused, saying a
    bare number is bytes."""
    with pytest.raises(varcomm.InvalidArgument, match=rf"VARCOMM_BOUND='{text}': use a size in bytes .*, at least 64 "
                                                      r"\(a bare number is bytes: 1M for a MiB\)"):
        Options.resolve({"VARCOMM_BOUND": text})
    with pytest.raises(varcomm.InvalidArgument, match=rf"init\(bound={text}\): .*at least 64"):
        Options.resolve(bound=int(text), keyword_origin="init")


@pytest.mark.parametrize("text", ["", "M", "64X", "-1", "1e6", "64 MiBs", "0x10", "two", "0.5", "1.5"])
def test_bytes_refused(text):
    with pytest.raises(ValueError):
        options.parse_bytes(text)


@pytest.mark.parametrize("env", [{"VARCOMM_LANDING": "0.5"}, {"VARCOMM_BOUND": str(2**64 - 1)},
                                 {"VARCOMM_EAGER_MAX": "8388608T"}])
def test_a_fraction_of_a_byte_or_a_size_past_64_bits_names_its_variable(env):
    """VARCOMM_LANDING=0.5 was silently 0 (no landing area), and a size of
    2**64 - 1 was the core's "option ... has the wrong type: int", naming no
    variable (helper-69)."""
    (name, text), = env.items()
    with pytest.raises(varcomm.InvalidArgument, match=f"{name}='{text}': use a size in bytes"):
        Options.resolve(env)


@pytest.mark.parametrize("env, field, value", [
    ({"VARCOMM_SLOTS": "1024"}, "slots", 1024),
    ({"VARCOMM_TRANSPORT": "SHM"}, "transport", "shm"),
    ({"VARCOMM_TIMEOUT": "none"}, "timeout", None),
    ({"VARCOMM_TIMEOUT": "inf"}, "timeout", None),
    ({"VARCOMM_TIMEOUT": "2.5"}, "timeout", 2.5),
    ({"VARCOMM_ARRAY": "numpy"}, "array", "numpy"),
    ({"VARCOMM_SPIN_US": "0"}, "spin_us", 0),
    ({"VARCOMM_SPIN_US": "auto"}, "spin_us", None),
    ({"VARCOMM_NVLINK": "1"}, "nvlink", "on"),
    ({"VARCOMM_NVLINK": "false"}, "nvlink", "off"),
    ({"VARCOMM_NVLINK": "auto"}, "nvlink", "auto"),
    ({"VARCOMM_NVLINK_DEVICE": "1"}, "nvlink_device", 1),
    ({"VARCOMM_NVLINK_FLAGS": "host"}, "nvlink_flags", "host"),
    ({"VARCOMM_NVLINK_KERNEL_MAX": "8K"}, "nvlink_kernel_max", 8192),
    ({"VARCOMM_A2A_ALGORITHM": "two-phase"}, "a2a_algorithm", "two-phase"),
    ({"VARCOMM_TORCH_NCCL": "0"}, "torch_nccl", False),
    ({"VARCOMM_TORCH_NCCL": "off"}, "torch_nccl", False),
    ({"VARCOMM_RDMA_STRICT": "1"}, "rdma_strict", True),
    ({"VARCOMM_RDMA_EAGER_CREDITS": "yes"}, "rdma_eager_credits", True),
    ({"VARCOMM_DEBUG": "true"}, "debug", True),
    ({"VARCOMM_PEER_TIMEOUT": "2"}, "peer_timeout", 2),
    ({"VARCOMM_FI_PROVIDER": "tcp;ofi_rxm"}, "rdma_provider", "tcp;ofi_rxm"),
    ({"VARCOMM_FI_IFACE": "eth0"}, "rdma_iface", "eth0"),
    ({"VARCOMM_LIVENESS_ADDR": "10.0.0.1"}, "liveness_addr", "10.0.0.1"),
    ({"VARCOMM_BOUND": ""}, "bound", 8 << 20),  # empty: unset
])
def test_environment_values(env, field, value):
    assert getattr(Options.resolve(env), field) == value


@pytest.mark.parametrize("var, text, accepts", [
    ("VARCOMM_BOUND", "lots", "a size in bytes"),
    ("VARCOMM_BOUND", "0", "at least 64"),
    ("VARCOMM_SLOTS", "0", r"\[1, 1024\]"),
    ("VARCOMM_SLOTS", "1025", r"\[1, 1024\]"),
    ("VARCOMM_TRANSPORT", "ib", "auto, shm, rdma or fallback"),
    ("VARCOMM_TIMEOUT", "soon", "none/inf"),
    ("VARCOMM_TIMEOUT", "-1", "none/inf"),
    ("VARCOMM_ARRAY", "jax", "auto, torch, numpy or cupy"),
    ("VARCOMM_NVLINK", "maybe", "auto, on or off"),
    ("VARCOMM_NVLINK_FLAGS", "pinned", "device or host"),
    ("VARCOMM_A2A_ALGORITHM", "three-phase", "auto, one-phase or two-phase"),
    ("VARCOMM_DEBUG", "loud", "1 or 0"),
    ("VARCOMM_PEER_TIMEOUT", "1", ">= 2"),
    ("VARCOMM_NVLINK_KERNEL_MAX", "-8K", "a size in bytes"),
])
def test_bad_environment_value_names_the_variable(var, text, accepts):
    with pytest.raises(varcomm.InvalidArgument, match=f"^{var}={text!r}: use .*{accepts}"):
        Options.resolve({var: text})


def test_bad_keyword_names_the_keyword():
    with pytest.raises(varcomm.InvalidArgument, match=r"^init\(slots=0\): use an integer in \[1, 1024\]"):
        Options.resolve({}, keyword_origin="init", slots=0)
    with pytest.raises(varcomm.InvalidArgument, match=r"^init\(bound='big'\)"):
        varcomm.init(bound="big")  # refused before any rendezvous
    with pytest.raises(varcomm.InvalidArgument, match=r"Options\(transport='ib'\)"):
        Options(transport="ib")
    with pytest.raises(varcomm.InvalidArgument, match="slots"):
        Options(slots=True)  # a bool is not a count


def test_a_refused_secret_is_not_shown():
    """A job key of the wrong type (bytes read from a key file) was quoted in
    the error, and so in tracebacks and logs. Catches: the value in the text."""
    for call in (lambda: Options.resolve({}, keyword_origin="init", job_key=b"SECRETBYTES"),
                 lambda: Options(job_key=b"SECRETBYTES")):
        with pytest.raises(varcomm.InvalidArgument, match=r"job_key=\(not shown: a secret\)") as e:
            call()
        assert "SECRETBYTES" not in str(e.value)


def test_a_bad_tool_variable_does_not_fail_init(tmp_path):
    """init() marks peer failures for varcomm-run by reading its one variable:
    it validated every tool variable, so VARCOMM_TEST_SEED=abc (a harness
    variable) failed every init, inside or outside the launcher. Catches: the
    InvalidArgument."""
    env = dict(os.environ, VARCOMM_TEST_SEED="abc", VARCOMM_LAUNCHER_STATUS=str(tmp_path / "0"),
               MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "-c", "import varcomm; varcomm.init(transport='shm').close(); print('ok')"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_keywords_beat_the_environment():
    env = {"VARCOMM_BOUND": "64K", "VARCOMM_SLOTS": "4", "VARCOMM_TIMEOUT": "5", "VARCOMM_NVLINK": "off"}
    o = Options.resolve(env, bound="1M", slots=None, timeout=None, nvlink=True)
    assert o.bound == 1 << 20  # keyword
    assert o.slots == 4  # None: left to the environment
    assert o.timeout is None  # timeout=None is a value: wait forever
    assert o.nvlink == "on"
    assert Options.resolve(env).override(bound=4096).bound == 4096


def test_unknown_keyword_names_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown option 'bund'; valid: bound, slots, transport"):
        Options.resolve({}, bund=1)
    with pytest.raises(TypeError, match=r"^init\(\) got unknown option 'bund'; valid: .*a2a_algorithm"):
        varcomm.init(bund=1)


def test_tool_options():
    t = ToolOptions.resolve({"VARCOMM_TEST_SEED": "123", "VARCOMM_TEST_THREADS": "2",
                             "VARCOMM_TEST_TIMEOUT_SCALE": "0.5", "VARCOMM_LAUNCHER": "1"})
    assert (t.test_seed, t.test_threads, t.test_timeout_scale, t.launcher) == (123, 2, 0.5, True)
    assert ToolOptions.resolve({}).test_seed is None
    with pytest.raises(varcomm.InvalidArgument, match="^VARCOMM_TEST_TIMEOUT_SCALE='0': use a number > 0"):
        ToolOptions.resolve({"VARCOMM_TEST_TIMEOUT_SCALE": "0"})


def test_resolve_valid_names_every_bad_variable():
    env = {"VARCOMM_TIMEOUT": "abc", "VARCOMM_TRANSPORT": "bogus", "VARCOMM_TEST_SEED": "x", "VARCOMM_SLOTS": "4"}
    with pytest.raises(ValueError) as info:  # not just the first: the tools' variables too
        options.resolve_valid(env)
    e = info.value
    assert isinstance(e, options.InvalidEnvironment) and isinstance(e, varcomm.InvalidArgument)
    assert e.problems == {
        "VARCOMM_TIMEOUT": "VARCOMM_TIMEOUT='abc': use seconds (a number >= 0), or none/inf for no limit",
        "VARCOMM_TRANSPORT": "VARCOMM_TRANSPORT='bogus': use auto, shm, rdma or fallback",
        "VARCOMM_TEST_SEED": "VARCOMM_TEST_SEED='x': use an integer >= 0, or auto",
    }
    assert str(e).splitlines() == list(e.problems.values())
    assert (e.options.slots, e.options.timeout, e.options.transport) == (4, 600.0, "auto")  # the rest still read
    assert options.resolve_valid({"VARCOMM_SLOTS": "4", "VARCOMM_TIMEOUT": "none"}) == Options.resolve(
        {"VARCOMM_SLOTS": "4", "VARCOMM_TIMEOUT": "none"})


# ---------------------------------------------------------------------------
# launcher variables: one list


def test_launcher_list_serves_bootstrap_and_testing(monkeypatch):
    from varcomm.tools.run import rank_env

    for la in bootstrap.LAUNCHERS:
        for var in (la.rank, la.world_size, la.local_rank, la.local_world_size):
            if var:
                monkeypatch.delenv(var, raising=False)
    for k, v in rank_env(2, 3, 29999, base={}).items():  # what varcomm-run and @world export
        monkeypatch.setenv(k, v)
    p = bootstrap.placement()
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size, p.master_port) == (2, 3, 2, 3, 29999)
    assert (testing.rank(), testing.world_size()) == (2, 3) and bootstrap.launched() == (3, 2)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert (testing.rank(), testing.world_size()) == (1, 4) and bootstrap.launched() == (4, 1)
    assert bootstrap.placement().rank == 1


def test_harness_imports_without_pytest_or_torch():
    code = ("import sys, varcomm.testing, varcomm.run, varcomm.options; "
            "bad = [m for m in ('pytest', 'torch') if m in sys.modules]; assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------
# options reach the communicator; os.environ is never rewritten


@world(2, timeout=60)
def test_init_keeps_resolved_options():
    os.environ["VARCOMM_SLOTS"] = "3"
    os.environ["VARCOMM_A2A_ALGORITHM"] = "two-phase"
    with varcomm.init(bound="64K", a2a_algorithm="one-phase", timeout=20) as comm:
        o = comm.options
        assert (o.bound, o.slots, o.a2a_algorithm, o.timeout) == (64 << 10, 3, "one-phase", 20.0)
        assert comm.bound == 64 << 10 and comm.slots == 3
        assert o.spin_us is not None  # auto resolved at init
        r = comm.rank
        got, splits = comm.all_to_all_v(torch.arange(2.0) + 10 * r, [1, 1])
        assert splits == [1, 1] and got.tolist() == [float(r), 10.0 + r]


@world(2, timeout=60)
def test_distributed_options_reach_the_communicator_without_environ():
    import torch.distributed as dist

    import varcomm.distributed as vdist
    from varcomm.integrations.torch_backend import comm_of

    before = dict(os.environ)
    vdist.init_process_group("gloo", bound=65536, slots=3, transport="shm", a2a_algorithm="two-phase",
                             max_message=65536)
    try:
        assert dict(os.environ) == before, "init_process_group changed os.environ"
        comm = vdist.get_comm()
        assert (comm.bound, comm.slots, comm.options.transport, comm.options.a2a_algorithm) == \
            (65536, 3, "shm", "two-phase")
        g = dist.new_group([0, 1])  # a later group inherits the default group's options
        assert (comm_of(g).bound, comm_of(g).slots) == (65536, 3)
        with pytest.raises(varcomm.MessageTooLarge, match="max_message"):
            comm.send(torch.zeros(65536 + 1, dtype=torch.uint8), 1 - comm.rank)
    finally:
        vdist.destroy_process_group()
    with pytest.raises(TypeError, match="unknown option 'bund'"):
        vdist.init_process_group("gloo", bund=1)


@world(2, timeout=60)
def test_torch_backend_takes_options_as_pg_options():
    import torch.distributed as dist

    from varcomm.integrations.torch_backend import comm_of

    os.environ["VARCOMM_SLOTS"] = "5"  # the pg_options' value wins over it
    before = dict(os.environ)
    dist.init_process_group("varcomm", pg_options=Options.resolve(slots=2, bound="32K"))
    try:
        assert dict(os.environ) == before
        assert (comm_of().slots, comm_of().bound) == (2, 32 << 10)
    finally:
        dist.destroy_process_group()


@world(2, timeout=60)
def test_distributed_over_a_running_torch_group_and_standalone():
    import torch.distributed as dist

    import varcomm.distributed as vdist

    dist.init_process_group("gloo")
    before = dict(os.environ)
    vdist.init_process_group(bound="128K", slots=2)
    try:
        assert dict(os.environ) == before
        assert (vdist.get_comm().bound, vdist.get_comm().slots) == (128 << 10, 2)
    finally:
        vdist.destroy_process_group()
        dist.destroy_process_group()


def test_a_misspelled_variable_is_named_once_with_the_nearest_option(monkeypatch):
    """VARCOMM_BOUNDS=1K used to be ignored silently: now a warning names it
    and the option meant, once per process; real options, tool, build and
    varcomm-bench variables stay quiet."""
    monkeypatch.setattr(options, "_warned", set())
    monkeypatch.setenv("VARCOMM_BOUNDS", "1K")
    for quiet in ("VARCOMM_BOUND", "VARCOMM_TEST_SEED", "VARCOMM_NO_CUDA", "VARCOMM_BENCH_CMD"):
        monkeypatch.setenv(quiet, os.environ.get(quiet, "1") if quiet != "VARCOMM_BOUND" else "4096")
    said = r"VARCOMM_BOUNDS is not a varcomm variable \(did you mean VARCOMM_BOUND\?\)"
    with pytest.warns(UserWarning, match=said) as got:
        assert Options.resolve().bound == 4096
    named = [str(w.message).split()[0] for w in got]
    assert named.count("VARCOMM_BOUNDS") == 1 and not {"VARCOMM_BOUND", "VARCOMM_TEST_SEED", "VARCOMM_NO_CUDA",
                                                        "VARCOMM_BENCH_CMD"} & set(named), named
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Options.resolve()  # said once
        Options.resolve({"VARCOMM_NOPE": "1"})  # an explicit mapping is the caller's business


def test_given_survives_placing_and_the_communicator() -> None:
    """Options.given() (what the environment or a keyword set, even to the
    default) came back empty from placed() and so from comm.options:
    dataclasses.replace drops what is not a field."""
    o = Options.resolve({"VARCOMM_TIMEOUT": "600"}, slots=8)
    assert o.given() == {"timeout", "slots"}
    assert o.placed(2, cores=2).given() == {"timeout", "slots"}
    assert o.replaced(bound=1 << 20).given() == {"timeout", "slots"}  # a replaced value is not the user's
    with varcomm.init(rank=0, world_size=1, slots=4, timeout=600) as comm:
        assert {"slots", "timeout"} <= comm.options.given(), comm.options.given()
