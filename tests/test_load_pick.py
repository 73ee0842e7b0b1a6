"""``route: "best"`` weighing each rank's prefix against its load: engines' ``/metrics``
served by a real HTTP server, read by the API's scraper, in the pick of every answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.core.load import (
    NEUTRAL,
    EngineLoad,
    LoadRules,
    Placement,
    cost,
    fullness,
    placement,
    queued_blocks,
)
from indexer.core.matching import PrefixMatch
from indexer.core.routed import Candidate, best
from indexer.engine_registry import EngineSpec
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.engines.vllm_metrics import read_load
from indexer.stores.base import apply_events

from .apikit import Api, engine

BLOCK = 16
PREFIX = list(range(1000, 1000 + 16 * BLOCK))  # 16 blocks every request shares
FAST = LoadRules(per_block=1.0, per_request=4.0, scrape_interval=0.05, stale_after=0.5)
#: one scrape at the start that stays fresh: every pick of a test stays pending
SLOW = LoadRules(
    per_block=1.0, per_request=4.0, scrape_interval=30, stale_after=60, pending_seconds=60
)


def page(running: float, waiting: float = 0, usage: float = 0.0, blocks: int = 0) -> str:
    """A vLLM /metrics page (its gauges as vLLM names and labels them)."""
    labels = 'engine="0",model_name="m"'
    return "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0',
            f"vllm:prefix_cache_hits_total{{{labels}}} 12.0",
            "",
        ]
    )


class Metrics:
    """A real HTTP server answering each engine's ``/ENGINE/metrics`` page (or 503)."""

    def __init__(self) -> None:
        self.pages: dict[str, str | None] = {}
        self.asked: dict[str, int] = {}  # requests by engine
        self.hung = threading.Event()  # an engine in ``hanging`` was asked
        self.release = threading.Event()  # ...and answers once this is set
        self.hanging: set[str] = set()
        pages, server = self.pages, self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.removesuffix("/metrics").strip("/")
                server.asked[name] = server.asked.get(name, 0) + 1
                if name in server.hanging:
                    server.hung.set()
                    server.release.wait()
                body = pages.get(name)
                self.send_response(503 if body is None else 200)
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    server = Metrics()
    yield server
    server.close()


def tokens(i: int) -> list[int]:
    return PREFIX + [50_000 + i] * BLOCK  # the shared prefix and a block of its own


def fresh(i: int) -> list[int]:
    return [60_000 + 17 * BLOCK * i + j for j in range(17 * BLOCK)]  # shares nothing


def short(i: int) -> list[int]:
    return [70_000 + BLOCK * i + j for j in range(BLOCK)]  # one block, shares nothing


async def fleet(metrics: Metrics, load: LoadRules, held_by: str | None = "e0") -> Api:
    """Three engines with a url each; ``held_by`` holds the shared prefix on GPU."""
    api = Api(ApiSettings(load=load))
    for name in ("e0", "e1", "e2"):
        await api.add(engine(name, model="m", url=f"{metrics.url}/{name}"))
        metrics.pages.setdefault(name, page(0))
    if held_by is not None:
        chain = block_hashes(HashSpec("sha256", None, BLOCK), PREFIX)
        await apply_events(api.store, RankId(held_by, 0), 1, EventBatch(1.0, [BlockStored(chain)]))
    return api


async def pick(api: Api, prompt: list[int]) -> dict:
    answer = await api.client.post("/prefix-match", json={"tokens": prompt, "route": "best"})
    assert answer.status_code == 200, answer.text
    return answer.json()


async def picks(api: Api, prompts: list[list[int]]) -> list[str]:
    return [(await pick(api, p))["routed_to"]["engine"] for p in prompts]


async def scraped(api: Api) -> None:
    """Every engine's report is in: the scraper, started as a pick starts it, has read
    each page once."""
    board = api.app.state.loads
    board.placements([])
    for _ in range(500):
        if all(board.report(RankId(name, 0)) for name in ("e0", "e1", "e2")):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engines' pages were not all read")


