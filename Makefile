# kvgate developer entry points. `make help` lists them. CI (.ci/run) calls `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
CARGO_FEATURES_OFF := --no-default-features

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.deps: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); b = p['build-system']['requires']; d = p['project']; print('\n'.join(b + d['dependencies'] + [r for g in d['optional-dependencies'].values() for r in g]))" > $(VENV)/requirements.txt
	$(PY) -m pip install -q -r $(VENV)/requirements.txt
	touch $@

.PHONY: venv
venv: $(VENV)/.deps ## create .venv with every Python dependency

.PHONY: build
build: venv ## build the Rust extension (release) into .venv
	PIP_QUIET=1 $(VENV)/bin/maturin develop --release -q  # pip, run by maturin, lists every requirement otherwise

.PHONY: test-rust
test-rust: ## cargo tests of the pure-Rust core
	cargo test -p kvgate-core $(CARGO_FEATURES_OFF) -q

.PHONY: test-packages
test-packages: ## install the Debian packages the tests need when missing (cmake, ninja, g++, promtool, openssl, redis-server, chromium)
	bash scripts/install-test-packages.sh

.PHONY: llama-server
llama-server: test-packages ## build llama.cpp's llama-server for tests/realengine (cached under ~/.cache/kvgate)
	bash scripts/build-llama-server.sh

.PHONY: test-py
test-py: build test-packages llama-server ## pytest (unit, property, integration over loopback, real engine)
	$(PY) -m pytest tests -q

.PHONY: test
test: test-rust test-py ## every test: cargo test + pytest

.PHONY: lint
lint: build ## cargo fmt --check, clippy -D warnings, ruff, stubtest (_core.pyi vs the built module), mypy
	cargo fmt --all --check
	cargo clippy -p kvgate-core --all-targets -- -D warnings
	cargo clippy -p kvgate-core --all-targets $(CARGO_FEATURES_OFF) -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(PY) -m mypy.stubtest kvgate._core --allowlist .mypy-stubtest-allowlist
	$(PY) -m mypy python/kvgate

.PHONY: format
format: venv ## cargo fmt + ruff format
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

.PHONY: bench
bench: build llama-server ## every benchmark (~28 min): core + analyser, load, protection, memory, real engine, replicas on Redis, tenant count end to end, the garbage collector; rewrites benches/RESULTS.md and the plots
	$(PY) benches/core_results.py
	$(PY) benches/adaptive_results.py
	$(MAKE) --no-print-directory wrk
	$(PY) benches/load/run_load.py
	$(PY) benches/protection/run.py
	$(PY) benches/memory/run_memory.py
	$(MAKE) --no-print-directory bench-realengine
	$(MAKE) --no-print-directory bench-replicas
	$(MAKE) --no-print-directory bench-tenants
	$(MAKE) --no-print-directory bench-gc

.PHONY: bench-core
bench-core: build ## pytest-benchmark suites (core + analyser, ~1 min); rewrites their RESULTS.md sections
	$(PY) benches/core_results.py

.PHONY: bench-load
bench-load: build wrk ## load benchmark (wrk): kvgate vs bare aiohttp vs LiteLLM; writes benches/RESULTS.md
	$(PY) benches/load/run_load.py

.PHONY: bench-memory
bench-memory: build ## memory per open stream (1,000 streams, 1k and 8k tokens): kvgate vs bare aiohttp; writes benches/RESULTS.md
	$(PY) benches/memory/run_memory.py

.PHONY: bench-realengine
bench-realengine: build llama-server ## llama-server alone vs kvgate in front (burst TTFT, queues, disconnects; ~1 min); writes benches/RESULTS.md
	$(PY) benches/realengine/run.py

.PHONY: bench-replicas
bench-replicas: build wrk test-packages ## 3 replicas on one redis-server vs 1 gateway on its local store: throughput, Redis calls per admission, latency near a limit, kill -9 reclaim, store cost by tenant count (~4 min); writes benches/RESULTS.md
	$(PY) benches/replicas/run.py

.PHONY: bench-tenants
bench-tenants: build wrk test-packages ## a gateway of 10 tenants vs one of 100,000, keys drawn at random, local and Redis store: CPU per request, memory, /metrics, dashboard and /admin/state cost, config load (~2 min); writes benches/RESULTS.md
	$(PY) benches/tenants/run.py

.PHONY: bench-gc
bench-gc: build wrk test-packages ## the garbage collector's share of a request: Python's thresholds vs kvgate serve's, 10 and 100,000 tenants, local and Redis store (~3 min); writes benches/RESULTS.md
	$(PY) benches/tenants/gc_threshold.py --local

.PHONY: wrk
wrk: ## install wrk (Debian package) when it is missing
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk >/dev/null)

.PHONY: bench-protect
bench-protect: build ## protection scenario: engine alone vs kvgate; RESULTS.md + plots
	$(PY) benches/protection/run.py

.PHONY: demo
demo: build ## the main job: the same seeded traffic straight to the built-in engine simulator and through kvgate, side by side (~1.5 min)
	$(PY) -m kvgate demo
