"""``kvindex api --mirror``: a replica answering from its own consumption of the engines.

As real processes over one redis-server: a ``kvindex indexer`` worker, an API
replica reading Redis and a mirror replica, three simulated engines publishing
over ZeroMQ. The mirror must give the answers the Redis replica gives, follow
the shared registry both ways, and share routed picks through Redis. Then, in
process, the mirror's view of an engine it has not started yet.
"""

from __future__ import annotations

import random
import uuid

import httpx
import pytest
from redis.asyncio import Redis

from indexer.cluster.mirror import Mirror
from indexer.cluster.redis_registry import RedisRegistry
from indexer.engine_registry import EngineSpec, UnknownEngine, is_degraded
from indexer.stores.redis import RedisConfig, RedisStore
from producer.simcli import Layout

from .conftest import free_ports
from .test_e2e import until
from .test_routed_scaleout import Engine, _all_up
from .test_scaleout import Process

pytestmark = pytest.mark.slow

ENGINES = 3


def prompts(seed: int, count: int) -> list[list[int]]:
    """Chats over two shared system prompts, each with its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(512)] for _ in range(2)]
    return [
        systems[i % 2] + [rng.randrange(1, 30_000) for _ in range(16 * (1 + i % 5))]
        for i in range(count)
    ]


async def answers(client: httpx.AsyncClient, queries: list[list[int]]) -> list[list[tuple]]:
    """Each query's rows, as (engine, gpu blocks, score), sorted by engine."""
    out = []
    for tokens in queries:
        reply = await client.post("/prefix-match", json={"tokens": tokens})
        assert reply.status_code == 200, reply.text
        rows = reply.json()["engines"]
        out.append(sorted((r["engine"], r["gpu_blocks"], r["score"]) for r in rows))
    return out


class Replicas:
    """One worker, a Redis-reading replica (``clients[0]``) and a mirror (``clients[1]``)."""

    def __init__(self, tmp, url: str) -> None:
        self.url, self.prefix = url, f"mirror-{uuid.uuid4().hex[:8]}"
        redis = ("--redis-url", url, "--redis-prefix", self.prefix)
        self.ports = [free_ports(), free_ports()]
        self.processes = [
            Process(tmp / "worker.log", "indexer", *redis, "--worker-id", "w1"),
            Process(tmp / "api.log", "api", *redis, "--port", str(self.ports[0])),
            Process(tmp / "mirror.log", "api", *redis, "--port", str(self.ports[1]), "--mirror"),
        ]
        self.clients = [
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=10) for p in self.ports
        ]

    async def up(self) -> bool:
        """Both replicas answer and the worker beats (a process stopped while it is still
        starting, before it handles SIGTERM, would not exit cleanly)."""
        redis = Redis.from_url(self.url)
        try:
            beating = await redis.zscore(f"{self.prefix}:workers", "w1") is not None
        finally:
            await redis.aclose()
        return beating and await _all_up(self.clients)

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()
        for process in self.processes:
            process.stop()


@pytest.fixture
async def replicas(redis_server, tmp_path):
    replicas = Replicas(tmp_path, redis_server.url)
    try:
        await until(replicas.up, 30, "both replicas and the worker")
        yield replicas
    finally:
        await replicas.close()


@pytest.fixture
def engines():
    layout = Layout(ENGINES, free_ports(2 * ENGINES))
    engines = {e.name: e for e in (Engine(layout, k) for k in range(ENGINES))}
    yield engines
    for e in engines.values():
        e.publisher.close()


async def test_a_mirror_answers_as_the_redis_replica_and_follows_the_registry(
    replicas, engines
) -> None:
    redis_api, mirror = replicas.clients
    for e in engines.values():  # registered through the mirror, consumed by the worker too
        assert (await mirror.post("/engines", json=e.spec)).status_code == 201

    async def all_connected() -> bool:
        stats = [(await c.get("/stats")).json() for c in replicas.clients]
        return all(s["connected_ranks"] == ENGINES for s in stats)

    await until(all_connected, 30, "the worker and the mirror to consume every engine")
    queries = prompts(7, 24)
    for i, tokens in enumerate(queries):
        engines[sorted(engines)[i % ENGINES]].submit(tokens)
    for e in engines.values():
        e.drain()

    async def agree() -> bool:
        seen = await answers(redis_api, queries)
        return seen == await answers(mirror, queries) and any(
            gpu for rows in seen for _, gpu, _ in rows
        )

    await until(agree, 30, "the mirror to answer as the Redis replica does")

    gone = sorted(engines)[0]
    assert (await redis_api.delete(f"/engines/{gone}")).status_code == 200

    async def forgotten() -> bool:
        rows = (await answers(mirror, queries[:1]))[0]
        listed = (await mirror.get(f"/engines/{gone}")).status_code
        return gone not in [engine for engine, _, _ in rows] and listed == 404

    await until(forgotten, 30, "the mirror to forget the engine removed through the other")


