# kvindex: every command the README names. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TRACES := ../shared/fixtures/vllm-0.33.0/traces

.PHONY: help setup demo replay test lint bench

help:
	@echo "make demo    set up, then run the service with 4 simulated engines"
	@echo "make test    set up (Python deps, redis-server, docker-compose), then lint and run the tests"
	@echo "make replay  apply a vLLM fixture trace and print the JSON report"
	@echo "make bench   run every benchmark (quick mode); report in bench/results/"

# The compiled core builds at install time: a changed source reinstalls.
$(STAMP): pyproject.toml setup.py indexer/engines/vllm/_chainhash.pyx indexer/stores/memory/_holders.pyx
	@scripts/ensure-build-tools.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)
	@scripts/ensure-redis.sh
	@scripts/ensure-compose.sh
	@scripts/ensure-prometheus.sh
	@scripts/ensure-browser.sh

demo: setup
	scripts/demo.sh

replay: setup
	$(BIN)/kvindex replay $(TRACES)/chat-sha256.frames.msgpack \
		--probe $(TRACES)/chat-sha256.expected.json

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest -q

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

bench: setup $(BENCH_STAMP)
	$(BIN)/python -m bench --quick

