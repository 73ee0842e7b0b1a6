"""Findings an indexer worker publishes for API replicas (``{P:meta}:misdeclared``) when
Redis restarts empty under them: written again, and never lapsing meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from indexer.cluster.misdeclared_board import RedisMisdeclared
from indexer.cluster.redis_registry import RedisRegistry
from indexer.engine_registry import EngineSpec
from indexer.stores.redis import RedisStore

from .conftest import wait_until
from .servers import RedisServer
from .test_e2e import until
from .test_redis_loss import answered
from .test_store_conformance import redis_config

pytestmark = pytest.mark.slow  # a real Redis restarted empty


async def test_findings_redis_lost_are_written_again_and_kept_meanwhile(
    volatile_redis: RedisServer,
) -> None:
    """A block size a worker learned from an engine's events (registered without one)
    is learned once; Redis restarting empty loses it. The worker writes it again once
    its store notices; a replica that had read it keeps it meanwhile, and one that
    starts after reads it again."""
    config = redis_config(volatile_redis.url)
    worker_store, replica_store = RedisStore(config), RedisStore(config)
    try:
        registry = RedisRegistry(worker_store.client)
        spec = await registry.add(EngineSpec("e", "tcp://127.0.0.1:1", block_size=None))
        worker_store.watch()
        found = RedisMisdeclared(worker_store.client, registry)
        worker_store.on_loss(found.republish)
        found.publish(spec, {}, 16)
        replica = RedisMisdeclared(replica_store.client, registry)

        def reads(board: RedisMisdeclared) -> Callable[[], Awaitable[bool]]:
            async def sixteen() -> bool:
                await answered(board.refresh())
                return board.block_size(spec.name) == 16

            return sixteen

        await until(reads(replica), 10, "the replica to read the block size")
        await asyncio.to_thread(volatile_redis.restart)
        await wait_until(lambda: worker_store.last_loss() is not None, what="the loss noticed")
        assert await reads(replica)()  # kept, whatever Redis holds now
        await until(reads(RedisMisdeclared(replica_store.client, registry)), 10, "rewritten")
    finally:
        await worker_store.close()
        await replica_store.close()
