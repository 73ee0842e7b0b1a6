"""The metrics an operator asks for first, and their bound with many ranks.

The real subscriber consumes ranks whose endpoints have no publisher (the
cheapest ranks there are), the residency sample reads the real store, and
``/metrics`` is scraped through the app as Prometheus would.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from api import ApiSettings
from indexer import metrics
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber
from indexer.metrics import MetricsSettings
from indexer.stores import MemoryStore
from kvindex.wiring import api_app
from producer.publisher import Publisher

from .conftest import free_ports, wait_until
from .test_subscriber import FAST

RANKS = 5
BOUND = 2


@pytest.fixture
async def scrape() -> AsyncIterator:
    store, registry = MemoryStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, msgspec.structs.replace(FAST, no_publisher_after=0.2))
    app = api_app(store, registry, subscriber, ApiSettings())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvindex")
    await subscriber.start()
    await registry.add(EngineSpec("wide", f"tcp://127.0.0.1:{free_ports(RANKS)}", dp_ranks=RANKS))
    live = Publisher(f"tcp://127.0.0.1:{free_ports()}", bind=True)
    await registry.add(EngineSpec("live", live.endpoint))
    await wait_until(lambda: subscriber.rank_status("live")[0].connected, what="live connected")
    sampler = asyncio.create_task(
        metrics.sample_residency(store, MetricsSettings(rank_series=BOUND, sample_interval=0.05))
    )

    async def get(path: str = "/metrics") -> str:
        return (await client.get(path)).text

    yield get
    sampler.cancel()
    metrics.configure(MetricsSettings())  # the process's default again, for later tests
    await client.aclose()
    await subscriber.stop()
    live.close()


def series(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in the exposition text."""
    return {m[0]: float(m[1]) for m in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


async def test_rank_gauges_are_bounded_and_every_rank_is_in_the_engine_gauges(scrape) -> None:
    """Beyond the bound, per-rank series go to the ranks an operator looks at first."""
    for _ in range(200):  # the first sample: within sample_interval (0.05 s)
        text = await scrape()
        if series(text, "kvindex_rank_resident_blocks"):
            break
        await asyncio.sleep(0.02)
    ranks = set(series(text, "kvindex_ingest_connected"))
    assert len(ranks) == BOUND  # 6 ranks, 2 series: degraded ranks first, so 2 of wide's
    assert all('engine="wide"' in labels for labels in ranks)
    assert series(text, "kvindex_engine_connected_ranks")['engine="live"'] == 1
    resident = [k for k in series(text, "kvindex_rank_resident_blocks") if "wide" in k]
    assert len(resident) == BOUND * 3  # a series per tier of each reported rank
    assert series(text, "kvindex_engine_ranks")['engine="wide"'] == RANKS
    assert series(text, "kvindex_engine_degraded_ranks")['engine="wide"'] == RANKS  # no publisher
    assert series(text, "kvindex_engine_connected_ranks")['engine="wide"'] == 0
    tiers = series(text, "kvindex_engine_resident_blocks")
    assert {k for k in tiers if "wide" in k} == {
        f'engine="wide",tier="{t}"' for t in ("GPU", "CPU", "STORAGE")
    }
    assert "_created" not in text


async def test_prefix_match_hit_depth_is_observed_per_tier(scrape) -> None:
    before = series(await scrape(), "kvindex_prefix_match_hit_blocks_count")
    assert '"engines"' in await scrape("/prefix-match?block_hashes=1,2,3")
    after = series(await scrape(), "kvindex_prefix_match_hit_blocks_count")
    for tier in ("GPU", "CPU", "STORAGE", "any"):
        key = f'tier="{tier}"'
        assert after[key] == before.get(key, 0) + 1, tier
    assert series(await scrape(), "kvindex_prefix_match_hit_blocks_bucket")['le="0.0",tier="any"']
