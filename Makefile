# latentmill — one command sets up and runs the demo, one runs the tests.
#
#   make demo        create .venv, install, build the tiny models, run prep-then-train on the demo data
#   make test        the whole test suite
#   make serve       local Prefect server and UI (http://127.0.0.1:4200) + process worker + deployments
#   make serve-stop  stop what `make serve` started
#
# torch: the pinned CPU build is installed first unless the venv already has a torch (install your
# own CUDA build into .venv before `make` on a GPU machine; see README).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PORT   ?= 4200
PREFECT_HOME_DIR ?= $(CURDIR)/.prefect

.PHONY: venv demo test lint serve serve-stop clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/latentmill demo --summary-json outputs/demo/summary.json

test: venv
	$(VENV)/bin/python -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .

serve: venv
	$(PY) -m pipelines.serve start --home $(PREFECT_HOME_DIR) --port $(PORT)

serve-stop:
	$(PY) -m pipelines.serve stop --home $(PREFECT_HOME_DIR)

clean:
	rm -rf outputs .prefect

# Benchmarks (bench/README.md): writes bench/results.json and bench/RESULTS.md; BENCH_ARGS=--quick for a smoke run
.PHONY: bench
bench: venv
	$(PY) -m bench.run $(BENCH_ARGS)
