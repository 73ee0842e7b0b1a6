"""kvindex reads the whole SGLang server's own ``/metrics``: its adapter parses the real
page (an idle server: nothing running or waiting), and ``route: "best"`` on an engine
registered by its URL weighs what SGLang reports: a generation running while it runs, and
nothing once it has ended."""

from __future__ import annotations

import threading

from indexer.core.load import LoadRules
from indexer.engines.sglang import metrics
from tests.sglang_server.kit import MODEL, PAGE, Kvindex, engine_by_url, eventually, text

BY_URL = "sgl-load"


def pick_cost(kv: Kvindex, prompt: str) -> dict:
    body = {"model": MODEL, "engines": [BY_URL], "prompt": prompt, "route": "best"}
    (cost, *_) = kv.post("/prefix-match", body).raise_for_status().json()["route_costs"]
    return cost


def idle(cost: dict) -> bool:
    """A fresh report of nothing running or waiting, and no KV in use (SGLang counts
    what its radix cache holds and could evict as free)."""
    load = (cost["running"], cost["waiting"], cost["fullness"])
    return cost["load_age_ms"] is not None and load == (0, 0, 0)


def busy(cost: dict) -> bool:
    """A report of a request running, and of KV in use: SGLang states its token usage
    to two decimals, which a long prompt in 16384 tokens shows."""
    return (cost["running"] or 0) >= 1 and cost["fullness"] > 0


def test_the_adapter_reads_the_idle_server_s_page(sglang) -> None:
    loads = eventually(
        lambda: metrics.read_load(sglang.metrics()),
        lambda loads: loads[0].running == loads[0].waiting == loads[0].kv_usage == 0,
        "an idle page",
    )
    assert list(loads) == [0], loads  # one rank: SGLang labels no dp_rank
    assert loads[0].capacity is None, loads  # its capacity, in tokens, is not read


def test_the_pick_weighs_the_load_sglang_reports(sglang, kv) -> None:
    prompt = text(3 * PAGE, 601)
    with engine_by_url(kv, sglang, BY_URL):
        eventually(lambda: pick_cost(kv, prompt), idle, "a fresh report of an idle server")

        # generations keep the server busy until the pick has seen one in SGLang's count
        # (it states its running requests every 40 decode steps), with its long prompt
        done = threading.Event()

        def generate() -> None:
            while not done.is_set():
                sglang.complete(text(200, 602), max_tokens=300, ignore_eos=True)

        generations = threading.Thread(target=generate)
        generations.start()
        try:
            cost = eventually(
                lambda: pick_cost(kv, prompt), busy, "SGLang's generation in the pick's report"
            )
            assert cost["load_age_ms"] < LoadRules().stale_after * 1000, cost
            assert cost["requests_ahead"] >= cost["running"] + cost["waiting"], cost
            assert cost["cost"] >= LoadRules().per_request * cost["running"], cost
            assert cost["fullness"] < 1, cost
        finally:
            done.set()
            generations.join()
        eventually(lambda: pick_cost(kv, prompt), idle, "SGLang reporting itself idle again")
