# latentmill — one command sets up and runs the demo, one runs the tests.
#
#   make demo        create .venv, install the package, build the tiny models, run prep-then-train on the demo
#   make test        add the dev tools to .venv and run the test suite (make test-all: also the heavy tests;
#                    make test-unit: the unit tier alone)
#   make serve       local Prefect server and UI (http://127.0.0.1:4200) + process worker + deployments
#   make serve-stop  stop what `make serve` started
#   make gpu-check   on a GPU machine: doctor, demo, quick bench, FSDP2, LoRA and full runs, sample (--compile),
#                    the cache stage twice with equal bytes, all on CUDA -> gpu-check.json (docs/gpu-pods.md)
#
# torch: the pinned CPU build is installed first unless the venv already has a torch (install your
# own CUDA build into .venv before `make` on a GPU machine; see docs/training.md, "torch, CPU and GPU").

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PORT   ?= 4200
# A GPU pod's persistent volume (docs/gpu-pods.md): with LATENTMILL_VOLUME set, the demo's outputs and
# summary and `make serve`'s Prefect home go under it, and the CLI puts HF_HOME and the weight-hash store
# there too. Explicit settings win (PREFECT_HOME, PREFECT_HOME_DIR, HF_HOME, LATENTMILL_HASH_STORE).
LATENTMILL_VOLUME ?=
export LATENTMILL_VOLUME
DEMO_DIR := $(if $(LATENTMILL_VOLUME),$(LATENTMILL_VOLUME)/outputs/demo,outputs/demo)
PREFECT_HOME_DIR ?= $(or $(PREFECT_HOME),$(if $(LATENTMILL_VOLUME),$(LATENTMILL_VOLUME)/prefect,$(CURDIR)/.prefect))

.PHONY: venv dev demo test test-all test-unit lint serve serve-stop clean

# The demo needs the package alone; tests, lint and benchmarks add the dev tools (pytest, ruff, Dask, Ray...).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# The tests' Azure Blob server: Azurite, an npm package (node >= 10; 3.36 and later need node 21 or 22), in
# the venv's folder (tests/conftest.py azure_server runs $(VENV)/azurite/node_modules/.bin/azurite-blob).
AZURITE_VERSION := 3.35.0
$(VENV)/azurite/.installed-$(AZURITE_VERSION): | $(VENV)/.installed
	npm install --prefix $(VENV)/azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.installed-dev $(VENV)/azurite/.installed-$(AZURITE_VERSION)

demo: venv
	$(VENV)/bin/latentmill demo --summary-json $(DEMO_DIR)/summary.json

# make test runs one test per mechanism and leaves the tests marked heavy to make test-all: the wheel install,
# the gpu-check dry run, a second served start, memory measurements, and second variants of a path make test
# runs (Ray and Dask beside the process runner, 4 ranks beside 2, SIGTERM beside SIGKILL, and the learning,
# 2-rank and demo runs of the families beside those of FLUX.1 and Wan 2.1). It runs in TEST_WORKERS processes
# (pytest-xdist): under 10 minutes of pytest on the 2-core box.
TEST_WORKERS ?= 2
test: dev
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not heavy" --durations=25

test-all: dev
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

# The unit tier: no model folder built, no Prefect flow, no server, no launcher (tests/conftest.py fails a test
# of this tier that does one), in TEST_WORKERS processes: 51 s on the shared 2-core box (104 s in one process).
test-unit: dev
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow and not heavy and not served"

lint: dev
	$(VENV)/bin/ruff check .

serve: venv
	$(VENV)/bin/latentmill serve start --home $(PREFECT_HOME_DIR) --port $(PORT)

serve-stop:
	$(PY) -m latentmill.cli serve stop --home $(PREFECT_HOME_DIR)

clean:
	rm -rf outputs .prefect

# Benchmarks (bench/README.md): writes bench/results.json and bench/RESULTS.md; BENCH_ARGS=--quick for a smoke run
.PHONY: bench
bench: dev
	$(PY) -m bench.run $(BENCH_ARGS)

# One GPU, under 10 minutes (bench/README.md): every phase on CUDA, each in its own process; exit 1 on a failure.
# Its CPU dry run (python -m bench.gpu_check --dry-run) runs in `make test` (tests/test_gpu_check.py).
.PHONY: gpu-check
gpu-check: dev
	$(PY) -m bench.gpu_check --device cuda --out gpu-check.json
