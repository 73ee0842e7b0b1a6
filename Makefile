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
	@echo "make replay  apply a vLLM fixture trace, print the JSON report and whether vLLM's answers match"
	@echo "make bench   run every benchmark (quick mode); report in bench/results/"

# The compiled core builds at install time: a changed source reinstalls.
$(STAMP): pyproject.toml setup.py $(shell find indexer -name '*.pyx' -o -name '*.pxd')
	@echo "== [1/3] build tools for the compiled core (a C compiler, OpenSSL and xxhash headers)"
	@scripts/ensure-build-tools.sh $(PYTHON)
	@echo "== [2/3] $(VENV): a virtualenv with a current pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "== [3/3] kvindex and its test tools into $(VENV) (minutes the first time: pip's progress follows)"
	$(BIN)/pip install -e '.[test]'
	touch $@

setup: $(STAMP)
	@scripts/ensure-redis.sh
	@scripts/ensure-compose.sh
	@scripts/ensure-prometheus.sh
	@scripts/ensure-browser.sh

# The demo needs only the venv (no Redis, Docker or browser).
demo: $(STAMP)
	scripts/demo.sh

replay: $(STAMP)
	$(BIN)/kvindex replay $(TRACES)/chat-sha256.frames.msgpack \
		--probe $(TRACES)/chat-sha256.expected.json

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest -q
	@echo "make test skips the vLLM tier (tests/vllm_tier: vLLM 0.33.0 in its own venv); scripts/vllm-tier.sh runs it, and so does .ci/run"

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

bench: setup $(BENCH_STAMP)
	$(BIN)/python -m bench --quick

