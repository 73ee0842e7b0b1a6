"""The Redis gateway's failure rule against a real Redis Cluster whose client resets itself.

redis-py's cluster client disconnects every connection, the other callers'
included, whenever it resets itself (a ClusterDown, a pipeline's retry, every
fifth MOVED): a command in flight on one of them fails as a ConnectionError,
or, when its connection was dropped between redis-py's checks, as a raw
AttributeError ("'NoneType' object has no attribute 'writelines'"). Both are
Redis being unavailable to the caller, so the gateway answers both as
:class:`StoreUnavailable`; an AttributeError of anyone else's stays a bug.
"""

from __future__ import annotations

import asyncio
import collections
import uuid

import pytest

from indexer.errors import StoreUnavailable
from indexer.stores.redis.client import RedisClient, dropped_transport
from indexer.stores.redis.config import RedisConfig

from .servers import LocalCluster


def _keys(count: int) -> list[str]:
    """Keys of this test alone, spread over the cluster's slots."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    return [f"{prefix}-k{i}" for i in range(count)]


async def test_a_fresh_cluster_client_serves_many_first_commands_at_once(
    redis_cluster: LocalCluster,
) -> None:
    """Sent before the client knew the slots, commands went to any node: their MOVED
    answers reset the client under the others (a third of them failed)."""
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(3):  # each a process that just started
        client = RedisClient(RedisConfig(redis_cluster.url, cluster=True, max_connections=16))

        async def first(key: str, client: RedisClient = client) -> None:
            try:
                outcomes[repr(await client.execute([("SET", key, "v")]))] += 1
            except StoreUnavailable as e:
                outcomes[f"unavailable: {e}"] += 1

        try:
            await asyncio.gather(*(first(key) for key in _keys(64)))
        finally:
            await client.close()
    assert outcomes == {"[True]": 3 * 64}


async def test_connections_dropped_under_commands_are_store_unavailable(
    redis_cluster: LocalCluster,
) -> None:
    """kvindex's promise, whatever redis-py raises inside (a ConnectionError, a
    TimeoutError, or a raw AttributeError from a transport torn down, depending on its
    release and on timing): every command whose connection is dropped under it fails
    as :class:`StoreUnavailable`, and the client recovers."""
    client = RedisClient(RedisConfig(redis_cluster.url, cluster=True, max_connections=8))
    keys = _keys(16)
    causes: collections.Counter[str] = collections.Counter()
    resetting = True

    async def caller(key: str) -> None:
        while resetting:
            try:
                await client.execute([("SET", key, "v")])
                causes["answered"] += 1
            except StoreUnavailable as e:  # anything else fails the test
                causes["unavailable"] += 1
                causes[type(e.__cause__).__name__] += 1

    callers = [asyncio.create_task(caller(key)) for key in keys]
    try:
        # the client resets itself, as redis-py does on a ClusterDown, until commands
        # have both failed under a reset and been answered between resets
        resets, deadline = 0, asyncio.get_running_loop().time() + 120
        while resets < 200 or not (causes["unavailable"] and causes["answered"]):
            assert asyncio.get_running_loop().time() < deadline, causes
            await asyncio.sleep(0.005)
            await client.redis.aclose()
            resets += 1
        resetting = False
        await asyncio.gather(*callers)
        assert await client.execute([("GET", keys[0])]) == [b"v"]  # and it recovers
    finally:
        resetting = False
        await asyncio.gather(*callers, return_exceptions=True)
        await client.close()


async def test_an_attribute_error_outside_redis_py_is_not_redis_down(
    redis_cluster: LocalCluster,
) -> None:
    client = RedisClient(RedisConfig(redis_cluster.url, cluster=True))
    writer = None
    try:
        with pytest.raises(AttributeError, match="writelines"), client.guard():
            writer.writelines([b"PING"])  # type: ignore[attr-defined]  # our bug, not Redis
        with pytest.raises(TypeError, match="len"):
            await client.execute(None)  # type: ignore[arg-type]  # a caller's bug
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("module", "dropped"), [("redis.asyncio.connection", True), ("indexer.stores.x", False)]
)
def test_a_raw_error_counts_as_a_dropped_transport_only_from_redis_pys_connection_code(
    module: str, dropped: bool
) -> None:
    """The same AttributeError a write on a torn-down connection raises, from a function
    whose module is redis-py's connection code, and from one that is not."""
    namespace = {"__name__": module}
    exec(compile("def write(writer): writer.writelines([b'PING'])", module, "exec"), namespace)
    with pytest.raises(AttributeError) as raised:
        namespace["write"](None)
    assert dropped_transport(raised.value) is dropped
