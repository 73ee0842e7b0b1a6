"""The Redis store alone: configuration, key layout, connections, and the replay command.

The rules every store follows are checked in ``test_store_conformance.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from indexer.cluster.leases import Leases
from indexer.core.events import CPU, GPU, STORAGE
from indexer.core.snapshot import Snapshot, SnapshotTier
from indexer.stores import StoreUnavailable
from indexer.stores.base import Watermark, apply_snapshot
from indexer.stores.conformance import RANK, apply, counts
from indexer.stores.redis import RedisClient, RedisConfig, RedisStore
from indexer.stores.redis import plan as planning
from indexer.stores.redis.layout import BUCKETS

from .conftest import expected_path, redis_config, server_for, trace_path
from .events import stored
from .servers import LocalCluster, RedisServer, free_port


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chat-sha256", "hybrid-mamba"])
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_replay_command_reports_with_redis_what_it_does_in_memory(
    request: pytest.FixtureRequest, kind: str, name: str
) -> None:
    server = server_for(request, kind)

    def replay(*flags: str) -> dict:
        command = [sys.executable, "-m", "kvindex.cli", "replay", str(trace_path(name))]
        command += ["--probe", str(expected_path(name)), *flags]
        return json.loads(subprocess.run(command, capture_output=True, check=True).stdout)

    flags = ["--redis-url", server.url, "--redis-prefix", redis_config(server.url).prefix]
    flags += ["--redis-cluster"] if kind == "cluster" else []
    in_memory = replay()
    assert in_memory["probes"] and in_memory["blocks"]["GPU"] > 0
    assert replay(*flags) == in_memory
    assert replay(*flags) == in_memory  # a second replay into the same prefix starts afresh


def test_a_prefix_cannot_hold_a_hash_tag_or_a_glob() -> None:
    for prefix in ("", "a{b}", "idx*", "x[1]"):
        with pytest.raises(ValueError, match="prefix"):
            RedisConfig(prefix=prefix)


async def test_indexes_with_other_prefixes_share_a_server_independently(
    redis_server: RedisServer,
) -> None:
    stores = [RedisStore(redis_config(redis_server.url)) for _ in range(2)]
    try:
        for i, store in enumerate(stores):
            await apply(store, 0, stored([1, 2 + i]))
        await stores[0].forget(RANK)
        await stores[0].sweep()
        assert await stores[0].ranks() == []
        assert await stores[1].block_counts(RANK) == {GPU: 2, CPU: 0, STORAGE: 0}
        assert await counts(stores[1], 3) == {GPU: 1}
    finally:
        for store in stores:
            await store.close()


async def test_buckets_spread_evenly_over_the_cluster(redis_cluster: LocalCluster) -> None:
    """Masters own slot ranges; every one of them should get its share of buckets."""
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    try:
        await store.ping()  # learns the slot map
        owners = [store.client.redis.get_node_from_key(k).name for k in store.layout.bucket_keys]
    finally:
        await store.close()
    shares = sorted(owners.count(node) for node in set(owners))
    assert len(shares) == len(redis_cluster.nodes)
    assert shares[-1] - shares[0] <= 1


@pytest.mark.redis  # starts its own redis-server
@pytest.mark.parametrize("via", ["acl-user", "unix-socket"])
async def test_urls_with_an_acl_user_or_a_unix_socket(tmp_path, via: str) -> None:
    socket = tmp_path / "redis.sock"
    acl = ("--user", "indexer", "on", ">s3cret", "~*", "&*", "+@all", "--user", "default", "off")
    extra = acl if via == "acl-user" else ("--unixsocket", str(socket), "--unixsocketperm", "700")
    auth = ("indexer", "s3cret") if via == "acl-user" else None
    server = RedisServer(tmp_path / "redis", free_port(), extra, auth).start()
    url = server.url if via == "acl-user" else f"unix://{socket}?db=0"
    bad_url = url.replace("s3cret", "badpass")
    stores = [RedisStore(redis_config(url)), RedisStore(redis_config(bad_url))]
    try:
        await apply(stores[0], 0, stored([1]))
        assert await counts(stores[0], 1) == {GPU: 1}
        if via == "acl-user":
            with pytest.raises(StoreUnavailable) as refused:
                await stores[1].ping()
            assert "badpass" not in str(refused.value)  # no password in messages
    finally:
        for store in stores:
            await store.close()
        server.stop()


async def test_the_gateway_loads_scripts_again_when_redis_lost_them(
    redis_server: RedisServer,
) -> None:
    """One gateway serves the store and the cluster layer: after ``SCRIPT FLUSH`` (what
    a Redis restart does) the next store write and lease renewal still go through."""
    store = RedisStore(redis_config(redis_server.url))
    leases = Leases(store.client, "w", ttl=30.0)
    try:
        assert await apply(store, 0, stored([1]))
        assert await leases.acquire([RANK]) == [RANK]
        await store.client.execute([("SCRIPT", "FLUSH")])
        assert await apply(store, 1, stored([2]))
        await store.client.execute([("SCRIPT", "FLUSH")])
        assert await leases.renew() == ([RANK], [])
        assert await counts(store, 2) == {GPU: 1}
    finally:
        await store.close()


async def test_the_gateway_turns_an_unreachable_redis_into_store_unavailable() -> None:
    """Whoever asks (the store's reads, a lease): one error, naming where, not how to log in."""
    client = RedisClient(RedisConfig(f"redis://user:secret@127.0.0.1:{free_port()}/0", retries=0))
    try:
        for call in (client.execute([("PING",)]), Leases(client, "w", 1.0).acquire([RANK])):
            with pytest.raises(StoreUnavailable, match="unavailable") as raised:
                await call
            assert "secret" not in str(raised.value)
    finally:
        await client.close()


async def test_operator_reads_racing_the_writer_are_never_taken_for_a_loss(
    redis_server: RedisServer,
) -> None:
    """``/engines/{name}`` and the metrics read a rank's counts while its consumer
    writes. A read that fetched the metadata before a commit and returned after it
    once put the older metadata back in the writer's cache, and the writer's next
    batch took its own commit for lost data (a false loss, then a resync)."""
    store = RedisStore(redis_config(redis_server.url))
    try:
        for seq in range(200):
            reads = [asyncio.create_task(store.block_counts(RANK)) for _ in range(3)]
            await asyncio.sleep(0)  # the reads are on the wire before the write
            await apply(store, seq, stored([seq + 1]))
            await asyncio.gather(*reads)
        assert store.last_loss() is None
        assert (await store.watermark(RANK)).seq == 199
        assert await store.block_counts(RANK) == {GPU: 200, CPU: 0, STORAGE: 0}
    finally:
        await store.close()


def test_round_trips_take_whole_calls_up_to_the_bound() -> None:
    bound = planning.OPS_PER_TRIP
    assert planning.round_trips([10, 20]) == [range(0, 2)]
    trips = planning.round_trips([bound // 2, bound // 2, 1, bound * 3, 5])
    assert trips == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert planning.round_trips([]) == [range(0, 0)]


async def test_a_snapshot_of_a_million_blocks_is_written_in_bounded_round_trips(
    redis_server: RedisServer,
) -> None:
    """Sent as one pipeline, a million-block restore kept Redis busy for seconds before
    its last call was even read, past the socket timeout; each round trip now holds
    whole script calls of at most OPS_PER_TRIP operations."""
    store = RedisStore(RedisConfig(redis_server.url, prefix="trips", retries=0))
    trips: list[int] = []
    run = store._run

    async def recorded(commands):
        trips.append(len(commands))
        return await run(commands)

    store._run = recorded
    blocks = list(range(1, 1_000_001))
    snapshot = Snapshot(7, 3.0, [SnapshotTier(GPU, None, 0, None, blocks)])
    try:
        await apply_snapshot(store, RANK, snapshot)
        store._run = run
        assert (await store.block_counts(RANK))[GPU] == len(blocks)
        assert await store.watermark(RANK) == Watermark(7, 3.0)
        assert await counts(store, blocks[-1]) == {GPU: 1}
    finally:
        await store.close()
    per_call = len(blocks) // BUCKETS  # one script call per bucket: hashes spread evenly
    most = max(1, planning.OPS_PER_TRIP // per_call)
    assert most < BUCKETS and max(trips) <= most, trips  # in one trip: all BUCKETS calls
