#!/usr/bin/env bash
# The README's first command (`make demo` sets up the venv, then runs this):
# kvindex serve with the embedded store, 4 simulated engines (one of them SGLang) that register
# themselves (POST /engines/announce, renewed by lease), a router's view of them through real curl queries, the fleet as
# `kvindex status` prints it, then live progress until Ctrl-C.
# Ports: DEMO_HTTP_PORT (8080), DEMO_ZMQ_PORT (5557..).
# Every command shown after a "$" is the exact command that ran, with its output
# below it: copy one into another terminal while the demo runs.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN="$(realpath "${VENV:-.venv}")/bin"
API="http://127.0.0.1:${DEMO_HTTP_PORT:-8080}"
CHUNK=4  # blocks per CPU offload chunk
SIM=(--engines 4 --sglang 1 --base-port "${DEMO_ZMQ_PORT:-5557}" --gpu-blocks 256 --cpu-chunks 256
     --blocks-per-chunk "$CHUNK" --storage-chunks 1024 --max-context 1024)
VIEW=("$BIN/python" "$PWD/scripts/demo_view.py")

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

# run COMMAND: show it as typed, then run exactly that text.
run() {
    printf '$ %s\n' "$1"
    eval "$1"
}

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

# ask TITLE NAME TOKENS: one router query (the prompt's tokens in a file, as a
# long prompt is sent), its answer as a table.
ask() {
    local body="$work/$2.json"
    printf '{"tokens": [%s]}\n' "$3" >"$body"
    printf '\n%s (%d tokens in %s)\n' "$1" "$(tr ',' '\n' <<<"$3" | wc -l)" "$body"
    run "curl -s -X POST $API/prefix-match -H 'content-type: application/json' -d @$body | ${VIEW[*]} table"
}

served_by_all() {
    "$BIN/python" -c 'import json, sys; sys.exit(not all(json.load(open(sys.argv[1])).values()))' \
        "$work/served.json"
}

say "kvindex serve on $API, embedded store"
"$BIN/kvindex" serve --port "${DEMO_HTTP_PORT:-8080}" --log-level INFO >"$work/serve.log" 2>&1 &
pids+=($!)
wait_for "kvindex serve" 20 curl -sf "$API/readyz"
echo "ready (its log: $work/serve.log)"

say "4 simulated engines, 3 publishing vLLM's KV events and sim-3 SGLang's, announcing themselves"
echo "\$ $BIN/kvindex sim ${SIM[*]} --announce $API --lease 15 &"
"$BIN/kvindex" sim "${SIM[@]}" --announce "$API" --lease 15 --samples "$work/served.json" \
    >"$work/sim.log" 2>"$work/sim-progress.log" &
pids+=($!)
wait_for "the simulated engines" 20 grep -q "sim-3: PUB" "$work/sim.log"
cat "$work/sim.log"

say "registered by their announcements (no POST /engines): each has a lease it renews"
run "curl -s $API/engines/sim-0 | $BIN/python -c 'import json, sys; e = json.load(sys.stdin); print(e[\"name\"], e[\"endpoint\"], \"lease:\", e[\"lease\"], \"misdeclared:\", e[\"misdeclared\"])'"

say "let them serve a few seconds of chat traffic"
wait_for "every engine to serve a request" 30 served_by_all
sleep 5

say "a router asks: which engine holds the longest prefix of this prompt?"
ask "The next turn of the conversation sim-0 served last (its history + a new message)" \
    next-turn "$("${VIEW[@]}" tokens "$work/served.json" sim-0 --extend 24)"
echo "Why CPU can trail GPU: offload moves whole chunks of $CHUNK blocks, so CPU holds a prefix only in whole chunks."
ask "The last prompt sim-2 served" last-sim-2 "$("${VIEW[@]}" tokens "$work/served.json" sim-2)"
ask "The last prompt sim-3 (SGLang: its own page hashes, GPU only) served" last-sim-3 \
    "$("${VIEW[@]}" tokens "$work/served.json" sim-3)"
ask "A prompt no engine has seen" unseen "$("${VIEW[@]}" random 300)"

say "an engine that publishes no events (kvindex sim --no-events), routed by history alone"
echo "\$ $BIN/kvindex sim --engines 1 --prefix silent --no-events --announce $API --lease 15 &"
"$BIN/kvindex" sim --engines 1 --prefix silent --no-events --announce "$API" --lease 15 \
    >"$work/silent.log" 2>/dev/null &
pids+=($!)
wait_for "the event-less engine" 20 grep -q "silent-0: no events" "$work/silent.log"
cat "$work/silent.log"
unseen=$("${VIEW[@]}" random 300)
printf '{"tokens": [%s], "engines": ["silent-0"], "route": "best", "ttl_ms": 600000}\n' "$unseen" >"$work/route.json"
run "curl -s -o /dev/null -w 'route=best: %{http_code}\n' -X POST $API/prefix-match -H 'content-type: application/json' -d @$work/route.json"
ask "The same prompt, now routed to silent-0 (its rows: approximate)" routed "$unseen"

say "the fleet, as an operator sees it"
run "$BIN/kvindex status --url $API"

say "serving on $API until Ctrl-C: open $API/ui/ in a browser, or try /docs, /engines, /stats, /metrics"
"${VIEW[@]}" progress "$API"
