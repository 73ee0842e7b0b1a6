#!/usr/bin/env bash
# The SGLang tier: SGLang 0.5.23's own radix cache and ZMQ event publisher (CPU) record the
# golden traces again, and they must equal tests/fixtures/sglang-0.5.23, which the main suite
# checks kvindex against (tests/test_sglang_golden.py). SGLang lives in a venv of its own
# outside the checkout, built once and reused while its requirements stay the same; kvindex
# is not installed into it (the project never depends on SGLang, nor SGLang on kvindex).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVINDEX_SGLANG_VENV:-$HOME/.cache/kvindex/sglang-0.5.23-venv}
REQS=tests/sglang_tier/requirements.txt
deps=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$VENV/.tier-deps" 2>/dev/null)" != "$deps" ]; then
    echo "== SGLang tier: building $VENV (minutes the first time)"
    python3 -m venv "$VENV"
    # torch lies on this machine's disk as a CPU build; an exact pin, since a range would
    # pull a CUDA build of gigabytes. SGLang's own requirements name CUDA packages: what its
    # cache and publisher import on the CPU is pinned in $REQS, installed without dependencies.
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q --no-deps sglang==0.5.23
    "$VENV/bin/pip" install -q --no-deps -r "$REQS"
    echo "$deps" >"$VENV/.tier-deps"
fi
echo "== SGLang tier: tests/sglang_tier with SGLang 0.5.23 (CPU)"
exec "$VENV/bin/python" -m pytest -c tests/sglang_tier/pytest.ini tests/sglang_tier -q
