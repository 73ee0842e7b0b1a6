"""``route: "best"`` reads a real vLLM server's load from its ``/metrics``: the report
kvindex weighed is fresh, and counts the requests the server is running."""

from __future__ import annotations

import threading
import time

import httpx

from indexer.core.load import LoadRules
from tests.real_server.conftest import TOKEN
from tests.real_server.harness import MODEL, Vllm, completion_prompts


def _route(kv, engine: str, prompt: str) -> dict:
    body = {"prompt": prompt, "model": MODEL, "engines": [engine], "route": "best"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return kv.http.post("/prefix-match", json=body, headers=headers).raise_for_status().json()


def _busy_cost(kv, engine: str, prompt: str) -> dict | None:
    """The pick's cost on the engine, or None while kvindex does not know it: engine A's
    6 s lease can lapse while two generations hold both cores and delay its renewals,
    until its plugin announces it again."""
    try:
        return _route(kv, engine, prompt)["route_costs"][0]
    except httpx.HTTPStatusError as e:
        if e.response.status_code != 404:
            raise
        return None


def test_the_pick_weighs_the_load_vllm_reports(kv, announced_a) -> None:
    name = announced_a.name
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
        vllm = Vllm(announced_a.url)
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
            if (answered := _busy_cost(kv, name, prompt)) is not None:
                cost = answered
                seen = (cost["running"] or 0) + (cost["waiting"] or 0)
        assert seen >= 1, cost
        assert cost["requests_ahead"] >= seen, cost
        assert cost["cost"] >= LoadRules().per_request * seen, cost  # the default weights
    finally:
        done.set()
        for thread in busy:
            thread.join()
