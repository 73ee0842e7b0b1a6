"""``route: "best"`` reads a real vLLM server's load from its ``/metrics``: the report
kvindex weighed is fresh, and counts the requests the server is running."""

from __future__ import annotations

import threading
import time

import httpx

from indexer.core.load import LoadRules
from indexer.engines.vllm_metrics import read_load
from tests.real_server.conftest import TOKEN, tail
from tests.real_server.harness import MODEL, Vllm, completion_prompts

#: seconds each wait below may take: two generations hold both CPU cores meanwhile
WITHIN = 60


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


def _served(url: str) -> float:
    """Requests the server's own ``/metrics`` says it runs and holds waiting (-1: no
    answer within the wait)."""
    try:
        page = httpx.get(f"{url}/metrics", timeout=WITHIN).raise_for_status().text
    except httpx.HTTPError:
        return -1
    load = read_load(page)[0]
    return (load.running or 0) + (load.waiting or 0)


class Generations:
    """Requests that keep the server generating until stopped, counted as they end."""

    def __init__(self, url: str, threads: int) -> None:
        self.url, self.done, self.errors = url, threading.Event(), []
        self.finished = 0
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        vllm = Vllm(self.url)
        while not self.done.is_set():
            try:
                vllm.send({"prompt": f"load {i} " * 8, "ignore_eos": True}, max_tokens=1900)
                self.finished += 1
            except httpx.HTTPError as e:
                self.errors.append(repr(e))

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join()

    def __str__(self) -> str:
        return f"{self.finished} generations finished, errors: {self.errors[-3:]}"


def _scrapes(kv) -> str:
    """kvindex's count of load pages read and not."""
    page = kv.http.get("/metrics").text.splitlines()
    return "; ".join(line for line in page if line.startswith("kvindex_load_scrapes_total"))


def test_the_pick_weighs_the_load_vllm_reports(kv, serve, announced_a) -> None:
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
    busy = Generations(announced_a.url, threads=2)
    try:
        deadline = time.monotonic() + WITHIN
        while (served := _served(announced_a.url)) < 1:
            assert time.monotonic() < deadline, f"the server reports {served} requests; {busy}"
            time.sleep(0.1)
        seen = 0.0
        deadline = time.monotonic() + WITHIN
        while seen < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            if (answered := _busy_cost(kv, name, prompt)) is not None:
                cost = answered
                seen = (cost["running"] or 0) + (cost["waiting"] or 0)
        why = f"{cost}; the server reports {_served(announced_a.url)}; {busy}; {_scrapes(kv)}"
        assert seen >= 1, f"{why}\nkvindex's log:\n{tail(serve.log)}"
        assert cost["requests_ahead"] >= seen, cost
        assert cost["cost"] >= LoadRules().per_request * seen, cost  # the default weights
    finally:
        busy.stop()