async def test_load_shifts_a_burst_away_from_a_busy_rank(metrics: Metrics) -> None:
    metrics.pages["e0"] = page(running=8, waiting=2)  # the rank holding the prefix is busy
    api = await fleet(metrics, SLOW)
    prefix_only = await fleet(metrics, LoadRules(enabled=False))
    try:
        await scraped(api)
        first = await pick(api, tokens(0))
        costs = {c["engine"]: c for c in first["route_costs"]}
        assert costs["e0"]["requests_ahead"] == 10 and costs["e0"]["running"] == 8
        assert costs["e0"]["cost"] == 1 + 4.0 * 10  # one block to compute, ten ahead
        assert costs["e1"]["cost"] == 17 and first["route_costs"][0]["engine"] == "e1"
        second = {c["engine"]: c for c in (await pick(api, tokens(1)))["route_costs"]}
        # e1's first pick waits there: its 16 shared blocks are the second prompt's own
        # routed run (scored at 0.8), its last block is queued work ahead of it
        assert (second["e1"]["pending"], second["e1"]["queued_blocks"]) == (1, 1)
        assert second["e1"]["cost"] == pytest.approx(17 - 16 * 0.8 + 4.0 * 1 + 1)
        assert second["e2"]["cost"] == 17
        burst = [first["routed_to"]["engine"], *await picks(api, [tokens(i) for i in range(2, 4)])]
        assert "e0" not in burst and {"e1", "e2"} <= set(burst), burst
        # the same burst by the prefix alone piles onto e0
        alone = await picks(prefix_only, [tokens(i) for i in range(4)])
        assert set(alone) == {"e0"}, alone
    finally:
        await api.close()
        await prefix_only.close()


async def test_stale_or_missing_load_falls_back_to_the_prefix(metrics: Metrics) -> None:
    metrics.pages["e0"] = page(running=30)
    api = await fleet(metrics, FAST)
    try:
        await scraped(api)
        assert (await pick(api, tokens(0)))["routed_to"]["engine"] != "e0"
        metrics.pages["e0"] = None  # e0's server stops answering: its report goes stale
        await asyncio.sleep(FAST.stale_after + 0.1)
        answer = await pick(api, tokens(1))
        assert answer["routed_to"]["engine"] == "e0", answer["route_costs"]
        row = answer["route_costs"][0]
        assert row["load_age_ms"] is None and row["running"] is None and row["pending"] == 0
        assert row["cost"] == 1  # the prefix alone: one block to compute
        scrapes = (await api.client.get("/metrics")).text
        assert 'kvindex_load_scrapes_total{outcome="failed"}' in scrapes
    finally:
        await api.close()


async def test_an_engine_that_answers_late_delays_no_others_report(metrics: Metrics) -> None:
    """e0's server takes its page's request and does not answer: e1 and e2 are read on
    their own meanwhile, every interval, and their picks weigh fresh reports."""
    metrics.hanging.add("e0")
    metrics.pages["e1"] = page(running=5)
    api = await fleet(metrics, LoadRules(scrape_interval=0.05, stale_after=60), held_by=None)
    try:
        await pick(api, short(0))  # starts the scraper
        await asyncio.to_thread(metrics.hung.wait, 60)
        since = metrics.asked.get("e1", 0)
        for _ in range(6000):
            if metrics.asked.get("e1", 0) >= since + 5:
                break
            await asyncio.sleep(0.01)
        assert metrics.asked["e1"] >= since + 5 and metrics.asked["e0"] == 1, metrics.asked
        costs = {c["engine"]: c for c in (await pick(api, short(1)))["route_costs"]}
        assert costs["e1"]["running"] == 5 and costs["e0"]["load_age_ms"] is None, costs
    finally:
        metrics.release.set()
        await api.close()


async def test_new_prefixes_spread_in_a_deterministic_order(metrics: Metrics) -> None:
    """Nothing held, no load anywhere: the first pick is the first engine by name; each
    pick is then pending on its rank, so new prompts go round the idle fleet (a tie of
    costs and scores goes to the first engine), the same way every time."""
    orders = []
    for _ in range(2):
        api = await fleet(metrics, SLOW, held_by=None)
        try:
            await scraped(api)
            orders.append(await picks(api, [fresh(i) for i in range(5)]))
        finally:
            await api.close()
    assert orders[0] == orders[1] == ["e0", "e1", "e2", "e0", "e1"], orders


async def test_the_queue_weighs_the_work_it_holds_not_its_requests(metrics: Metrics) -> None:
    """One long miss waiting on e0 outweighs a few one-block misses on the others: short
    prompts keep off e0 by work, where a count of requests sends one there."""
    shorts = [short(i) for i in range(6)]
    by_work = await fleet(metrics, SLOW, held_by=None)
    counting = LoadRules(per_block=0, per_request=1.0, scrape_interval=30, stale_after=60)
    by_count = await fleet(metrics, replace(counting, pending_seconds=60), held_by=None)
    try:
        for api in (by_work, by_count):
            await scraped(api)
            assert (await pick(api, fresh(0)))["routed_to"]["engine"] == "e0"
        work = await picks(by_work, shorts)
        assert "e0" not in work and {"e1", "e2"} == set(work), work
        assert "e0" in await picks(by_count, shorts)
    finally:
        await by_work.close()
        await by_count.close()


