"""End to end: simulated engines -> ZMQ -> ``kvindex serve`` -> HTTP ``/prefix-match``.

Real sockets and a real service: each simulated engine rank publishes
through the vLLM-wire publisher, ``kvindex serve`` runs as its own process
with the embedded store, and everything is observed over HTTP. Every answer
must equal what the engines hold in process — per rank, per tier — after
GPU and CPU eviction pressure and after one engine restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from indexer.core.events import BlockRemoved
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.simcli import Layout, engine_spec
from producer.workload import Workload, WorkloadConfig

from .conftest import EXIT_WITHIN, free_ports

pytestmark = pytest.mark.slow  # a fleet of simulated engines and kvindex processes

DP_RANKS = 2
#: Small caches so that a few hundred requests evict on every tier.
ENGINES = [
    SimConfig(gpu_blocks=64, cpu_chunks=40),  # restarted part-way
    SimConfig(gpu_blocks=64, cpu_chunks=40, self_describing=False),
    SimConfig(gpu_blocks=64, cpu_chunks=24, storage_chunks=64),
    SimConfig(gpu_blocks=64, cpu_chunks=40, hash_algo="xxhash"),  # secret seed: learned
]
RESTARTED = 0
WORKLOAD = WorkloadConfig(
    seed=5,
    system_prompts=6,
    system_prompt_tokens=(48, 200),
    user_tokens=(8, 48),
    output_tokens=(8, 64),
    max_context_tokens=512,
)


class SimRank:
    """One engine rank: its simulated engine, its publisher, its share of the traffic."""

    def __init__(
        self, layout: Layout, engine: int, dp_rank: int, config: SimConfig | None = None
    ) -> None:
        self.layout, self.index, self.dp_rank = layout, engine, dp_rank
        self.config = config or ENGINES[engine]
        self.name = layout.name(engine)
        self.requests = Workload(WORKLOAD, stream=engine * DP_RANKS + dp_rank)
        self.prompts: list[tuple[int, ...]] = []
        self.removed: Counter[str] = Counter()
        self._start()

    def _start(self) -> None:
        self.engine = SimEngine(self.config, self.dp_rank)
        self.publisher = Publisher(
            self.layout.endpoint(self.index),
            self.layout.replay_endpoint(self.index),
            data_parallel_rank=self.dp_rank,
            bind=True,
        )

    def restart(self) -> None:
        """Come back empty, numbering batches from 0 again; the traffic goes on."""
        self.publisher.close()
        self._start()

    def step(self) -> None:
        request = next(self.requests)
        self.engine.submit(request.prompt, request.output)
        self.prompts.append(request.prompt)
        batch = self.engine.step()
        if batch is not None:
            self.removed.update(e.medium for e in batch.events if type(e) is BlockRemoved)
            assert self.publisher.publish(batch)

    def truth(self, tokens: Sequence[int]) -> tuple[int, int, int]:
        return truth(self.engine, tokens)


def truth(engine: SimEngine, tokens: Sequence[int]) -> tuple[int, int, int]:
    """What a simulated engine holds of a prompt: its GPU, CPU and storage prefix blocks."""
    return (
        engine.gpu_prefix_blocks(tokens),
        engine.cpu_prefix_blocks(tokens),
        engine.storage_prefix_blocks(tokens),
    )


class Fleet:
    """Every simulated rank, stepped together."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.ranks = [SimRank(layout, k, r) for k in range(layout.engines) for r in range(DP_RANKS)]

    def run(self, steps: int) -> None:
        """Step every rank ``steps`` times, then wait until every batch went out."""
        for _ in range(steps):
            for rank in self.ranks:
                rank.step()
        for rank in self.ranks:
            assert rank.publisher.flush()

    def truths(self, tokens: Sequence[int]) -> dict[tuple[str, int], tuple[int, int, int]]:
        return {(r.name, r.dp_rank): r.truth(tokens) for r in self.ranks}

    def close(self) -> None:
        for rank in self.ranks:
            rank.publisher.close()


@contextlib.asynccontextmanager
async def serving(
    logs: Path, *args: str, token: str | None = None, ready: str = "/readyz"
) -> AsyncIterator[httpx.AsyncClient]:
    """``kvindex serve`` (``args`` after ``serve``) on a free port, its output in
    ``logs``, stopped by SIGINT; ``token``: the API's, in its environment and sent by
    the client. Yields once ``ready`` answers 200."""
    port = free_ports()
    env = {**os.environ, **({"KVINDEX_AUTH_TOKEN": token} if token else {})}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with open(logs / f"serve-{port}.log", "w+") as log:
        command = [sys.executable, "-m", "kvindex.cli", "serve", "--port", str(port), *args]
        service = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers) as client:
                await until(lambda: _answers(client, service, ready), 20, f"kvindex {ready}")
                yield client
        finally:
            service.send_signal(signal.SIGINT)
            assert service.wait(timeout=EXIT_WITHIN) == 0, log.seek(0) or log.read()


