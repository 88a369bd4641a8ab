#!/usr/bin/env bash
# The GPU check for the nvlink transport, on one machine with a GPU, in a few
# minutes: build, the real-GPU tests (2-4 ranks, which may share one GPU; the
# fake-driver tests of the same files run in `make test`), then the benches,
# each in its share of the 5 minutes: all-to-all, MoE (device splits), p2p over
# nvlink, p2p over rdma-gpu (cross-host GPU path, tcp;ofi_rxm on loopback).
#
#   bash bench/gpu_check.sh                 from anywhere in the repository
#   OUT=/some/dir bash bench/gpu_check.sh   also writes gpu_check.log, pytest.log,
#                                           gpu_alltoall.md, gpu_alltoall.json,
#                                           gpu_p2p.md and gpu_p2p.json there
#
# Needs a python with CUDA torch, numpy, pytest, pybind11, ninja and
# setuptools (PYTHON=... to choose; otherwise the first of python3, python,
# .venv/bin/python whose torch sees a GPU) and g++. Nothing is downloaded.
# Exit status: 0 when the build, the tests and the bench ran and passed, 1 when
# one failed, 2 when a prerequisite is missing (the log says which).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG=$(mktemp)
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; fi
say() { echo "gpu_check: $*" | tee -a "$LOG"; }
finish() {
  say "result: $2 (exit $1)"
  if [ -n "${OUT:-}" ]; then cp "$LOG" "$OUT/gpu_check.log"; fi
  exit "$1"
}
t_start=$(date +%s)

# ---- which python ---------------------------------------------------------
PY=""
for cand in ${PYTHON:-} python3 python .venv/bin/python; do
  command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    PY=$(command -v "$cand")
    break
  fi
  say "$cand: $("$cand" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "sees no GPU")' 2>&1 | tail -1)"
