"""All-to-all-v on 4 ranks: varcomm (no count exchange) against its baselines,
all in one run.

    python bench/alltoall.py [-n 4] [--sizes 8K,128K,1M,8M] [--samples 5] [--quick]

Methods (each does one variable-size all-to-all of [T, 1024] bf16 token rows
per iteration, the receiver learning the sizes; the output is allocated once
the sizes are known, as a training framework would):

  varcomm    varcomm.alltoall.all_to_all_v over shm: one message per pair, the
             row count in its header, no count exchange
  two-phase  the same shm transport running the conventional algorithm (count
             message per pair first, then the payload straight into place),
             coded as tightly as the one-phase path: isolates what the count
             exchange itself costs
  fallback   varcomm over its torch.distributed gloo fallback (count exchange,
             then shape header + payload): the baseline to beat by >= 20x
  mpi4py     Open MPI 4.1: comm.Alltoall of the counts, then comm.Alltoallv
             (bench/mpi_alltoallv.py under mpirun --oversubscribe): >= 1.0x

Routing: "uniform" sends T/n rows to every rank; "zipf" routes each token to
one of 4n experts drawn from a Zipf law (a = 1.2), experts sharded
contiguously, so rank 0 receives most of the traffic.

Reported per point: time per all-to-all (mean over the iterations of a
sample, the slowest rank; the best of --samples samples, taken in rounds
over all methods in rotated order; a second table gives the medians), algbw = S / time with S the mean bytes a rank
sends (its whole buffer, own chunk included, as nccl-tests count it), and
busbw = algbw * (n-1)/n (nccl-tests' all-to-all convention).

Started outside a launcher it starts one job running every method, so a
noisy machine slows them alike: under mpirun -n N --oversubscribe when
mpi4py is installed (varcomm bootstraps from MASTER_ADDR/PORT, MPI from
mpirun; bench/mpi_alltoallv.py supplies the MPI method), else under
python -m varcomm.run -n N without the MPI column. It writes
bench/results/alltoall-<date>.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

HIDDEN = 1024  # bf16 elements per token row
ROW_BYTES = 2 * HIDDEN
PATTERNS = ("uniform", "zipf")
DEFAULT_SIZES = "8K,128K,1M,8M"
SAMPLES = 5
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Rough per-op (latency s, bandwidth B/s) per method on this kind of machine, used
# only to size iteration counts so a sample lasts about --sample-s. Deterministic,
# so every rank (and the MPI job) agrees on the counts without talking.
_MODEL = {"varcomm": (3e-4, 1.5e9), "two-phase": (6e-4, 1.5e9), "fallback": (1e-2, 3e8), "mpi4py": (3e-4, 1.5e9)}


def parse_bytes(s: str) -> int:
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1:] in mult else int(s)


def fmt_bytes(n: float) -> str:
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            v = n / f
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def splits_matrix(pattern: str, per_rank_bytes: int, n: int) -> np.ndarray:
    """rows[s, d]: token rows rank s sends rank d. Same on every rank and job."""
    tokens = max(per_rank_bytes // ROW_BYTES, n)
    if pattern == "uniform":
        return np.full((n, n), tokens // n, dtype=np.int64)
    m = np.zeros((n, n), dtype=np.int64)
    experts = 4 * n
    for s in range(n):
        rng = np.random.default_rng([per_rank_bytes, s])
        p = 1.0 / np.arange(1, experts + 1) ** 1.2
        e = rng.choice(experts, size=tokens, p=p / p.sum())
        m[s] = np.bincount(e // 4, minlength=n)
    return m


def iterations(method: str, bytes_per_rank: float, sample_s: float) -> int:
    lat, bw = _MODEL[method]
    return int(min(max(sample_s / (lat + bytes_per_rank / bw), 3), 400))


def points(sizes: list[int], n: int) -> list[tuple[str, int, np.ndarray]]:
    return [(p, s, splits_matrix(p, s, n)) for p in PATTERNS for s in sizes]


# ---------------------------------------------------------------------------
# worker: one rank of the job


def _worker(args: argparse.Namespace) -> None:
    import torch

    import varcomm
    from varcomm import alltoall as A

    torch.set_num_threads(1)
    methods = args.methods.split(",")
    mpi = None
    if "mpi4py" in methods:
        if os.environ.get("OMPI_COMM_WORLD_SIZE"):
            spec = importlib.util.spec_from_file_location("_mpi_alltoallv", HERE / "mpi_alltoallv.py")
            mpi = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mpi)  # initialises MPI
        else:
            methods.remove("mpi4py")
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    results: dict[str, dict[str, list[float]]] = {}
    shm = varcomm.init(transport="shm", bound=1 << 16, slots=2, timeout=300)  # timing and control only
    n, r = shm.world_size, shm.rank
    pts = points(sizes, n)
    bound = max(max(int(m.max()) for _, _, m in pts) * ROW_BYTES, 1 << 16)
    comms = {"varcomm": varcomm.init(transport="shm", bound=bound, slots=2, timeout=300)}
    comms["two-phase"] = comms["varcomm"]
    if "fallback" in methods:
        try:
            comms["fallback"] = varcomm.init(transport="fallback", bound=bound, timeout=300)
        except Exception as e:  # a build without the fallback: report it as missing
            if r == 0:
                print(f"fallback unavailable: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            methods.remove("fallback")

    def slowest(dt: float) -> float:
        A.ALGORITHM = "auto"
        allt, _ = A.all_to_all_v(shm, torch.full((n,), dt, dtype=torch.float64), [1] * n)
        return float(allt.max())

    for pattern, size, m in pts:
        mine = m[r].tolist()
        x = torch.full((int(m[r].sum()), HIDDEN), float(r), dtype=torch.bfloat16)
        want = torch.repeat_interleave(torch.arange(n, dtype=torch.bfloat16), torch.from_numpy(m[:, r]))
        ops = {}
        for method in methods:
            if method == "mpi4py":
                mop = mpi.make_op(mpi.MPI.COMM_WORLD, x.view(torch.uint8).numpy(), m[r], ROW_BYTES)
                ops[method] = (lambda mop=mop: (torch.from_numpy(mop().reshape(-1)).view(torch.bfloat16)
                                                .reshape(-1, HIDDEN), None))
            else:
                ops[method] = (lambda c=comms[method], a="two-phase" if method == "two-phase" else "auto":
                               (setattr(A, "ALGORITHM", a), A.all_to_all_v(c, x, mine))[1])
        iters = {meth: iterations(meth, float(m.sum()) * ROW_BYTES / n, args.sample_s) for meth in methods}
        for meth, op in ops.items():  # check once, warm up
            got, _rs = op()
            assert torch.equal(got[:, 0], want) and torch.equal(got[:, -1], want), f"{meth} {pattern} {size}: wrong"
            for _ in range(min(iters[meth], 3)):
                op()
        samples: dict[str, list[float]] = {meth: [] for meth in methods}
        for k in range(args.samples):  # rounds over the methods, each in a rotated order
            order = methods[k % len(methods):] + methods[:k % len(methods)]
            for meth in order:
                op, it = ops[meth], iters[meth]
                shm.barrier()
                t0 = time.perf_counter()
                for _ in range(it):
                    op()
                samples[meth].append(slowest((time.perf_counter() - t0) / it))
        results[f"{pattern}/{size}"] = {meth: v for meth, v in samples.items()}
        if r == 0:
            print(f"  {pattern:8s} {fmt_bytes(size):>8s}: " + ", ".join(
                f"{meth} {_fmt_t(min(v))}" for meth, v in samples.items()), flush=True)
    if r == 0:
        Path(args.worker_out).write_text(json.dumps(results))
    A.ALGORITHM = "auto"
    for c in {id(c): c for c in comms.values()}.values():
        c.close()
    shm.close()


# ---------------------------------------------------------------------------
# driver


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _mpi_available() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed"
    return None


def driver(args: argparse.Namespace) -> None:
    n = args.n
    env = _env()
    why_no_mpi = _mpi_available() if "mpi4py" in args.methods.split(",") else "not requested"
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        me = [str(Path(__file__).resolve()), "--worker-out", out, "--sizes", args.sizes, "--methods", args.methods,
              "--sample-s", str(args.sample_s), "--samples", str(args.samples)]
        if why_no_mpi is None:
            # One job for every method, so a noisy machine slows them alike: varcomm
            # and its fallback bootstrap from MASTER_ADDR/PORT, MPI from mpirun.
            sys.path.insert(0, str(ROOT / "python"))
            from varcomm.run import free_port

            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
                   "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH", sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "varcomm.run", "-n", str(n), "--timeout", "900", *me]
        print(f"job: {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, env=env, check=True)
        results = json.loads(Path(out).read_text())
    elapsed = time.time() - t_start
    text = report(results, args, n, why_no_mpi, elapsed, shlex.join(cmd).replace(tmp, "$TMP"))
    print(text)
    if not args.no_save:
        dest = HERE / "results" / f"alltoall-{datetime.date.today().isoformat()}.md"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        print(f"wrote {dest.relative_to(ROOT)}")


def report(results: dict, args: argparse.Namespace, n: int, why_no_mpi: str | None, elapsed: float,
           job: str) -> str:
    methods = [m for m in ("varcomm", "two-phase", "fallback", "mpi4py") if any(m in per for per in results.values())]
    lines = [f"# all-to-all-v, {n} ranks, one host ({datetime.date.today().isoformat()})", "",
             "Command: `" + " ".join(["python bench/alltoall.py", *args.argv]).strip() + "`", "",
             f"Job it ran: `{job}`", "",
             f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), {n} ranks (oversubscribed when ranks > CPUs); "
             f"load average at the end {', '.join(f'{v:.1f}' for v in os.getloadavg())} (other jobs share this "
             f"machine); the whole run took {elapsed:.0f} s.", "",
             "Each iteration: one variable-size all-to-all of [T, 1024] bf16 rows, the receivers learning the "
             "sizes and allocating the output. S = mean bytes a rank sends (its whole buffer, own chunk "
             "included). time = the slowest rank's mean time per op over a sample. "
             f"{args.samples} samples per method and point, taken in rounds over all methods in rotated order, "
             "in one job, so machine noise hits every method alike. The first table gives the best sample "
             "(load from other jobs only ever adds time), the second the median. algbw = S / time; "
             "busbw = algbw * (n-1)/n (nccl-tests all-to-all convention); GB/s = 1e9 B/s.", "",
             "Methods: **varcomm** = `varcomm.alltoall.all_to_all_v` over shm, no count exchange (each chunk's "
             "row count travels in its message header); **two-phase** = the same shm transport and the same "
             "low-level calls, with a count message per pair first and the payload received straight into place "
             "(`VARCOMM_A2A_ALGORITHM=two-phase`): what the count exchange itself costs; **fallback** = varcomm over its "
             "torch.distributed gloo fallback (counts first, then shape header + payload); **mpi4py** = Open "
             "MPI 4.1 `Alltoall` of the counts + `Alltoallv` (vader shared memory with CMA single-copy, "
             "mpirun --oversubscribe)."]
    if why_no_mpi:
        lines += ["", f"mpi4py baseline not run: {why_no_mpi}."]
    worst: dict[str, float] = {}
    for title, stat in (("Best of the samples", min), ("Median of the samples", statistics.median)):
        lines += ["", f"## {title}", ""]
        lines += _table(results, args, n, methods, stat, worst if stat is min else {})
    verdict = []
    for base, goal in (("mpi4py", 1.0), ("fallback", 20.0)):
        if base in worst:
            verdict.append(f"varcomm >= {goal:g}x {base}'s speed: {'met' if worst[base] >= goal else 'NOT met'} "
                           f"at every point (worst point {worst[base]:.2f}x)")
        else:
            verdict.append(f"varcomm >= {goal:g}x {base}'s speed: not measured")
    lines += ["", "Targets (best-of table): " + "; ".join(verdict) + ".", ""]
    return "\n".join(lines)


def _table(results: dict, args: argparse.Namespace, n: int, methods: list[str], stat: Callable,
           worst: dict[str, float]) -> list[str]:
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    head = "| routing | S | " + " | ".join(f"{m} time | {m} busbw" for m in methods) + " | vs mpi4py | vs fallback |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for pattern in PATTERNS:
        for size in sizes:
            per = results.get(f"{pattern}/{size}", {})
            m = splits_matrix(pattern, size, n)
            s_bytes = float(m.sum()) * ROW_BYTES / n
            cells = [pattern, fmt_bytes(s_bytes)]
            t = {k: stat(v) for k, v in per.items() if v}
            for meth in methods:
                if meth in t:
                    cells += [_fmt_t(t[meth]), f"{s_bytes / t[meth] / 1e9 * (n - 1) / n:.2f} GB/s"]
                else:
                    cells += ["n/a", "n/a"]
            for base in ("mpi4py", "fallback"):
                if "varcomm" in t and base in t:
                    x = t[base] / t["varcomm"]
                    worst[base] = min(worst.get(base, x), x)
                    cells.append(f"{x:.1f}x" if x >= 10 else f"{x:.2f}x")
                else:
                    cells.append("n/a")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt_t(t: float) -> str:
    return f"{t * 1e6:.0f} us" if t < 1e-2 else f"{t * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"per-rank bytes sent, comma-separated ({DEFAULT_SIZES})")
    p.add_argument("--methods", default="varcomm,two-phase,fallback,mpi4py")
    p.add_argument("--samples", type=int, default=SAMPLES, help=f"timed samples per method and point ({SAMPLES})")
    p.add_argument("--sample-s", type=float, default=0.15, help="target seconds per timed sample")
    p.add_argument("--quick", action="store_true", help="3 short samples")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.samples, args.sample_s = 3, 0.04
    if args.worker_out:
        try:
            _worker(args)
        except BaseException:
            if "mpi4py.MPI" in sys.modules:  # don't leave the other ranks waiting in MPI
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)
            raise
    elif os.environ.get("WORLD_SIZE", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE", "1") != "1":
        sys.exit("run bench/alltoall.py without a launcher: it starts its own job")
    else:
        driver(args)


if __name__ == "__main__":
    main()
