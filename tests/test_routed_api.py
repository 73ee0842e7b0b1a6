"""Routed entries through the HTTP API: the burst they exist for, their ends, event-less
engines and per-query weights (in process, and two API replicas on one Redis)."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

from api import ApiSettings
from indexer.core.events import AllBlocksCleared, BlockStored, EventBatch, RankId
from indexer.core.routed import RoutedRules
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.routed import RedisRouted
from indexer.stores.redis import RedisStore
from kvindex.wiring import api_app
from producer.publisher import Publisher

from .apikit import Api, FakeConsumers, LiveApi, engine
from .conftest import redis_config

ENGINES = [engine(f"e{i}", model="m") for i in range(4)]
BLOCK = 16
#: a new 4k-token prefix shared by the burst, each request with a suffix of its own
PREFIX = [random.Random(17).randrange(50_000) for _ in range(4096)]
PREFIX_BLOCKS = len(PREFIX) // BLOCK


def request_tokens(i: int) -> list[int]:
    return PREFIX + [60_000 + i] * (2 * BLOCK)


def chain_of(tokens: list[int]) -> list[int]:
    return block_hashes(HashSpec("sha256", None, BLOCK), tokens)


async def fleet(*apis: Api) -> None:
    for api in apis:
        for spec in ENGINES:
            await api.add(spec)


async def route_burst(clients: list, record: bool, rng: random.Random) -> list[str]:
    """A router faster than the engines' events: for each of 32 requests it asks every
    replica in turn, picks a best-scoring rank (ties at random, as routers balance) and,
    if ``record``, says so (``POST /routed``); no event arrives meanwhile."""
    picks = []
    for i in range(32):
        client = clients[i % len(clients)]
        answer = await client.post("/prefix-match", json={"tokens": request_tokens(i)})
        rows = answer.json()["engines"]
        top = max(r["score"] for r in rows)
        pick = rng.choice([r for r in rows if r["score"] == top])
        picks.append(pick["engine"])
        if record:
            body = {"engine": pick["engine"], "tokens": request_tokens(i)}
            assert (await client.post("/routed", json=body)).status_code == 200
    return picks


async def test_a_burst_follows_its_routed_entries_and_scatters_without() -> None:
    with_entries, without = Api(), Api()
    await fleet(with_entries, without)
    try:
        picks = await route_burst([with_entries.client], True, random.Random(1))
        assert len(set(picks)) == 1
        scattered = await route_burst([without.client], False, random.Random(1))
        assert len(set(scattered)) > 1
    finally:
        await with_entries.close()
        await without.close()


class Replica(Api):
    """An API replica over the shared Redis: its store and its routed entries."""

    def __init__(self, config) -> None:
        self.store, self.registry = RedisStore(config), EngineRegistry()
        self.consumers = FakeConsumers(self.store)
        self.routed = RedisRouted(config)
        self.app = api_app(
            self.store, self.registry, self.consumers, ApiSettings(), routed=self.routed
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://kvindex"
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.routed.close()
        await self.store.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_two_replicas_share_routed_entries(request: pytest.FixtureRequest, kind: str) -> None:
    server = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
    config = redis_config(server.url, cluster=kind == "cluster")
    replicas = [Replica(config), Replica(config)]
    await fleet(*replicas)
    try:
        clients = [r.client for r in replicas]
        picks = await route_burst(clients, True, random.Random(2))
        assert len(set(picks)) == 1
        # route=best: concurrent routers on both replicas, a new prefix, one atomic pick each
        body = {"tokens": [7] * 4096, "route": "best"}
        answers = await asyncio.gather(
            *(clients[i % 2].post("/prefix-match", json=body) for i in range(16))
        )
        # all tie at 0: the rank holding the fewest routed entries, first by name
        first_free = next(s.name for s in ENGINES if s.name != picks[0])
        assert {a.json()["routed_to"]["engine"] for a in answers} == {first_free}
        stats = (await clients[1].get("/stats")).json()["routed"]
        assert (
            stats["recorded"] == PREFIX_BLOCKS + 32 * 2 + 256 and stats["live"] == stats["recorded"]
        )
        # the exact counts in Redis are what (no) events said: routed entries live apart
        empty = {"GPU": 0, "CPU": 0, "STORAGE": 0}
        assert [await replicas[0].store.block_counts(RankId(s.name, 0)) for s in ENGINES] == [
            empty
        ] * len(ENGINES)
        rows = (await clients[0].post("/prefix-match", json={"tokens": request_tokens(0)})).json()
        assert {r["gpu_blocks"] for r in rows["engines"]} == {0}
        assert max(r["routed_blocks"] for r in rows["engines"]) == PREFIX_BLOCKS + 2
    finally:
        for r in replicas:
            await r.close()


async def test_events_confirm_and_exact_counts_never_move() -> None:
    api = Api()
    await fleet(api)
    try:
        tokens = request_tokens(0)
        chain = chain_of(tokens)
        r = await api.client.post("/routed", json={"engine": "e2", "tokens": tokens})
        assert r.json() == {
            "engine": "e2",
            "dp_rank": 0,
            "blocks": len(chain),
            "recorded": len(chain),
            "ttl_ms": 10_000,
        }
        rows = {
            row["engine"]: row
            for row in (await api.client.post("/prefix-match", json={"tokens": tokens})).json()[
                "engines"
            ]
        }
        e2 = rows["e2"]
        assert (e2["gpu_blocks"], e2["cpu_blocks"], e2["prefix_blocks"], e2["routed_blocks"]) == (
            0,
            0,
            0,
            len(chain),
        )
        assert e2["score"] == pytest.approx(0.8 * len(chain)) and not e2["approximate"]
        assert (await api.store.block_counts(RankId("e2", 0)))["GPU"] == 0
        assert (await api.client.get("/engines/e2")).json()["ranks"][0]["blocks"]["GPU"] == 0
        # the engine's events store the first half: confirmed, and exact from now on
        await api.consumers.apply(
            RankId("e2", 0), 0, EventBatch(1.0, [BlockStored(chain[:100], block_size=BLOCK)])
        )
        rows = (
            await api.client.post("/prefix-match", json={"tokens": tokens, "engines": ["e2"]})
        ).json()["engines"]
        assert (rows[0]["gpu_blocks"], rows[0]["routed_blocks"]) == (100, len(chain))
        assert rows[0]["score"] == pytest.approx(100 + 0.8 * (len(chain) - 100))
        stats = (await api.client.get("/stats")).json()["routed"]
        assert (stats["confirmed"], stats["live"]) == (100, len(chain) - 100)
        scraped = (await api.client.get("/metrics")).text  # every app of this process, summed
        confirmed = re.search(
            r'^kvindex_routed_entries_total\{outcome="confirmed"\} (\S+)$', scraped, re.M
        )
        assert confirmed is not None and float(confirmed[1]) >= 100
        assert re.search(r"^kvindex_routed_live_entries \S+$", scraped, re.M)
        # per-query weights; a GPU clear ends the rest
        w = {"tokens": tokens, "engines": ["e2"], "weights": {"routed": 0, "gpu": 2}}
        assert (await api.client.post("/prefix-match", json=w)).json()["engines"][0]["score"] == 200
        get = await api.client.get(
            "/prefix-match",
            params={
                "tokens": ",".join(map(str, tokens)),
                "engines": "e2",
                "weights": "gpu:0,routed:1",
            },
        )
        assert get.json()["engines"][0]["score"] == len(chain) - 100
        await api.consumers.apply(RankId("e2", 0), 1, EventBatch(2.0, [AllBlocksCleared()]))
        assert (await api.client.get("/stats")).json()["routed"]["cleared"] == len(chain) - 100
        # removal ends an engine's entries
        await api.client.post("/routed", json={"engine": "e3", "block_hashes": chain[:5]})
        assert (await api.client.delete("/engines/e3")).status_code == 200
        assert (await api.client.get("/stats")).json()["routed"]["live"] == 0
    finally:
        await api.close()


async def test_ttl_expiry_and_bad_input() -> None:
    api = Api(ApiSettings(routed=RoutedRules(min_ttl_ms=10, default_ttl_ms=1000, max_ttl_ms=5000)))
    await fleet(api)
    try:
        hashes = [1, 2, 3]
        assert (
            await api.client.post(
                "/routed", json={"engine": "e0", "block_hashes": hashes, "ttl_ms": 30}
            )
        ).status_code == 200
        rows = (
            await api.client.post("/prefix-match", json={"block_hashes": hashes, "engines": ["e0"]})
        ).json()["engines"]
        assert rows[0]["routed_blocks"] == 3
        await asyncio.sleep(0.08)
        rows = (
            await api.client.post("/prefix-match", json={"block_hashes": hashes, "engines": ["e0"]})
        ).json()["engines"]
        assert rows[0]["routed_blocks"] == 0
        assert (await api.client.get("/stats")).json()["routed"]["expired"] == 3
        bad = {
            "ttl_ms 6000 is outside": {"engine": "e0", "block_hashes": hashes, "ttl_ms": 6000},
            "unknown engine 'nope'": {"engine": "nope", "block_hashes": hashes},
            "dp_rank 1: engine 'e0' has 1": {"engine": "e0", "dp_rank": 1, "block_hashes": hashes},
            "model 'x'": {"engine": "e0", "model": "x", "block_hashes": hashes},
            "exactly one of": {"engine": "e0"},
            "unknown field `weights`": {"engine": "e0", "block_hashes": hashes, "weights": {}},
        }
        for message, body in bad.items():
            r = await api.client.post("/routed", json=body)
            assert r.status_code in (400, 404, 422) and message in r.json()["error"], (
                body,
                r.json(),
            )
        r = await api.client.post(
            "/prefix-match", json={"block_hashes": hashes, "weights": {"disk": 1}}
        )
        assert r.status_code == 422 and "disk" in r.json()["error"]
        r = await api.client.get("/prefix-match", params={"block_hashes": "1", "weights": "gpu:x"})
        assert r.status_code == 422 and "gpu" in r.json()["error"]
    finally:
        await api.close()


async def test_an_event_less_engine_is_routed_by_its_history() -> None:
    api = Api()
    spec = EngineSpec(name="silent", model="m", events=False, gpu_blocks=300, block_size=16)
    await api.add(spec)
    await fleet(api)
    try:
        first, second = request_tokens(0), [9] * 4096
        answer = (
            await api.client.post(
                "/prefix-match", json={"tokens": first, "route": "best", "engines": ["silent"]}
            )
        ).json()
        assert answer["routed_to"] == {"engine": "silent", "dp_rank": 0}
        rows = {
            r["engine"]: r
            for r in (await api.client.post("/prefix-match", json={"tokens": first})).json()[
                "engines"
            ]
        }
        assert rows["silent"]["approximate"] and not rows["silent"]["degraded"]
        assert (
            rows["silent"]["routed_blocks"] == PREFIX_BLOCKS + 2
            and rows["e0"]["approximate"] is False
        )
        assert answer_order(rows) == "silent"
        # an LRU of gpu_blocks: a second prompt of 256 blocks pushes most of the first out
        await api.client.post("/routed", json={"engine": "silent", "tokens": second})
        rows = {
            r["engine"]: r
            for r in (await api.client.post("/prefix-match", json={"tokens": first})).json()[
                "engines"
            ]
        }
        evicted = PREFIX_BLOCKS + 2 + 256 - 300
        # what ends first goes first: the older prompt, its tail before its prefix
        assert rows["silent"]["routed_blocks"] == PREFIX_BLOCKS + 2 - evicted
        stats = (await api.client.get("/stats")).json()["routed"]
        assert stats["live"] == 300 and stats["evicted"] == evicted
        with pytest.raises(ValueError, match="gpu_blocks"):
            EngineSpec(name="x", events=False)
        with pytest.raises(ValueError, match="endpoint"):
            EngineSpec(name="x")
    finally:
        await api.close()


def answer_order(rows: dict) -> str:
    return max(rows.values(), key=lambda r: r["score"])["engine"]


@pytest.mark.slow
async def test_live_events_confirm_and_a_restart_ends_routed_entries() -> None:
    """Through the real subscriber (batches as ingest decodes them): a store confirms,
    and the ingest layer's own clear (a restart: seq 0 again) ends the rest."""
    async with LiveApi() as live:
        (publisher,) = await live.add_published("r", model="m")
        spec = live.registry.get("r")
        publisher.publish(EventBatch(1.0, [BlockStored([1], block_size=BLOCK)]))
        publisher.publish(
            EventBatch(2.0, [BlockStored([2], parent_block_hash=1, block_size=BLOCK)])
        )
        await live.wait_applied("r", [1])
        await live.client.post("/routed", json={"engine": "r", "block_hashes": [1, 2, 3, 4]})
        publisher.publish(
            EventBatch(3.0, [BlockStored([3], parent_block_hash=2, block_size=BLOCK)])
        )
        await live.wait_applied("r", [2])

        async def confirmed() -> int:
            return (await live.client.get("/stats")).json()["routed"]["confirmed"]

        assert await confirmed() == 1
        publisher.close()
        restarted = Publisher(spec.endpoint, spec.replay_endpoint, data_parallel_rank=0, bind=True)
        live.publishers.append(restarted)

        async def restarted_engine_publishes() -> None:  # until its subscriber has joined
            ts = 4.0
            while live.subscriber.rank_status("r")[0].restarts == 0:
                restarted.publish(EventBatch(ts, [BlockStored([7 + int(ts)], block_size=BLOCK)]))
                ts += 1.0
                await asyncio.sleep(0.05)

        await asyncio.wait_for(restarted_engine_publishes(), 30)
        stats = (await live.client.get("/stats")).json()["routed"]
        assert (stats["confirmed"], stats["cleared"], stats["live"]) == (1, 3, 0)