@pytest.fixture
async def kvindex(tmp_path) -> AsyncIterator[httpx.AsyncClient]:
    """``kvindex serve`` with the embedded store, ready."""
    async with serving(tmp_path) as client:
        yield client


async def _answers(client: httpx.AsyncClient, service: subprocess.Popen, path: str) -> bool:
    assert service.poll() is None, "kvindex serve exited"
    try:
        return (await client.get(path)).status_code == 200
    except httpx.TransportError:
        return False


async def until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll an async ``condition`` every 50 ms; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    fleet = Fleet(Layout(len(ENGINES), free_ports(2 * DP_RANKS * len(ENGINES)), DP_RANKS))
    yield fleet
    fleet.close()


async def rank_states(client: httpx.AsyncClient, fleet: Fleet) -> dict[tuple[str, int], dict]:
    """What ``GET /engines/{name}`` says of every rank."""
    states = {}
    for k in range(fleet.layout.engines):
        response = await client.get(f"/engines/{fleet.layout.name(k)}")
        assert response.status_code == 200, response.text
        body = response.json()
        states.update(((body["name"], rank["dp_rank"]), rank) for rank in body["ranks"])
    return states


async def caught_up(client: httpx.AsyncClient, fleet: Fleet) -> None:
    """Wait until every rank's last published batch is applied."""

    async def done() -> bool:
        states = await rank_states(client, fleet)
        return all(
            states[r.name, r.dp_rank]["applied_seq"] == r.publisher.next_seq - 1
            for r in fleet.ranks
        )

    await until(done, 20, "every published batch to be applied")


async def answers(client: httpx.AsyncClient, tokens: Sequence[int]) -> dict:
    response = await client.get("/prefix-match", params={"tokens": ",".join(map(str, tokens))})
    assert response.status_code == 200, response.text
    return {
        (e["engine"], e["dp_rank"]): (e["gpu_blocks"], e["cpu_blocks"], e["storage_blocks"])
        for e in response.json()["engines"]
    }


def probes(fleet: Fleet) -> list[Sequence[int]]:
    """Prompts old and recent, finished turns extended by a new message, system prompts."""
    served = [tokens for r in fleet.ranks for tokens in r.engine.recently_served]
    return [
        *served,
        *[(*tokens, 1, 2, 3) for tokens in served[::3]],
        *[tokens for r in fleet.ranks for tokens in r.prompts[::8]],
        *Workload(WORKLOAD).system_prompts,
    ]


async def assert_answers_equal_ground_truth(client: httpx.AsyncClient, fleet: Fleet) -> None:
    truths = []
    for tokens in probes(fleet):
        truth = fleet.truths(tokens)
        assert await answers(client, tokens) == truth, f"prompt of {len(tokens)} tokens"
        truths.extend(truth.values())
    # The probes reached every tier, including blocks only a lower tier holds.
    assert any(gpu == 0 < cpu for gpu, cpu, _ in truths)
    assert any(cpu < storage for _, cpu, storage in truths)


async def test_prefix_match_equals_every_engines_ground_truth(kvindex, fleet):
    client = kvindex
    for k, config in enumerate(ENGINES):
        response = await client.post("/engines", json=engine_spec(fleet.layout, k, config, "sim"))
        assert response.status_code == 201, response.text

    fleet.run(120)
    await caught_up(client, fleet)
    await assert_answers_equal_ground_truth(client, fleet)

    restarted = [r for r in fleet.ranks if r.index == RESTARTED]
    held = [(r, tokens, r.truth(tokens)) for r in restarted for tokens in r.prompts[-20:]]
    for rank in restarted:
        rank.restart()
    fleet.run(60)
    await caught_up(client, fleet)
    await assert_answers_equal_ground_truth(client, fleet)

    states = await rank_states(client, fleet)
    assert [states[r.name, r.dp_rank]["restarts"] for r in restarted] == [1] * DP_RANKS
    # The new incarnations do not hold what the old ones did: kvindex dropped it.
    assert any(r.truth(tokens) != before for r, tokens, before in held)
    evicted = sum((r.removed for r in fleet.ranks), Counter())
    assert evicted["GPU"] and evicted["CPU"] and evicted["STORAGE"]
    assert not any(state["degraded"] for state in states.values())
