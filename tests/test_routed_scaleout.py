"""Routed entries in scale-out, as real processes: one ``kvindex indexer`` worker and two
``kvindex api`` replicas over one redis-server, four simulated engines publishing, and
``kvindex sim --no-events``.

The router is a loop in the test: for each request it asks a replica (alternating),
picks a best-scoring rank (ties at random, as routers balance load), records the pick
(``POST /routed``) and hands the prompt to that engine, which publishes its events
only after the whole burst: the burst is faster than the events.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from collections.abc import Sequence

import httpx
import msgspec
import pytest

from indexer.engine_registry import EngineSpec
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.simcli import Layout, engine_spec

from .conftest import EXIT_WITHIN, free_ports
from .test_e2e import until
from .test_scaleout import KVINDEX, Process

pytestmark = pytest.mark.slow

CONFIG = SimConfig(gpu_blocks=2048, cpu_chunks=0)
PREFIX_TOKENS = 4096


class Engine:
    """A simulated engine whose batches wait until :meth:`drain` (the events' delay)."""

    def __init__(self, layout: Layout, k: int) -> None:
        self.spec = engine_spec(layout, k, CONFIG, "m")
        self.name = self.spec["name"]
        self.engine = SimEngine(CONFIG, 0)
        self.publisher = Publisher(
            self.spec["endpoint"], self.spec["replay_endpoint"], data_parallel_rank=0, bind=True
        )
        self.received = 0

    def submit(self, tokens: Sequence[int]) -> None:
        self.engine.submit(tokens, (1, 2))
        self.received += 1

    def drain(self, steps: int = 400) -> None:
        for _ in range(steps):
            batch = self.engine.step()
            if batch is not None:
                assert self.publisher.publish(batch)
            if self.engine.idle:
                return


def prompts(seed: int) -> list[list[int]]:
    """32 requests sharing a new 4k-token prefix, each with its own question."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 30_000) for _ in range(PREFIX_TOKENS)]
    return [prefix + [30_000 + seed * 100 + i] * 24 for i in range(32)]


async def burst(
    clients: list[httpx.AsyncClient], engines: dict[str, Engine], record: bool, seed: int
) -> list[str]:
    rng, picks = random.Random(seed), []
    for i, tokens in enumerate(prompts(seed)):
        client = clients[i % len(clients)]
        answer = await client.post("/prefix-match", json={"tokens": tokens})
        assert answer.status_code == 200, answer.text
        rows = answer.json()["engines"]
        top = max(r["score"] for r in rows)
        pick = rng.choice([r["engine"] for r in rows if r["score"] == top])
        if record:
            body = {"engine": pick, "tokens": tokens, "ttl_ms": 120_000}  # a slow shared host
            routed = await client.post("/routed", json=body)
            assert routed.status_code == 200, routed.text
        engines[pick].submit(tokens)
        picks.append(pick)
    return picks


async def test_a_burst_on_two_replicas_goes_to_one_rank_and_is_confirmed(
    redis_server, tmp_path
) -> None:
    redis = ("--redis-url", redis_server.url, "--redis-prefix", f"routed-{uuid.uuid4().hex[:8]}")
    layout = Layout(4, free_ports(8))
    engines = {e.name: e for e in (Engine(layout, k) for k in range(4))}
    ports = [free_ports(), free_ports()]
    worker = Process(tmp_path / "worker.log", "indexer", *redis, "--worker-id", "w1")
    apis = [Process(tmp_path / f"api{p}.log", "api", *redis, "--port", str(p)) for p in ports]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=10) for p in ports]
    try:
        await until(lambda: _all_up(clients), 30, "both replicas")
        for e in engines.values():
            assert (await clients[0].post("/engines", json=e.spec)).status_code == 201

        async def consumed() -> bool:
            stats = (await clients[1].get("/stats")).json()
            return stats["connected_ranks"] == len(engines)

        await until(consumed, 30, "the worker to consume every engine")
        picks = await burst(clients, engines, record=True, seed=1)
        assert len(set(picks)) == 1, picks
        chosen = engines[picks[0]]
        chosen.drain()  # the events come now: the worker confirms the routed entries

        async def confirmed() -> bool:
            return (await clients[0].get("/stats")).json()["routed"]["confirmed"] >= 256

        await until(confirmed, 30, "the worker to confirm the routed entries")
        rows = (await clients[1].post("/prefix-match", json={"tokens": prompts(1)[0]})).json()
        row = next(r for r in rows["engines"] if r["engine"] == chosen.name)
        assert row["gpu_blocks"] >= 256 and row["routed_blocks"] >= row["gpu_blocks"]

        scattered = await burst(clients, engines, record=False, seed=2)
        assert len(set(scattered)) > 1, scattered
    finally:
        for client in clients:
            await client.aclose()
        for process in [*apis, worker]:
            process.stop()
        for e in engines.values():
            e.publisher.close()


async def _all_up(clients: list[httpx.AsyncClient]) -> bool:
    try:
        return all([(await c.get("/healthz")).status_code == 200 for c in clients])
    except httpx.TransportError:
        return False


def test_sim_without_events_binds_nothing_and_declares_its_capacity() -> None:
    args = ["sim", "--engines", "2", "--no-events", "--gpu-blocks", "512"]
    printed = subprocess.run(
        [*KVINDEX, *args, "--print-specs"], capture_output=True, text=True, timeout=60
    )
    specs = [
        msgspec.convert(json.loads(line), EngineSpec) for line in printed.stdout.split("\n")[:2]
    ]
    assert [(s.events, s.gpu_blocks, s.endpoint) for s in specs] == [(False, 512, None)] * 2
    sim = subprocess.Popen([*KVINDEX, *args, "--base-port", "1"], stdout=subprocess.PIPE, text=True)
    try:
        # port 1 cannot be bound by a test: running at all shows nothing is bound
        assert [sim.stdout.readline().strip() for _ in range(2)] == [
            "sim-0: no events",
            "sim-1: no events",
        ]
    finally:
        sim.terminate()  # it stops cleanly from the moment it has printed anything
        assert sim.wait(timeout=EXIT_WITHIN) == 0
