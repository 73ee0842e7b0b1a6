#!/usr/bin/env bash
# The SGLang server tier: a whole `python -m sglang.launch_server --device cpu` (SGLang 0.5.23,
# torch 2.13.0+cpu) publishing KV events to a real `kvindex serve`, checked against SGLang's
# own cached_tokens, /metrics and /server_info, turn by turn and rule by rule (tests/sglang_server). SGLang lives in a venv of its own outside the
# checkout, built once and reused while its requirements stay the same; kvindex runs with
# this checkout's Python ($PYTHON, else .venv/bin/python, else python3), not in SGLang's venv.
# The CPU build of sgl-kernel is not on PyPI: tests/sglang_server/shim stands in for it (see
# its docstring), and the tier fails if SGLang calls any of it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVINDEX_SGLANG_SERVER_VENV:-$HOME/.cache/kvindex/sglang-0.5.23-server-venv}
REQS=tests/sglang_server/requirements.txt
deps=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$VENV/.tier-deps" 2>/dev/null)" != "$deps" ]; then
    echo "== SGLang server tier: building $VENV (minutes the first time)"
    python3 -m venv "$VENV"
    # torch lies on this machine's disk as a CPU build; an exact pin, since sglang's own
    # torch==2.14.1 and a range would pull a CUDA build of gigabytes. SGLang's requirements
    # name CUDA packages: what its CPU server imports is pinned in $REQS, without dependencies.
    nice "$VENV/bin/pip" install -q torch==2.13.0
    nice "$VENV/bin/pip" install -q --no-deps sglang==0.5.23
    nice "$VENV/bin/pip" install -q --no-deps -r "$REQS"
    echo "$deps" >"$VENV/.tier-deps"
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
echo "== SGLang server tier: tests/sglang_server with SGLang 0.5.23 serving (CPU)"
export KVINDEX_SGLANG_SERVER_VENV=$VENV
exec nice "$PYTHON" -m pytest -c tests/sglang_server/pytest.ini tests/sglang_server \
    --basetemp="${TMPDIR:-/tmp}/kvindex-sglang-server-tier" "$@"
