#!/usr/bin/env bash
# kvindex into an engine's venv as a user installs it (`pip install ".[vllm-plugin]"`, with
# its dependencies), again whenever this checkout's tracked files change; then fail if that
# changed any package the engine's vLLM requires (recorded beforehand in PINS by
# scripts/engine_pins.py). Shared by the vLLM tier and the real-server tier.
# Usage: scripts/install-into-engine-venv.sh VENV PINS TIER-NAME
set -euo pipefail
VENV=$1 PINS=$2 TIER=$3
# every tracked file's content (a working tree's edits and deletions included), and where it lies
own="$( (git ls-files -z | xargs -0 sha256sum 2>&1 || true) | sha256sum | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$VENV/.tier-kvindex" 2>/dev/null)" != "$own" ]; then
    echo "== $TIER: pip install \"$(pwd)[vllm-plugin]\" into $VENV"
    "$VENV/bin/pip" install -q "$(pwd)[vllm-plugin]"
    echo "$own" >"$VENV/.tier-kvindex"
fi
"$VENV/bin/python" scripts/engine_pins.py check "$PINS"
