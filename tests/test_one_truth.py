"""Every endpoint tells the same story about each rank: connected, degraded, and why.

Real ZMQ publishers, the real subscriber, a real redis-server that loses its
data under it. Four ranks, one per state an operator meets: live and exact,
never connected (nothing at its endpoint), degraded by a gap replay cannot
fill (no replay endpoint), and degraded by a store loss replay cannot undo
(the engine's buffer no longer reaches seq 0). ``/engines/{name}``,
``/engines``, ``/stats``, prefix-match and the metrics must agree on each.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from api import ApiSettings
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores import MemoryStore
from indexer.stores.redis import RedisStore
from kvindex.wiring import api_app
from producer.publisher import Publisher

from .conftest import free_ports, redis_config, trace_batches, wait_until
from .servers import RedisServer, free_port

pytestmark = pytest.mark.slow  # waits for a store loss to be noticed and settled

SETTINGS = SubscriberSettings(
    replay_timeout=0.5, probe_interval=0.2, stop_grace=2.0, no_publisher_after=0.3
)
BATCHES = trace_batches("chat-sha256")[:4]
#: (connected, degraded) by engine, and a word each of its degraded_reasons must contain.
EXPECTED = {
    "up": (True, False, None),
    "ghost": (False, True, "never connected"),
    "gappy": (True, True, "unfilled gaps"),
    "lost": (True, True, "store loss"),
}


@pytest.fixture
def volatile_redis(tmp_path: Path) -> RedisServer:
    """A private server, so FLUSHALL loses only this test's data."""
    server = RedisServer(tmp_path / "redis", free_port()).start()
    yield server
    server.stop()


class Fleet:
    def __init__(self, url: str) -> None:
        self.store = RedisStore(redis_config(url))
        self.registry = EngineRegistry()
        self.subscriber = Subscriber(self.store, self.registry, SETTINGS)
        app = api_app(self.store, self.registry, self.subscriber, ApiSettings())
        transport = httpx.ASGITransport(app=app)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://kvindex")
        self.publishers: list[Publisher] = []

    async def engine(self, name: str, replay: bool = True, **options) -> Publisher:
        pub, replay_port = free_ports(), free_ports()
        spec = EngineSpec(
            name,
            f"tcp://127.0.0.1:{pub}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if replay else None,
        )
        publisher = Publisher(spec.endpoint, spec.replay_endpoint, bind=True, **options)
        self.publishers.append(publisher)
        await self.registry.add(spec)
        await wait_until(lambda: self.status(name).connected, what=f"{name} connected")
        for batch in BATCHES:
            assert publisher.publish(batch)
        assert await asyncio.to_thread(publisher.flush)
        return publisher

    def status(self, name: str):
        return self.subscriber.rank_status(name)[0]

    async def get(self, path: str) -> dict | list:
        response = await self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
async def fleet(volatile_redis: RedisServer) -> AsyncIterator[Fleet]:
    fleet = Fleet(volatile_redis.url)
    await fleet.subscriber.start()
    yield fleet
    await fleet.client.aclose()
    await fleet.subscriber.stop()
    for publisher in fleet.publishers:
        publisher.close()
    await fleet.store.close()


def gauge(text: str, name: str, engine: str) -> float:
    labels = f'dp_rank="0",engine="{engine}"' if name.startswith("kvindex_ingest") else ""
    labels = labels or f'engine="{engine}"'
    (value,) = re.findall(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(value)


async def test_every_endpoint_agrees_on_each_rank(
    fleet: Fleet, volatile_redis: RedisServer
) -> None:
    last = len(BATCHES) - 1
    await fleet.engine("up")
    await fleet.engine("lost", buffer_steps=1)  # replay answers its last batch only
    for name in ("up", "lost"):
        await wait_until(lambda n=name: fleet.status(n).applied_seq == last, what=name)
    await fleet.store.client.execute([("FLUSHALL",)])  # the store forgets everything
    await wait_until(
        lambda: "could not apply" in (fleet.status("lost").store_loss or ""),
        what="the lost rank to give up its rebuild",
    )
    await wait_until(
        lambda: fleet.status("up").store_loss is None and fleet.status("up").applied_seq == last,
        what="the live rank to be rebuilt from replay",
    )
    await fleet.engine("gappy", replay=False, holes=[1])  # seq 1 never sent, nothing to ask
    await fleet.registry.add(EngineSpec("ghost", f"tcp://127.0.0.1:{free_ports()}"))
    await wait_until(lambda: fleet.status("gappy").degraded, what="the gap to be given up")
    await wait_until(lambda: fleet.status("ghost").never_connected, what="ghost reported")

    listed = {e["name"]: e for e in await fleet.get("/engines")}
    chain = ",".join(str(h) for h in BATCHES[0].events[0].block_hashes)
    matches = {
        e["engine"]: e for e in (await fleet.get(f"/prefix-match?block_hashes={chain}"))["engines"]
    }
    metrics = (await fleet.client.get("/metrics")).text
    for name, (connected, degraded, why) in EXPECTED.items():
        (rank,) = (await fleet.get(f"/engines/{name}"))["ranks"]
        assert (rank["connected"], rank["degraded"]) == (connected, degraded), name
        reasons = rank["degraded_reasons"]
        assert any(why in r for r in reasons) if why else reasons == [], (name, reasons)
        summary = listed[name]
        assert (summary["connected_ranks"], summary["degraded_ranks"]) == (connected, degraded)
        assert summary["registered_ranks"] == 1
        assert matches[name]["degraded"] == degraded, name
        assert gauge(metrics, "kvindex_ingest_connected", name) == connected, name
        assert gauge(metrics, "kvindex_ingest_degraded", name) == degraded, name
        assert gauge(metrics, "kvindex_engine_degraded_ranks", name) == degraded, name
    assert matches["up"]["gpu_blocks"] > 0  # rebuilt: it answers again
    assert matches["lost"]["prefix_blocks"] == 0  # under-reports until the engine restarts

    stats = await fleet.get("/stats")
    assert stats["engines"] == 4
    counts = {k: stats[k] for k in ("registered_ranks", "connected_ranks", "degraded_ranks")}
    assert counts == {"registered_ranks": 4, "connected_ranks": 3, "degraded_ranks": 3}
    assert stats["never_connected_ranks"] == 1
    assert stats["stored_ranks"] == 3  # ghost never applied anything: the store has no state


async def test_an_engine_without_events_is_degraded_nowhere() -> None:
    """Nothing to connect to is not a fault: an ``events: false`` engine's rank is
    judged healthy by every endpoint (its rows say ``approximate`` instead)."""
    registry, store = EngineRegistry(), MemoryStore()
    subscriber = Subscriber(store, registry, SETTINGS)
    await subscriber.start()
    app = api_app(store, registry, subscriber, ApiSettings())
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
            await registry.add(
                EngineSpec("routed-only", events=False, gpu_blocks=64, block_size=16)
            )
            (rank,) = (await client.get("/engines/routed-only")).json()["ranks"]
            assert (rank["events"], rank["degraded"], rank["degraded_reasons"]) == (
                False,
                False,
                [],
            )
            (listed,) = (await client.get("/engines")).json()
            assert listed["degraded_ranks"] == 0
            assert (await client.get("/stats")).json()["degraded_ranks"] == 0
            match = await client.post("/prefix-match", json={"block_hashes": [1, 2]})
            (row,) = match.json()["engines"]
            assert row["approximate"] and not row["degraded"]
    finally:
        await subscriber.stop()
