# kvsidecar developer targets. Idempotent: `setup` re-runs only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-setup
SRC    := kvsidecar tests scripts

.PHONY: setup demo bench test format lint typecheck proto proto-check pytest serve bench bench-plan bench-backend clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# Without CUDA, take the local CPU build of torch first so nothing pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory setup lint typecheck proto-check pytest; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start ))s including setup (rc=$$rc)"; exit $$rc

lint: setup
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)

format: setup
	$(BIN)/ruff check --fix $(SRC)
	$(BIN)/ruff format $(SRC)

typecheck: setup
	$(BIN)/mypy

proto: setup
	$(BIN)/python scripts/gen_proto.py

proto-check: setup
	$(BIN)/pytest -q tests/test_proto_drift.py

pytest: setup
	$(BIN)/pytest -q

serve: setup
	$(BIN)/kvsidecar serve

demo: setup
	$(BIN)/kvsidecar demo

bench: setup
	$(BIN)/kvsidecar bench

bench-plan: setup
	$(BIN)/python -m kvsidecar.tools.bench_plan

bench-backend: setup
	$(BIN)/python -m kvsidecar.tools.bench_backend

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
