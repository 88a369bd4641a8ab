# make demo: the main job (a local multi-rank run comparing varcomm with the fallback)
# make test: the whole suite (after make lint: ruff and mypy)
# Both set everything up on a fresh Debian machine and are quick once set up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0+cpu
DEPS := $(VENV)/.deps-ok
SO_STAMP := $(VENV)/.build-ok
SOURCES := $(shell find csrc transport -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py

.PHONY: all setup build lint test demo bench clean
all: build

$(DEPS): requirements-dev.txt scripts/setup-system.sh Makefile
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" -r requirements-dev.txt
	# mpi4py is the benchmarks' MPI baseline; it needs Open MPI's compiler wrapper.
	if command -v mpicc >/dev/null; then $(PY) -m pip install -q mpi4py || echo "mpi4py not installed: MPI baseline will be skipped"; fi
	touch $@

$(SO_STAMP): $(DEPS) $(SOURCES) bench/pyproject.toml
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
	$(PY) -m pip install -q --no-deps --no-build-isolation -e bench >/dev/null
	touch $@

setup: $(DEPS)
build: $(SO_STAMP)

# mypy keeps its cache in .venv/.mypy_cache (pyproject.toml): seconds once warm.
lint: $(DEPS)
	$(PY) -m ruff check python tests bench/varcomm_bench examples
	$(PY) -m mypy

test: build lint
	$(PY) -m pytest -q tests

# The main job, then a short run of the benchmark suite (bench/, package
# varcomm_bench: p2p, varlen, alltoall) with its baselines, writing
# build/demo.{png,json} (untracked: bench/results/demo.png is a recorded run).
demo: build
	$(PY) -m varcomm.run -n 2 --timeout 300 examples/demo.py
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(PY) -m varcomm_bench all --quick -c \
		--plot build/demo.png --json build/demo.json

# The recorded point-to-point sweep: bench/results/p2p-<date>.{json,md}.
bench: build
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $(PY) -m varcomm_bench p2p --save bench/results

clean:
	rm -rf build python/varcomm/_C*.so python/varcomm/_torch_hooks*.so $(SO_STAMP)
