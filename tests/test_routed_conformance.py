"""Routed entries, every implementation: in process, a standalone redis-server, a
3-master Redis Cluster (one test id per check and backend)."""

from __future__ import annotations

import pytest

from indexer.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, RankId
from indexer.core.routed import RoutedRules, confirmations, deadlines, routed_run
from indexer.engines.vllm.wire import decode_batch, encode_batch
from indexer.routed import MemoryRouted, RedisRouted, conformance

from .conftest import redis_config, server_for

CHECKS = pytest.mark.parametrize("check", list(conformance.CHECKS))


@CHECKS
async def test_memory(check: str) -> None:
    await conformance.run_check(MemoryRouted, check)


@CHECKS
@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_redis(request: pytest.FixtureRequest, kind: str, check: str) -> None:
    config = redis_config(server_for(request, kind).url, cluster=kind == "cluster")
    await conformance.run_check(lambda: RedisRouted(config), check)


def test_ttl_bounds_name_the_field() -> None:
    rules = RoutedRules(default_ttl_ms=500, min_ttl_ms=100, max_ttl_ms=1000)
    assert rules.ttl(None) == 0.5 and rules.ttl(1000) == 1.0
    with pytest.raises(ValueError, match="ttl_ms 99 is outside"):
        rules.ttl(99)
    with pytest.raises(ValueError, match="min_ttl_ms <= default_ttl_ms"):
        RoutedRules(default_ttl_ms=50, min_ttl_ms=100)
    assert rules.bound(None) == rules.max_per_rank and rules.bound(64) == 64


def test_core_rules() -> None:
    assert routed_run([1, 2, 3, 4], 1, {2, 3}.__contains__) == 3
    assert routed_run([1, 2], 2, set().__contains__) == 2
    first, second = deadlines(10.0, 1.0, 2)
    assert first == 11.0 and first - second == pytest.approx(1e-6)
    batch = EventBatch(
        0.0,
        [BlockStored([1], medium="CPU"), BlockStored([2]), AllBlocksCleared(), BlockStored([3])],
    )
    assert confirmations(batch) == ([3], True)
    # as ingest decodes a batch: stores in the adapter's own lighter struct
    stored = EventBatch(0.0, [BlockStored([4, 5], block_size=16), BlockRemoved([4])])
    assert confirmations(decode_batch(encode_batch(stored), tokens=False)) == ([4, 5], False)


def test_rank_ids_round_trip_names_with_colons() -> None:
    from indexer.routed.redis import _rank_name, _rank_of

    rank = RankId("pool:a-1.x", 7)
    assert _rank_of(_rank_name(rank).encode()) == rank
