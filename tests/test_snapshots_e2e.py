"""Exact from any moment: kvindex started after an engine's replay buffer moved on.

A simulated engine rank with a 10-batch replay buffer publishes 40 steps of a
chat workload (evicting on GPU and CPU), then ``kvindex serve`` starts, as its
own process, embedded or over a real Redis. The engine answers snapshots the
way kvindex's vLLM plugin does (counts of what it published, taken between
steps, behind the token); kvindex asks for one since replay cannot bring
batches 0..29, and must then answer exactly what the engine holds, tier by
tier, also after the engine steps on. Without the right token it stays
degraded and says why; after Redis loses everything it restores again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import httpx
import pytest

from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.snapshots import SelfSnapshotting
from producer.workload import Workload

from .conftest import WAIT_WITHIN, free_ports
from .test_e2e import WORKLOAD, serving, truth, until

pytestmark = pytest.mark.slow

TOKEN = "snapshot-test-token"
CONFIG = SimConfig(gpu_blocks=64, cpu_chunks=24, storage_chunks=64)
BUFFER = 10


class Engine:
    """One simulated engine rank that answers snapshots (ports: pub, replay, snapshot)."""

    def __init__(self, token: str = TOKEN) -> None:
        port = free_ports(3)
        self.endpoints = [f"tcp://127.0.0.1:{port + i}" for i in range(3)]
        self.engine = SimEngine(CONFIG, 0)
        publisher = Publisher(*self.endpoints[:2], bind=True, buffer_steps=BUFFER)
        self.rank = SelfSnapshotting(publisher, self.endpoints[2], token)
        self.requests = Workload(WORKLOAD, stream=3)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            request = next(self.requests)
            self.engine.submit(request.prompt, request.output)
            if (batch := self.engine.step()) is not None:
                assert self.rank.publish(batch)
        assert self.rank.publisher.flush()

    @property
    def last_seq(self) -> int:
        return self.rank.publisher.next_seq - 1

    def spec(self) -> dict:
        pub, replay, snapshot = self.endpoints
        return {
            "name": "late",
            "endpoint": pub,
            "replay_endpoint": replay,
            "snapshot_endpoint": snapshot,
            "reuse_reports": "counted",
            "block_size": CONFIG.block_size,
            "hash_algo": CONFIG.hash_algo,
            "hash_seed": CONFIG.hash_seed,
            "blocks_per_chunk": CONFIG.blocks_per_chunk,
        }

    def probes(self) -> list[Sequence[int]]:
        served = list(self.engine.recently_served)
        return [*served, *[(*t, 7, 8, 9) for t in served[::3]], *Workload(WORKLOAD).system_prompts]

    def truth(self, tokens: Sequence[int]) -> tuple[int, int, int]:
        return truth(self.engine, tokens)


def kvindex(tmp_path, *args: str) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """``kvindex serve`` with the token, answering."""
    return serving(tmp_path, *args, token=TOKEN, ready="/healthz")


async def rank(client: httpx.AsyncClient) -> dict:
    response = await client.get("/engines/late")
    assert response.status_code == 200, response.text
    return response.json()["ranks"][0]


async def exact_at(client: httpx.AsyncClient, engine: Engine, restores: int) -> None:
    """Once the rank applied the engine's last batch, restored ``restores`` times and
    not degraded: every probe answers what the engine holds."""

    async def settled() -> bool:
        state = await rank(client)
        return (
            state["applied_seq"] == engine.last_seq
            and state["restores"] == restores
            and not state["degraded"]
        )

    await until(settled, WAIT_WITHIN, f"the rank restored {restores} time(s) and caught up")
    for tokens in engine.probes():
        response = await client.post("/prefix-match", json={"tokens": list(tokens)})
        assert response.status_code == 200, response.text
        got = {
            e["engine"]: (e["gpu_blocks"], e["cpu_blocks"], e["storage_blocks"])
            for e in response.json()["engines"]
        }
        assert got.get("late", (0, 0, 0)) == engine.truth(tokens), tokens


@pytest.fixture
def engine():
    made = Engine()
    yield made
    made.rank.close()


@pytest.mark.parametrize("store", ["embedded", "redis"])
async def test_a_late_start_is_exact_from_the_engines_snapshot(
    tmp_path, engine, redis_server, store
) -> None:
    engine.run(40)
    assert engine.last_seq >= 3 * BUFFER  # batches 0.. are long gone from replay
    args = ("--redis-url", redis_server.url, "--redis-prefix", "late") if store == "redis" else ()
    async with kvindex(tmp_path, *args) as client:
        assert (await client.post("/engines", json=engine.spec())).status_code in (200, 201)
        await exact_at(client, engine, restores=1)
        assert (await rank(client))["gaps_unfilled"] == 1  # the range replay could not bring
        engine.run(20)  # then it keeps stepping: applied on top, exactly
        await exact_at(client, engine, restores=1)
        assert engine.rank.server.served == 1


async def test_a_redis_wipe_is_restored_from_a_snapshot_without_an_engine_restart(
    tmp_path, engine, redis_server
) -> None:
    args = ("--redis-url", redis_server.url, "--redis-prefix", "wiped")
    async with kvindex(tmp_path, *args) as client:
        assert (await client.post("/engines", json=engine.spec())).status_code in (200, 201)
        engine.run(15)
        await exact_at(client, engine, restores=0)  # replay had it all
        engine.run(30)
        await exact_at(client, engine, restores=0)
        redis = await asyncio.create_subprocess_exec(
            "redis-cli", "-p", str(redis_server.port), "FLUSHALL"
        )
        assert await redis.wait() == 0
        engine.run(2)  # the next write finds the store behind: 0..44 are not in replay
        await exact_at(client, engine, restores=1)


async def test_a_snapshot_refused_for_its_token_leaves_the_rank_degraded_and_says_why(
    tmp_path, redis_server
) -> None:
    engine = Engine(token="another-token")
    try:
        engine.run(40)
        async with kvindex(tmp_path) as client:
            assert (await client.post("/engines", json=engine.spec())).status_code in (200, 201)

            async def refused() -> bool:
                state = await rank(client)
                return state["degraded"] and "denied" in (state["snapshot_error"] or "")

            await until(refused, 30, "the snapshot to be refused")
            state = await rank(client)
            assert state["restores"] == 0 and state["missing"][0]["first"] == 0
            assert engine.rank.server.served == 0
    finally:
        engine.rank.close()