async def test_the_queue_is_the_blocks_routed_and_not_yet_stored(metrics: Metrics) -> None:
    """A long miss routed to e0 is queued work there until e0's events store its blocks;
    an engine without events has no queue: nothing it holds is ever stored."""
    rules = LoadRules(per_block=1.0, per_request=0, scrape_interval=30, stale_after=60)
    api = await fleet(metrics, rules, held_by=None)
    try:
        await scraped(api)
        assert (await pick(api, fresh(0)))["routed_to"]["engine"] == "e0"
        second = await pick(api, fresh(1))
        costs = {c["engine"]: c for c in second["route_costs"]}
        assert second["routed_to"]["engine"] == "e1" and costs["e0"]["queued_blocks"] == 17
        chain = block_hashes(HashSpec("sha256", None, BLOCK), fresh(0))
        await api.consumers.apply(RankId("e0", 0), 1, EventBatch(1.0, [BlockStored(chain)]))
        third = await pick(api, fresh(2))
        costs = {c["engine"]: c for c in third["route_costs"]}
        assert (costs["e0"]["queued_blocks"], costs["e1"]["queued_blocks"]) == (0, 17)
        assert third["routed_to"]["engine"] == "e0"  # e0's queue is gone: e0 and e2 tie
        url = f"{metrics.url}/e3"
        spec = EngineSpec("e3", model="m", events=False, gpu_blocks=64, block_size=BLOCK, url=url)
        await api.add(spec)
        assert await picks(api, [fresh(3), fresh(4)]) == ["e2", "e3"]
        last = await pick(api, fresh(5))  # e3 holds fresh(4)'s 17 routed blocks, unweighed
        assert last["routed_to"]["engine"] == "e3", last["route_costs"]
        assert (last["route_costs"][0]["queued_blocks"], last["route_costs"][0]["cost"]) == (17, 17)
    finally:
        await api.close()


def test_cost_and_best_follow_the_rules_written_in_the_docs() -> None:
    rules = LoadRules(per_block=1.0, per_request=4.0, pressure=0.5)
    full = placement(rules, EngineLoad(running=2, waiting=1, kv_usage=0.5), pending=1)
    assert (full.requests_ahead, full.pending, full.fullness, full.per_block) == (4, 1, 0.5, 1)
    assert cost(score=6, num_blocks=10, where=full, queued=7) == 4 * 1.25 + 4.0 * 4 + 7
    assert queued_blocks(live=12, own=5) == 7 and queued_blocks(live=3, own=3) == 0
    # nothing reported: the queue alone; no events: not even that; disabled: the prefix
    assert placement(rules, None, pending=0) == Placement(per_block=1.0)
    assert placement(rules, None, pending=0, events=False) == Placement()
    assert placement(LoadRules(enabled=False), EngineLoad(running=9), 3) == Placement()
    assert fullness(EngineLoad(kv_usage=0.1, capacity=100), resident=80) == 0.8
    assert fullness(EngineLoad(kv_usage=0.1), resident=80) == 0.1  # no capacity stated

    def candidate(name: str, gpu: int, where: Placement = NEUTRAL) -> Candidate:
        return Candidate(name, 0, PrefixMatch(gpu, prefix_blocks=gpu), 100, where)

    # equal cost: the better score; equal score too: fewer live entries, then the first
    a, b, c = candidate("a", 4), candidate("b", 0, Placement(load_cost=-4)), candidate("c", 4)
    assert best([(b, 0, 0, 0), (a, 4, 0, 0)], 8) is a
    assert best([(a, 4, 3, 0), (c, 4, 1, 0)], 8) is c
    assert best([(a, 4, 1, 0), (c, 4, 1, 0)], 8) is a
    assert best([], 8) is None
    # a queue weighs per_block a block: a's 3 queued outweigh c's poorer prefix
    queue = Placement(per_block=1.0)
    a, c = candidate("a", 4, queue), candidate("c", 2, queue)
    assert best([(a, 4, 3, 3), (c, 2, 0, 0)], 8) is c
    assert best([(a, 4, 3, 1), (c, 2, 0, 0)], 8) is a


def test_vllm_metrics_pages_are_read_per_rank_and_bad_pages_refused() -> None:
    two = page(3, 1, 0.25, 96) + page(0).replace('engine="0"', 'engine="1"')
    loads = read_load(two)
    assert loads[0] == EngineLoad(3, 1, 0.25, 96)
    assert loads[1] == EngineLoad(0, 0, 0.0, 0)
    for bad in ("", "not prometheus {{{", "process_cpu_seconds_total 3.0\n"):
        with pytest.raises(ValueError):
            read_load(bad)
