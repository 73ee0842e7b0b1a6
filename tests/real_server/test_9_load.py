"""``route: "best"`` reads a real vLLM server's load from its ``/metrics``: the report
kvindex weighed is fresh, and counts the requests the server is running."""

from __future__ import annotations

import threading
import time

from indexer.core.load import LoadRules
from tests.real_server.conftest import TOKEN
from tests.real_server.harness import MODEL, Vllm, completion_prompts


def _route(kv, engine: str, prompt: str) -> dict:
    body = {"prompt": prompt, "model": MODEL, "engines": [engine], "route": "best"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return kv.http.post("/prefix-match", json=body, headers=headers).raise_for_status().json()


def test_the_pick_weighs_the_load_vllm_reports(kv, announced_b) -> None:
    """On engine B, whose lease (300 s) outlasts a renewal delayed while generations take
    both cores: A's 6 s lease lapsed there once, and the engine was unknown (404)."""
    name = announced_b.name
    prompt = completion_prompts(90, 1)[0]
    _route(kv, name, prompt)  # the first pick starts the scraper
    deadline = time.monotonic() + 10
    while (cost := _route(kv, name, prompt)["route_costs"][0])["load_age_ms"] is None:
        assert time.monotonic() < deadline, cost
        time.sleep(0.1)
    assert cost["engine"] == name and cost["load_age_ms"] < 2000, cost
    assert 0 <= cost["fullness"] <= 1, cost

    # generations keep the server busy until the pick has seen them in the server's own
    # count (its /metrics may answer a second late while the engine takes both cores)
    done = threading.Event()

    def generate(i: int) -> None:
        vllm = Vllm(announced_b.url)
        while not done.is_set():
            vllm.send({"prompt": f"load {i} " * 8, "ignore_eos": True}, max_tokens=1900)

    busy = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for thread in busy:
        thread.start()
    try:
        seen = 0.0
        deadline = time.monotonic() + 60
        while seen < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            cost = _route(kv, name, prompt)["route_costs"][0]
            seen = (cost["running"] or 0) + (cost["waiting"] or 0)
        assert seen >= 1, cost
        assert cost["requests_ahead"] >= seen, cost
        assert cost["cost"] >= LoadRules().per_request * seen, cost  # the default weights
    finally:
        done.set()
        for thread in busy:
            thread.join()
