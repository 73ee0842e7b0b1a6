#!/usr/bin/env bash
# The peer routers bench item 16 puts in front of a real vLLM fleet (vllm-router and smg:
# Rust binaries in PyPI wheels), in a venv of their own outside the checkout, built once and
# rebuilt only when the pinned versions change. Prints the venv's path on stdout; progress
# goes to stderr.
set -euo pipefail
VENV=${KVINDEX_ROUTERS_VENV:-$HOME/.cache/kvindex/routers-venv}
ROUTERS=(vllm-router==0.1.17 smg==1.13.0)
STAMP=$VENV/.routers-deps
deps=$(echo "${ROUTERS[*]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$deps" ]; then
    echo "== routers venv: building $VENV (${ROUTERS[*]})" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "${ROUTERS[@]}" >&2
    echo "$deps" >"$STAMP"
fi
echo "$VENV"
