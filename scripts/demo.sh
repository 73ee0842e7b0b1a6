#!/usr/bin/env bash
# The README's first command (`make demo` sets up the venv, then runs this):
# kvindex serve with the embedded store, 4 simulated engines registered over
# the API, a router's view of them through real curl queries, then live
# progress until Ctrl-C. Ports: DEMO_HTTP_PORT (8080), DEMO_ZMQ_PORT (5557..).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${VENV:-.venv}/bin
API="http://127.0.0.1:${DEMO_HTTP_PORT:-8080}"
SIM=(--engines 4 --base-port "${DEMO_ZMQ_PORT:-5557}" --gpu-blocks 256 --cpu-chunks 256
     --storage-chunks 1024 --max-context 1024)
VIEW=("$BIN/python" scripts/demo_view.py)

[ -x "$BIN/kvindex" ] || { echo "no $BIN/kvindex: run 'make demo'" >&2; exit 1; }
work=$(mktemp -d)
pids=()
cleanup() {
    [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
    wait || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 0' INT TERM

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

fail() {
    echo "$*; logs:" >&2
    tail -n 20 "$work"/*.log >&2
    exit 1
}

# wait_for WHAT SECONDS COMMAND...: poll COMMAND until it succeeds.
wait_for() {
    local what=$1 deadline=$((SECONDS + $2)) pid
    shift 2
    until "$@" >/dev/null 2>&1; do
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null || fail "a demo process exited while waiting for $what"
        done
        ((SECONDS <= deadline)) || fail "timed out waiting for $what"
        sleep 0.2
    done
}

# ask TITLE TOKENS: one router query, shown as the curl command and its answer.
ask() {
    local n
    n=$(tr ',' '\n' <<<"$2" | wc -l)
    printf '\n%s\n$ curl -s "%s/prefix-match?tokens=%s,…"   # %d tokens\n' \
        "$1" "$API" "$(cut -d, -f1-6 <<<"$2")" "$n"
    curl -sf "$API/prefix-match?tokens=$2" | "${VIEW[@]}" table
}

served_by_all() {
    "$BIN/python" -c 'import json, sys; sys.exit(not all(json.load(open(sys.argv[1])).values()))' \
        "$work/served.json"
}

say "kvindex serve on $API, embedded store"
"$BIN/kvindex" --log-level INFO serve --port "${DEMO_HTTP_PORT:-8080}" >"$work/serve.log" 2>&1 &
pids+=($!)
wait_for "kvindex serve" 20 curl -sf "$API/readyz"
echo "ready"

say "4 simulated engines publishing vLLM KV events"
"$BIN/kvindex" sim "${SIM[@]}" --samples "$work/served.json" >"$work/sim.log" 2>"$work/sim-progress.log" &
pids+=($!)
wait_for "the simulated engines" 20 grep -q sim-3 "$work/sim.log"
cat "$work/sim.log"

say "register them: POST /engines"
"$BIN/kvindex" sim "${SIM[@]}" --print-specs | while read -r body; do
    echo "\$ curl -X POST $API/engines -d '$body'"
    curl -sf -X POST -H 'content-type: application/json' -d "$body" "$API/engines" >/dev/null
done

say "let them serve a few seconds of chat traffic"
wait_for "every engine to serve a request" 30 served_by_all
sleep 5

say "a router asks: which engine holds the longest prefix of this prompt?"
ask "The next turn of the conversation sim-0 served last (its history + a new message):" \
    "$("${VIEW[@]}" tokens "$work/served.json" sim-0 --extend 24)"
ask "The last prompt sim-2 served:" "$("${VIEW[@]}" tokens "$work/served.json" sim-2)"
ask "A prompt no engine has seen:" "$("${VIEW[@]}" random 300)"

say "serving on $API until Ctrl-C (try $API/docs, /engines, /stats, /metrics)"
"${VIEW[@]}" progress "$API"
