# FairFL front door. `make run` runs the default experiment; `make test` runs the whole suite.
# Both set everything up first (virtualenv, pinned dependencies, Fashion-MNIST when it can be installed).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FMNIST_DIR := /usr/share/datasets/fashion-mnist
CONFIG ?= experiments/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: help setup dataset prometheus run run-inprocess monitor test test-unit test-integration bench results lint format protos clean

help:
	@echo "make run          run $(CONFIG) over gRPC (services and agents as local processes)"
	@echo "make monitor      make run, with a local Prometheus scraping every process (docs/observability.md)"
	@echo "make test         run the test suite (unit + integration)"
	@echo "make bench        run scripts/bench_*.py, write docs/benchmarks.md (BENCH_QUICK=1: smoke pass to runs/bench/)"
	@echo "make results      re-run every committed result into docs/results (hours; RESULTS_ONLY=name,... for some,"
	@echo "                  RESULTS_SINCE=COMMIT to re-run what ran before that commit; RESULTS_VERIFY=1: re-run one"
	@echo "                  committed run of each comparison and check its final model is bit-identical)"
	@echo "make lint         ruff check, format check and the import-linter layer contracts (pyproject.toml)"
	@echo "make protos       regenerate the gRPC stubs from protos/"
	@echo "make setup        create $(VENV) and install dependencies and the dataset"

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP) dataset prometheus

# Fashion-MNIST comes from Debian's dataset-fashion-mnist; installed when we are root, otherwise we say how.
dataset:
	@if [ -e $(FMNIST_DIR)/train-images-idx3-ubyte.gz ] || [ -e $(FMNIST_DIR)/train-images-idx3-ubyte ]; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package dataset-fashion-mnist"; \
		apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; \
	else \
		echo "note: Fashion-MNIST not found in $(FMNIST_DIR); install dataset-fashion-mnist (root) or set data.root"; \
	fi

# Prometheus and promtool come from Debian's prometheus package (without its recommends: no exporters); installed when we
# are root, otherwise the tests that need them are skipped and `make monitor` says how to get them.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian package prometheus"; \
		apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; \
	else \
		echo "note: prometheus/promtool not found; install Debian's prometheus (root) for make monitor and the rule tests"; \
	fi

run: setup
	$(VENV)/bin/fairfl run $(CONFIG)

run-inprocess: setup
	$(VENV)/bin/fairfl run $(CONFIG) --transport inprocess

monitor: setup
	$(VENV)/bin/fairfl run $(CONFIG) --monitor

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -q tests/integration $(PYTEST_ARGS)

# Benchmark scripts (not tests), each as its own process; BENCH_ONLY=round,wire runs some again, keeping the others;
# BENCH_ADD=gpu=gpu.json takes a section from a script's --json written on another machine (a GPU one) instead.
bench: setup
	$(PY) scripts/bench_report.py $(if $(BENCH_QUICK),--quick) $(if $(BENCH_ONLY),--only $(BENCH_ONLY)) \
		$(if $(BENCH_ADD),--add $(BENCH_ADD))

# Every committed comparison re-run from this commit into docs/results, resuming what an earlier call finished; then
# docs/results/claims.md indexes every claim held or not (scripts/results.py). Long: not part of `make test`.
results: setup
	$(PY) scripts/results.py $(if $(RESULTS_ONLY),--only $(RESULTS_ONLY)) $(if $(RESULTS_SINCE),--since $(RESULTS_SINCE)) \
		$(if $(RESULTS_VERIFY),--verify)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: $(STAMP)
	rm -f fairfl/v1/*_pb2*.py fairfl/v1/*_pb2*.pyi
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/fairfl/v1/*.proto

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .import_linter_cache *.egg-info
