#!/usr/bin/env bash
# The GPU check for the nvlink transport, on one machine with a GPU, in a few
# minutes: build, the GPU tests (2 ranks, which may share one GPU), the p2p bench;
# then the cross-host GPU block (rdma-gpu: tests/test_rdma_gpu.py and
# `varcomm_bench p2p --device cuda --transport rdma`, tcp;ofi_rxm on loopback).
#
#   bash bench/gpu_check.sh                 from anywhere in the repository
#   OUT=/some/dir bash bench/gpu_check.sh   also writes gpu_check.log, pytest.log,
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
say "tests: tests/test_gpu.py (2 ranks)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py >"$LOG.pytest" 2>&1
test_rc=$?
tail -30 "$LOG.pytest" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$LOG.pytest" "$OUT/pytest.log"; fi
# cupy is an optional extra: its test may skip (said in the log); any other skip fails the check.
if grep -q "SKIPPED.*cupy is not installed" "$LOG.pytest"; then say "the cupy test was skipped: cupy is not installed here"; fi
if [ "$test_rc" -eq 0 ] && grep "SKIPPED" "$LOG.pytest" | grep -qv "cupy is not installed"; then
  say "some GPU tests were skipped: failing the check"; test_rc=1
fi

# ---- bench ----------------------------------------------------------------
left=$((290 - ($(date +%s) - t_start)))
if [ "$left" -lt 45 ]; then
  say "no bench: only ${left}s left of the 5 minutes"
  bench_rc=1
else
  say "bench: bench/gpu_p2p.py (${left}s left)"
  timeout "$left" "$PY" bench/gpu_p2p.py --timeout "$((left - 5))" ${OUT:+--out "$OUT"} 2>&1 | tee -a "$LOG"
  bench_rc=${PIPESTATUS[0]}
fi
# ---- cross-host GPU tensors (rdma-gpu), on this one machine -------------------
# VARCOMM_TRANSPORT=rdma with the tcp provider (no NIC needed): real streams,
# pinned staging memory, cuStreamWaitValue64 on host-mapped flags.
xhost_rc=0
if "$PY" -c "import sys, varcomm; sys.exit(0 if 'rdma-gpu' in varcomm.build_info()['transports'] else 1)"; then
  say "cross-host GPU: tests/test_rdma_gpu.py (fake-driver and real-GPU tests, 2 ranks, route forced to rdma)"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_rdma_gpu.py >"$LOG.xhost" 2>&1
  xhost_rc=$?
  tail -15 "$LOG.xhost" | tee -a "$LOG"
  if [ -n "${OUT:-}" ]; then cp "$LOG.xhost" "$OUT/pytest_rdma_gpu.log"; fi
  if [ "$xhost_rc" -eq 0 ] && grep "SKIPPED" "$LOG.xhost" | grep -q "needs gpu"; then
    say "the real-GPU rdma tests were skipped: failing the check"; xhost_rc=1
  fi
  say "cross-host GPU bench: varcomm_bench p2p --device cuda --transport rdma"
  (cd "$ROOT/bench" && VARCOMM_FI_PROVIDER="${VARCOMM_FI_PROVIDER:-tcp;ofi_rxm}" timeout 240 "$PY" -m varcomm_bench p2p \
     --device cuda --transport rdma --quick ${OUT:+--md "$OUT/p2p_cuda_rdma.md"}) 2>&1 | tail -25 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || xhost_rc=1
else
  say "cross-host GPU: skipped: this build has no rdma-gpu (libfabric missing at build time, see above)"
fi

say "took $(($(date +%s) - t_start)) s"
[ "$xhost_rc" -eq 0 ] || finish 1 "cross-host GPU (rdma-gpu) tests or bench failed"
[ "$test_rc" -eq 0 ] || finish 1 "GPU tests failed (pytest exit $test_rc)"
[ "$bench_rc" -eq 0 ] || finish 1 "bench failed (exit $bench_rc)"
finish 0 "ok"
