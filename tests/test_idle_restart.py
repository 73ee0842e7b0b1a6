"""An engine restarted while idle: kvindex must drop the old process's cache when the new
one's publisher connects, not when it first publishes (routers would be sent to a cache
that is gone meanwhile), and ``route: "best"`` must not credit a rank it cannot vouch for."""

from __future__ import annotations

import asyncio
import time

import pytest

from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import RankStatus
from producer.publisher import Publisher

from .apikit import Api, LiveApi, engine

BLOCK = 16


@pytest.mark.slow
async def test_an_idle_engine_restarted_on_its_ports_is_seen_as_it_connects() -> None:
    """The probe sent when a publisher connects goes on a new DEALER: its empty answer
    from the last applied seq says the engine restarted. On the DEALER kept from before
    the restart (no peer: it never reconnects) the probe timed out, and the old cache
    stayed in the answers for a backed-off probe interval or more."""
    async with LiveApi() as live:
        (publisher,) = await live.add_published("r", model="m")
        spec = live.registry.get("r")
        publisher.publish(EventBatch(1.0, [BlockStored([1, 2, 3], block_size=BLOCK)]))
        await live.wait_applied("r", [0])
        rank = RankId("r", 0)
        assert (await live.store.block_counts(rank))["GPU"] == 3
        await asyncio.sleep(0.5)  # the probe of the first connection was answered
        publisher.close()
        restarted = Publisher(spec.endpoint, spec.replay_endpoint, data_parallel_rank=0, bind=True)
        live.publishers.append(restarted)
        started = time.monotonic()
        while (await live.store.block_counts(rank))["GPU"]:
            assert time.monotonic() - started < 5, live.subscriber.rank_status("r")
            await asyncio.sleep(0.05)
        assert live.subscriber.rank_status("r")[0].restarts == 1


async def test_the_pick_credits_no_prefix_to_a_degraded_rank() -> None:
    """A rank not connected (or with an unfilled gap) may answer the old process's cache:
    the pick weighs it as holding nothing, and its answer row still says what it holds."""
    api = Api()
    try:
        for name in ("a", "b"):
            await api.add(engine(name, model="m"))
        await api.consumers.apply(RankId("a", 0), 0, EventBatch(1.0, [BlockStored([11, 12])]))
        body = {"block_hashes": [11, 12], "route": "best"}
        assert (await api.client.post("/prefix-match", json=body)).json()["routed_to"] == {
            "engine": "a",
            "dp_rank": 0,
        }
        api.consumers.statuses["a"] = [RankStatus(dp_rank=0, connected=False)]
        answer = (await api.client.post("/prefix-match", json=body)).json()
        rows = {row["engine"]: row for row in answer["engines"]}
        assert rows["a"]["gpu_blocks"] == 2 and rows["a"]["degraded"]
        costs = {row["engine"]: row for row in answer["route_costs"]}
        assert costs["a"]["score"] == 0 and costs["a"]["cost"] >= costs["b"]["cost"]
    finally:
        await api.close()