done
if [ -z "$PY" ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
  finish 2 "no python whose torch sees a CUDA GPU (set PYTHON=/path/to/python with CUDA torch)"
fi
say "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0), "x", torch.cuda.device_count())' 2>&1 | tail -1))"
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("numpy", "pytest", "pybind11", "ninja", "setuptools") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then finish 2 "$PY lacks: $missing (carry them as wheels)"; fi
command -v "${CXX:-g++}" >/dev/null || finish 2 "no ${CXX:-g++} to build the extension"

# ---- libfabric for the cross-host GPU block (rdma-gpu) ----------------------
# The build takes libfabric's headers from pkg-config; where the machine has no
# libfabric-dev, one shipped next to the checkout (shared/libfabric, ../libfabric,
# or LIBFABRIC_DIR: include/, lib/, lib/pkgconfig/) is used instead.
if ! pkg-config --exists libfabric 2>/dev/null; then
  for d in ${LIBFABRIC_DIR:-} "$ROOT/shared/libfabric" "$ROOT/../libfabric"; do
    if [ -n "$d" ] && [ -f "$d/lib/pkgconfig/libfabric.pc" ]; then
      export PKG_CONFIG_PATH="$d/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
      export LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      say "libfabric: using the one shipped at $d"
      break
    fi
  done
fi
pkg-config --exists libfabric 2>/dev/null && say "libfabric: $(pkg-config --modversion libfabric) (pkg-config)" \
  || say "libfabric: NOT FOUND (no libfabric-dev, none shipped): the build has no rdma, the cross-host GPU block is skipped"

# ---- build ----------------------------------------------------------------
say "building: $PY setup.py build_ext --inplace"
if ! "$PY" setup.py build_ext --inplace >"$LOG.build" 2>&1; then
  tail -40 "$LOG.build" | tee -a "$LOG"
  finish 1 "build failed"
fi
grep "varcomm: building" "$LOG.build" | tee -a "$LOG"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import varcomm; from varcomm import _C; print("gpu_check: build_info", varcomm.build_info()); print("gpu_check:", _C.nvlink_info())' 2>&1 | tee -a "$LOG"
"$PY" -c "import sys, varcomm; sys.exit(0 if 'nvlink' in varcomm.build_info()['transports'] else 1)" \
  || finish 1 "this build has no nvlink transport"

# ---- tests ----------------------------------------------------------------
GPU_TESTS="tests/test_gpu.py tests/test_gpu_alltoall.py tests/test_gpu_alltoall_device.py"
# rdma-gpu (VARCOMM_TRANSPORT=rdma with the tcp provider, no NIC needed): real
# streams, pinned staging memory, cuStreamWaitValue64 on host-mapped flags.
if "$PY" -c "import sys, varcomm; sys.exit(0 if 'rdma-gpu' in varcomm.build_info()['transports'] else 1)"; then
  GPU_TESTS="$GPU_TESTS tests/test_rdma_gpu.py"; have_rdma_gpu=1
else
  say "cross-host GPU: skipped: this build has no rdma-gpu (libfabric missing at build time, see above)"; have_rdma_gpu=0
fi
# Whether this machine could run GPUDirect RDMA (the provider must offer FI_HMEM for CUDA): said, not required.
if [ "$have_rdma_gpu" -eq 1 ]; then
  say "GPUDirect RDMA with VARCOMM_RDMA_HMEM=1 on ${VARCOMM_FI_PROVIDER:-tcp;ofi_rxm}:"
  VARCOMM_RDMA_HMEM=1 VARCOMM_TRANSPORT=rdma VARCOMM_FI_PROVIDER="${VARCOMM_FI_PROVIDER:-tcp;ofi_rxm}" timeout 40 \
    "$PY" -m varcomm.run -n 2 --timeout 35 -- "$PY" -c 'import torch, varcomm
torch.cuda.init()
try:
    c = varcomm.init(timeout=20)
except varcomm.InvalidArgument as e:
    print("gpu_check: GPUDirect refused:", e, flush=True)
else:
    print("gpu_check: " + c.describe_transport(1 - c.rank) if c.rank == 0 else "", flush=True)
    c.close()' 2>&1 | grep "gpu_check: " | head -2 | tee -a "$LOG" || true
fi
left=$((290 - ($(date +%s) - t_start)))
test_s=$((left - 130)); [ "$test_s" -gt 150 ] && test_s=150; [ "$test_s" -lt 60 ] && test_s=60
say "tests: $GPU_TESTS, real-GPU cases only (at most ${test_s} s)"
timeout "$test_s" "$PY" -m pytest -q -p no:cacheprovider -rs -k "not fake and not namespaces and not mid_stream and not without_a_gpu" \
  $GPU_TESTS >"$LOG.pytest" 2>&1
test_rc=$?
tail -30 "$LOG.pytest" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$LOG.pytest" "$OUT/pytest.log"; fi
# cupy is an optional extra: its test may skip (said in the log); any other skip fails the check.
if grep -q "SKIPPED.*cupy is not installed" "$LOG.pytest"; then say "the cupy test was skipped: cupy is not installed here"; fi
if [ "$test_rc" -eq 0 ] && grep "SKIPPED" "$LOG.pytest" | grep -qv "cupy is not installed"; then
  say "some GPU tests were skipped: failing the check"; test_rc=1
fi

# ---- all-to-all bench: CUDA tensors, against NCCL's two-phase form and a D2D copy ----
# At most 45 s, leaving the MoE and p2p benches theirs.
left=$((290 - ($(date +%s) - t_start)))
a2a_s=$((left - 90)); [ "$a2a_s" -gt 40 ] && a2a_s=40
if [ "$a2a_s" -lt 30 ]; then
  say "no all-to-all bench: only ${left}s left of the 5 minutes"
  a2a_rc=1
else
  say "bench: varcomm-bench alltoall --device cuda (at most ${a2a_s} s)"
  PYTHONPATH="$ROOT/bench:$PYTHONPATH" timeout "$a2a_s" "$PY" -m varcomm_bench alltoall --device cuda --quick \
    --launcher varcomm --timeout "$((a2a_s - 5))" --routing uniform,zipf -e 4M --baselines two-phase,d2d,nccl -c \
    ${OUT:+--json "$OUT/gpu_alltoall.json" --md "$OUT/gpu_alltoall.md"} 2>&1 | tee -a "$LOG"
  a2a_rc=${PIPESTATUS[0]}
fi

# ---- MoE bench: device splits (no host sync) vs NCCL two-phase, symm_mem, d2d ----
left=$((290 - ($(date +%s) - t_start)))
moe_s=$((left - 60)); [ "$moe_s" -gt 35 ] && moe_s=35
if [ "$moe_s" -lt 20 ]; then
  say "no MoE bench: only ${left}s left of the 5 minutes"
  moe_rc=1
else
  say "bench: varcomm-bench moe (2 ranks, at most ${moe_s} s)"
  PYTHONPATH="$ROOT/bench:$PYTHONPATH" timeout "$moe_s" "$PY" -m varcomm_bench.moe --nranks 2 --tokens 2048 --hidden 2048 \
    --iters 10 --warmup 3 ${OUT:+--json "$OUT/moe.json"} 2>&1 | tee -a "$LOG"
  moe_rc=${PIPESTATUS[0]}
fi

# ---- p2p bench --------------------------------------------------------------
left=$((290 - ($(date +%s) - t_start)))
p2p_s=$left; [ "$have_rdma_gpu" -eq 1 ] && p2p_s=$((left - 30)); [ "$p2p_s" -gt 60 ] && p2p_s=60
if [ "$p2p_s" -lt 30 ]; then
  say "no bench: only ${left}s left of the 5 minutes"
  bench_rc=1
else
  say "bench: bench/gpu_p2p.py (at most ${p2p_s} s)"
  timeout "$p2p_s" "$PY" bench/gpu_p2p.py --timeout "$((p2p_s - 5))" ${OUT:+--out "$OUT"} 2>&1 | tee -a "$LOG"
  bench_rc=${PIPESTATUS[0]}
fi
# ---- cross-host GPU bench (rdma-gpu), on this one machine -------------------
xhost_rc=0
if [ "$have_rdma_gpu" -eq 1 ]; then
  left=$((295 - ($(date +%s) - t_start))); [ "$left" -lt 20 ] && left=20
  say "bench: varcomm_bench p2p --device cuda --transport rdma (at most ${left} s)"
  (cd "$ROOT/bench" && VARCOMM_FI_PROVIDER="${VARCOMM_FI_PROVIDER:-tcp;ofi_rxm}" timeout "$left" "$PY" -m varcomm_bench p2p \
     --device cuda --transport rdma --quick ${OUT:+--md "$OUT/p2p_cuda_rdma.md"}) 2>&1 | tail -25 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || xhost_rc=1
fi

say "took $(($(date +%s) - t_start)) s"
[ "$xhost_rc" -eq 0 ] || finish 1 "cross-host GPU (rdma-gpu) tests or bench failed"
[ "$test_rc" -eq 0 ] || finish 1 "GPU tests failed (pytest exit $test_rc)"
[ "$a2a_rc" -eq 0 ] || finish 1 "all-to-all bench failed (exit $a2a_rc)"
[ "$moe_rc" -eq 0 ] || finish 1 "moe bench failed (exit $moe_rc)"
[ "$bench_rc" -eq 0 ] || finish 1 "bench failed (exit $bench_rc)"
finish 0 "ok"
