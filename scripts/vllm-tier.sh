#!/usr/bin/env bash
# The vLLM tier: kvindex's plugin inside one vLLM release's real code (CPU), tests/vllm_tier.
# Usage: scripts/vllm-tier.sh VERSION   (each supported release: 0.33.0, 0.34.0)
# Each release lives in a venv of its own outside the checkout, built once and reused while
# its requirements stay the same; kvindex is installed into it as a user does (`pip install
# ".[vllm-plugin]"`, with its dependencies) again whenever this checkout's tracked files
# change, and the tier fails if that install changed any package vLLM requires here: those
# of $REQS, torch and vllm (.ci/run runs this for every release after `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/vllm-tier.sh VERSION (one of: $(ls tests/vllm_tier/requirements | sed 's/\.txt$//' | tr '\n' ' '))}
REQS=tests/vllm_tier/requirements/$VERSION.txt
[ -f "$REQS" ] || { echo "vLLM $VERSION is not a tier release: no $REQS" >&2; exit 2; }
VENV=${KVINDEX_VLLM_VENV:-$HOME/.cache/kvindex/vllm-$VERSION-venv}
PINS=$VENV/.tier-engine-pins.json
deps=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$VENV/.tier-deps" 2>/dev/null)" != "$deps" ]; then
    echo "== vLLM tier: building $VENV (minutes the first time)"
    rm -f "$VENV/.tier-kvindex" "$PINS"
    python3 -m venv "$VENV"
    # torch lies on this machine's disk as a CPU build; an exact pin, since a range would
    # pull a CUDA build of gigabytes. vLLM's own requirements name CUDA packages: the
    # ones it imports on the CPU are pinned in $REQS, installed without their dependencies.
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q --no-deps "vllm==$VERSION"
    "$VENV/bin/pip" install -q --no-deps -r "$REQS"
    echo "$deps" >"$VENV/.tier-deps"
fi
# what vLLM requires here, before kvindex goes into its venv
[ -f "$PINS" ] ||
    "$VENV/bin/python" scripts/engine_pins.py record "$PINS" --requirements "$REQS" \
        --also torch vllm
scripts/install-into-engine-venv.sh "$VENV" "$PINS" "vLLM tier"
echo "== vLLM tier: tests/vllm_tier with vLLM $VERSION (CPU)"
exec "$VENV/bin/python" -m pytest -c tests/vllm_tier/pytest.ini tests/vllm_tier -q
