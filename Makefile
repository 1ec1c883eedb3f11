# draftstream: `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)

PYTEST_WORKERS ?=

.PHONY: help setup system-deps asyncapi-deps asyncapi demo test test-fast test-unit engines conformance fuzz lint bench bench-quick bench-scale chaos kafka-up kafka-down schemas clean

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	@touch $@

TOKENIZERS := .run/tokenizers/deepseek-v3-r1/tokenizer.json
$(TOKENIZERS): deploy/tokenizers/fetch.sh | $(VENV)/.installed
	@PYTHON=$(PY) bash deploy/tokenizers/fetch.sh

setup: $(VENV)/.installed $(TOKENIZERS) ## Create .venv with pinned dependencies; fetch the R1/V3 tokenizer

system-deps: ## Install Debian packages the tests use (prometheus, kcat, node, npm) when missing
	@bash deploy/system-deps.sh

# npm ci writes node_modules/.package-lock.json: reinstalled when the lock file changes.
ASYNCAPI_PARSER := deploy/asyncapi/node_modules/.package-lock.json
$(ASYNCAPI_PARSER): deploy/asyncapi/package-lock.json
	cd deploy/asyncapi && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error

asyncapi-deps: $(ASYNCAPI_PARSER) ## Install the pinned @asyncapi/parser (npm ci in deploy/asyncapi)

demo: setup ## Run the whole pipeline on embedded defaults: broker, simulator, every service
	$(BIN)/draftstream demo

test: setup system-deps asyncapi-deps engines ## Every test tier (unit in parallel, integration, e2e, conformance) on one Kafka 4.4 broker started here
	@PYTEST_WORKERS=$(PYTEST_WORKERS) bash deploy/run-tests.sh

test-fast: setup system-deps ## The inner loop: unit (in parallel) and integration tests, on a broker started here
	@PYTEST_WORKERS=$(PYTEST_WORKERS) bash deploy/run-tests.sh --fast

test-unit: setup ## Unit tests only (no broker), in parallel
	$(PY) -m pytest tests/unit -q -n $(or $(PYTEST_WORKERS),auto)

ENGINES := .run/engines/.installed
$(ENGINES): deploy/engines/requirements.txt deploy/engines/build.sh | $(VENV)/.installed
	@PYTHON=$(PY) ENGINES_DIR=.run/engines bash deploy/engines/build.sh

engines: $(ENGINES) ## Test-only env of the real engines (vLLM, SGLang wheels, hash-pinned, no torch) in .run/engines

conformance: setup engines ## The fidelity matrix alone, printing its tables (make test runs it too, without -s)
	$(PY) -m pytest tests/conformance -q -s -p no:cacheprovider

lint: setup ## ruff, mypy strict on schemas/ and services/, dashboard linter
	$(BIN)/ruff check schemas services tests bench
	$(BIN)/mypy
	@bash deploy/lint-dashboards.sh

bench: setup ## All benchmarks at full size against a broker started here (unless KAFKA_BOOTSTRAP_SERVERS); writes bench/results.json
	@bash deploy/run-bench.sh

bench-quick: setup ## Benchmarks at tiny sizes, same broker handling (.ci/run runs it after make test)
	@bash deploy/run-bench.sh --quick

bench-scale: setup ## The seeds' shape at BENCH_SCALE_PROMPTS (default 16,000), half and a quarter; not part of make test
	@BENCH_ENTRY=bench.bench_scale bash deploy/run-bench.sh

fuzz: setup engines ## Try to make reconstruct + audit accept wrong ids: >= 20,000 fuzzed answers, >= 20,000 tool-call answers through the real engines, fixed seed (FUZZ_SEED, FUZZ_ANSWERS, FUZZ_TOOL_ANSWERS)
	$(PY) -m pytest tests/fuzz -m fuzz -q -s -p no:cacheprovider

chaos: setup ## The longer crash soak
	$(PY) -m pytest tests/e2e -m chaos -q

kafka-up: ## Start the local Kafka broker
	@bash deploy/kafka/kafka.sh start

kafka-down: ## Stop the local Kafka broker
	@bash deploy/kafka/kafka.sh stop

schemas: setup ## Regenerate schemas/generated (JSON Schema, AsyncAPI) from the Structs and the topology
	$(BIN)/draftstream schemas export

asyncapi: schemas asyncapi-deps ## Validate schemas/generated/asyncapi.yaml with @asyncapi/parser
	node deploy/asyncapi/validate.mjs schemas/generated/asyncapi.yaml

clean: ## Remove the virtualenv and run state
	rm -rf $(VENV) .run
