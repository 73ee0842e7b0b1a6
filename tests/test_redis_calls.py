"""How many apply-script calls a batch costs: calls cost Redis more than the operations
in them, so a cluster batch should take one per master, not one per bucket."""

from __future__ import annotations

from indexer.stores.conformance import RANK, apply, counts
from indexer.stores.conformance.kit import removed, stored
from indexer.stores.redis import RedisStore
from indexer.stores.redis.layout import BUCKETS
from indexer.stores.redis.plan import OPS_PER_CALL, script_calls
from indexer.stores.redis.scripts import APPLY_OPS

from .conftest import redis_config
from .servers import LocalCluster


def test_calls_group_buckets_by_server_within_the_size_cap() -> None:
    sizes = {0: 10, 1: 20, 5: OPS_PER_CALL - 15, 7: 30, 9: 1}
    assert script_calls(sizes, None) == [[0, 1], [5], [7, 9]]
    servers = ["a", "a", "b", "b", "b", "a", "b", "b", "a", "b"]
    assert script_calls(sizes, servers) == [[0, 1], [5], [7, 9]]
    servers = ["a", "b", "a", "b", "a", "b", "a", "b", "a", "b"]  # 0 alone on a
    assert script_calls(sizes, servers) == [[0], [1], [5], [7, 9]]


async def test_a_cluster_batch_is_one_apply_call_per_master(redis_cluster: LocalCluster) -> None:
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    sent: list[tuple] = []
    execute = store.client.execute

    async def recording(commands):
        sent.extend(commands)
        return await execute(commands)

    store.client.execute = recording
    hashes = list(range(1000, 1000 + 4 * BUCKETS))  # every bucket, on every master
    try:
        assert await apply(store, 0, stored(hashes))
        assert await apply(store, 1, removed(hashes[::2]), stored(hashes[:3]))
        applies = [c for c in sent if c[:2] == ("EVALSHA", APPLY_OPS.sha)]
        assert len(applies) == 2 * len(redis_cluster.nodes)
        for i, h in enumerate(hashes):
            want = (i % 2) + (i < 3)
            assert await counts(store, h, RANK) == ({"GPU": want} if want else {}), h
    finally:
        await store.close()
