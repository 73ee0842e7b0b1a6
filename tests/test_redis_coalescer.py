"""Concurrent writers' commands share pipelines (coalescer.Coalescer), each writer keeping its own
replies, failures and cancellation; a cluster store's ranks share their bucket calls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from indexer.core.events import GPU, RankId
from indexer.stores import StoreUnavailable
from indexer.stores.conformance import apply, counts, stored
from indexer.stores.redis import RedisClient, RedisConfig, RedisStore
from indexer.stores.redis.coalescer import Coalescer
from indexer.stores.redis.scripts import APPLY_OPS

from .conftest import redis_config
from .servers import LocalCluster, RedisServer, free_port


class Sent:
    """A client's ``execute``, with every command list it was given."""

    def __init__(self, client: RedisClient) -> None:
        self.execute = client.execute
        self.pipelines: list[list[tuple]] = []

    async def __call__(self, commands: Sequence[tuple]) -> list:
        self.pipelines.append(list(commands))
        return await self.execute(commands)


async def test_writers_ready_together_share_one_pipeline_each_with_its_replies(
    redis_server: RedisServer,
) -> None:
    client = RedisClient(redis_config(redis_server.url))
    sent = Sent(client)
    shared = Coalescer(sent)
    try:
        keys = [f"{client.layout.prefix}:n{i}" for i in range(10)]
        replies = await asyncio.gather(
            *(shared.execute([("INCRBY", k, i), ("INCRBY", k, 1)]) for i, k in enumerate(keys))
        )
        assert replies == [[i, i + 1] for i in range(10)]
        assert [len(p) for p in sent.pipelines] == [20]
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("bound", "commands", "replies", "pipelines"),
    [
        # two commands a writer, four a pipeline: five writers take pipelines of 4, 4 and 2
        ({"most": 4}, lambda k: [("INCR", k), ("INCR", k)], [1, 2], [2, 4, 4]),
        # ~1 kB a writer: two fit in 2.5 kB, three do not
        ({"most_bytes": 2500}, lambda k: [("SET", k, b"x" * 1000)], [True], [1, 2, 2]),
    ],
    ids=["most", "most_bytes"],
)
async def test_a_shared_pipeline_holds_at_most_its_bound(
    redis_server: RedisServer,
    bound: dict[str, int],
    commands: Callable[[str], list[tuple]],
    replies: list,
    pipelines: list[int],
) -> None:
    client = RedisClient(redis_config(redis_server.url))
    sent = Sent(client)
    shared = Coalescer(sent, **bound)
    try:
        keys = [f"{client.layout.prefix}:n{i}" for i in range(5)]
        answers = await asyncio.gather(*(shared.execute(commands(k)) for k in keys))
        assert answers == [replies] * 5
        assert sorted(len(p) for p in sent.pipelines) == pipelines
    finally:
        await client.close()


async def test_a_failed_pipeline_fails_every_writer_in_it() -> None:
    config = RedisConfig(f"redis://127.0.0.1:{free_port()}/0", retries=0, connect_timeout=0.5)
    client = RedisClient(config)
    shared = Coalescer(client.execute)
    try:
        outcomes = await asyncio.gather(
            *(shared.execute([("PING",)]) for _ in range(3)), return_exceptions=True
        )
        assert [type(o) for o in outcomes] == [StoreUnavailable] * 3
    finally:
        await client.close()


async def test_a_cancelled_writer_leaves_the_others_their_replies(
    redis_server: RedisServer,
) -> None:
    client = RedisClient(redis_config(redis_server.url))
    shared = Coalescer(client.execute)
    try:
        keys = [f"{client.layout.prefix}:n{i}" for i in range(3)]
        writers = [asyncio.create_task(shared.execute([("INCR", k)])) for k in keys]
        await asyncio.sleep(0)  # every writer waits for the shared pipeline
        writers[1].cancel()
        assert await writers[0] == [1]
        assert await writers[2] == [1]
        with pytest.raises(asyncio.CancelledError):
            await writers[1]
    finally:
        await client.close()


async def test_a_cluster_stores_ranks_share_their_bucket_calls(
    redis_cluster: LocalCluster,
) -> None:
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    ranks = [RankId(f"engine-{i}", 0) for i in range(4)]
    try:
        for rank in ranks:  # each rank's ids and metadata, one rank at a time
            assert await apply(store, 0, stored(range(1, 65)), rank=rank)
        sent = Sent(store.client)
        store.client.execute = sent  # type: ignore[method-assign]
        together = (apply(store, 1, stored(range(65, 129)), rank=rank) for rank in ranks)
        assert await asyncio.gather(*together) == [True] * 4
        for rank in ranks:
            assert await counts(store, 1, rank) == {GPU: 1}
            assert await counts(store, 128, rank) == {GPU: 1}
        calls = [sum(c[1] == APPLY_OPS.sha for c in p) for p in sent.pipelines]
        assert max(calls) == 4 * 16  # every rank's call per bucket, in one pipeline
    finally:
        await store.close()