async def test_picks_recorded_on_a_mirror_are_shared_through_redis(replicas, engines) -> None:
    redis_api, mirror = replicas.clients
    for e in engines.values():
        assert (await redis_api.post("/engines", json=e.spec)).status_code == 201
    tokens = prompts(3, 1)[0]
    chosen = sorted(engines)[1]

    async def listed() -> bool:  # the mirror sees registry changes a poll later
        return (await mirror.get(f"/engines/{chosen}")).status_code == 200

    await until(listed, 10, "the mirror to see the engine registered through the other")
    body = {"engine": chosen, "tokens": tokens, "ttl_ms": 60_000}
    assert (await mirror.post("/routed", json=body)).status_code == 200
    rows = (await redis_api.post("/prefix-match", json={"tokens": tokens})).json()["engines"]
    row = next(r for r in rows if r["engine"] == chosen)
    assert row["routed_blocks"] == len(tokens) // 16


async def test_a_mirror_learns_tokens_a_redis_replica_cannot_hash(replicas, engines) -> None:
    """An engine declaring no hash algorithm: only a process applying its events learns
    which tokens its blocks hold, so the mirror matches it by tokens, the other cannot."""
    redis_api, mirror = replicas.clients
    secret = engines[sorted(engines)[0]]
    spec = {**secret.spec, "hash_algo": None, "hash_seed": None}
    assert (await mirror.post("/engines", json=spec)).status_code == 201

    async def connected() -> bool:
        return (await mirror.get("/stats")).json()["connected_ranks"] == 1

    await until(connected, 30, "the mirror to consume the engine")
    tokens = prompts(11, 1)[0]
    secret.submit(tokens)
    secret.drain()

    async def gpu_blocks(client: httpx.AsyncClient) -> int:
        rows = (await client.post("/prefix-match", json={"tokens": tokens})).json()["engines"]
        return next(r["gpu_blocks"] for r in rows if r["engine"] == spec["name"])

    async def learned() -> bool:
        return await gpu_blocks(mirror) == len(tokens) // 16

    await until(learned, 30, "the mirror to match the engine's prompt by tokens")

    async def in_redis() -> bool:  # the Redis replica sees the engine and its blocks
        reply = await redis_api.get(f"/engines/{spec['name']}")
        ranks = reply.json()["ranks"] if reply.status_code == 200 else []
        return sum(sum(rank["blocks"].values()) for rank in ranks) >= len(tokens) // 16

    await until(in_redis, 30, "the worker to apply the engine's blocks to Redis")
    assert await gpu_blocks(redis_api) == 0


def _spec(name: str, dp_ranks: int) -> EngineSpec:
    return EngineSpec(name, f"tcp://127.0.0.1:{free_ports(dp_ranks)}", "m", dp_ranks=dp_ranks)


async def test_an_engine_not_started_yet_is_degraded_and_a_changed_one_restarts(
    redis_server,
) -> None:
    config = RedisConfig(redis_server.url, prefix=f"mirror-{uuid.uuid4().hex[:8]}")
    store = RedisStore(config)
    registry = RedisRegistry(store.client)
    own = Mirror(registry)
    try:
        await own.start()
        await registry.add(_spec("a", 2))
        statuses = own.rank_status("a")  # registered, not synced: blank, not connected
        assert [s.dp_rank for s in statuses] == [0, 1]
        assert all(is_degraded(s) and not s.connected for s in statuses)
        await own.sync()
        assert len(own.rank_status("a")) == 2
        await registry.remove("a")
        await registry.add(_spec("a", 1))
        await own.sync()  # the entry changed: consumed again, from the new spec
        assert [s.dp_rank for s in own.rank_status("a")] == [0]
        await registry.remove("a")
        await own.sync()
        with pytest.raises(UnknownEngine):
            own.rank_status("a")
    finally:
        await own.stop()
        await store.close()
