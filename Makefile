# kvindex: every command the README names. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TRACES := ../shared/fixtures/vllm-0.33.0/traces

LOCK   := locks/dev.txt

.PHONY: help setup demo replay test test-latest test-floors lint bench lock

help:
	@echo "make demo    set up, then run the service with 4 simulated engines"
	@echo "make test    set up (Python deps, redis-server, docker-compose), then lint and run the tests"
	@echo "make replay  apply a vLLM fixture trace, print the JSON report and whether vLLM's answers match"
	@echo "make bench   run every benchmark (quick mode); report in bench/results/"
	@echo "make lock         refresh locks/ to the newest releases pyproject.toml's ranges allow"
	@echo "make test-latest  run the tests on the newest releases (no lock), in a copy of the checkout"
	@echo "make test-floors  run the tests on the oldest releases pyproject.toml's ranges admit"

# The compiled core builds at install time: a changed source reinstalls. Every package comes
# from the lock, exact versions and hashes; kvindex itself builds with the lock's setuptools
# and Cython (no build isolation, which would fetch the newest).
$(STAMP): pyproject.toml setup.py $(LOCK) $(shell find indexer -name '*.pyx' -o -name '*.pxd')
	@echo "== [1/3] build tools for the compiled core (a C compiler, OpenSSL and xxhash headers)"
	@scripts/ensure-build-tools.sh $(PYTHON)
	@echo "== [2/3] $(VENV): a virtualenv with a current pip"
	$(PYTHON) -m venv $(VENV)
	@echo "== [3/3] $(LOCK), then kvindex, into $(VENV) (minutes the first time: pip's progress follows)"
	$(BIN)/pip install --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install --no-deps --no-build-isolation -e .
	$(BIN)/pip check
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
	@echo "make test skips the engine tiers (tests/vllm_tier: each supported vLLM release in its own venv); scripts/vllm-tier.sh VERSION runs one, and .ci/run runs them all"

bench: setup
	$(BIN)/python -m bench --quick

# The lock: what demo, test, bench and CI install (every extra but vllm-plugin, which goes into
# an engine's venv), and the Dockerfile's runtime subset at the same versions.
UV := uv pip compile --quiet --python-version 3.11 --universal --generate-hashes
lock:
	$(PYTHON) -m pip install -q "uv>=0.9"
	cd locks && $(UV) --upgrade ../pyproject.toml build.in --extra test --extra bench -o dev.txt
	cd locks && $(UV) --upgrade ../pyproject.toml build.in -c dev.txt -o service.txt

test-latest test-floors: setup
	PYTHON=$(PYTHON) scripts/test-unlocked.sh $(@:test-%=%)

