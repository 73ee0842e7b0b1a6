"""Redis killed and restarted empty (or older) under kvindex: no wrong answer goes unflagged.

Issue 28: four engines publish to a real ``kvindex serve --redis-url`` process,
or to a ``kvindex indexer`` worker that an ``kvindex api`` replica answers for
(real ZMQ, kvindex's vLLM-wire publishers with their replay buffers). Redis is
killed with SIGKILL, the engines publish on, so every rank's store calls fail
and back off, and Redis is restarted seconds later: empty, or from a snapshot
taken at half the engines' streams (a roll-back). From then on the
test polls prefix matches and ``/readyz`` and compares every answer with an
embedded store following the same engines (in this process): an answer that
differs must be flagged ``degraded`` (the ranks sleeping between two store
retries too, not only the one whose write happens to notice the loss), and
``/readyz`` must be 503 until every rank is whole again.

What the engines publish during the outage stores blocks of their own, which
no query asks about: every state of the stream from the kill on answers the
queries alike, so lag (never flagged) cannot pass for a wrong answer.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from indexer.core.events import GPU, BlockStored, EventBatch
from indexer.engine_registry import EngineSpec
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import TRACE_NAMES, free_ports, trace_batches
from .events import stored
from .servers import RedisServer
from .test_e2e import until

pytestmark = pytest.mark.slow  # kvindex processes, four engines, Redis killed and restarted

ENGINES = 4
#: Seconds Redis stays down: long enough for the ranks' retries to back off to seconds.
OUTAGE = 6.0
#: Batches each engine publishes while Redis is down.
DURING_OUTAGE = 20
#: Seconds of answers still checked once every rank is whole again.
SETTLED = 1.0
#: The workers' lease_ttl (seconds): claims, and claims anew after the loss, come sooner.
LEASE_TTL = 2.0
#: What an answer row says of a rank's cache.
COUNTS = ("gpu_blocks", "cpu_blocks", "storage_blocks", "prefix_blocks")

Rows = dict[tuple[str, int], tuple[int, ...]]


class Kvindex:
    """``kvindex`` child processes over one Redis (``topology``: ``serve``, or an
    ``indexer`` worker and an ``api`` replica) and an async client to their HTTP API."""

    def __init__(self, logs: Path, topology: str, redis_url: str, specs: list[EngineSpec]) -> None:
        port = free_ports()
        redis, engines = ["--redis-url", redis_url], []
        for spec in specs:
            replay = f"replay_endpoint={spec.replay_endpoint}"
            engines += ["--engine", f"{spec.name}={spec.endpoint},{replay}"]
        http = ["--port", str(port), *redis]
        commands = {"serve": [["serve", *http, *engines]]}.get(topology) or [
            ["indexer", "--lease-ttl", str(LEASE_TTL), *redis, *engines],
            ["api", *http],  # the registry is the workers' (--engine registers there)
        ]
        self.procs: list[tuple[subprocess.Popen, Path]] = []
        for command in commands:
            log = logs / f"{command[0]}.log"
            with log.open("w") as stderr:  # not a pipe: nobody reads it until the end
                argv = [sys.executable, "-m", "kvindex.cli", "--log-level", "INFO", *command]
                self.procs.append((subprocess.Popen(argv, stderr=stderr), log))
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

    async def get(self, path: str) -> httpx.Response | None:
        """The answer, or None while the process does not answer HTTP yet."""
        for proc, log in self.procs:
            assert proc.poll() is None, f"{log.stem} exited: {log.read_text()}"
        try:
            return await self.http.get(path)
        except httpx.TransportError:
            return None

    async def applied(self, specs: list[EngineSpec], seq: int) -> bool:
        """Whether every engine's rank has applied up to ``seq``, whole (not degraded)."""
        for spec in specs:
            answer = await self.get(f"/engines/{spec.name}")
            if answer is None or answer.status_code != 200:
                return False
            (rank,) = answer.json()["ranks"]
            if rank["applied_seq"] != seq or rank["degraded"]:
                return False
        return True

    async def close(self) -> None:
        await self.http.aclose()
        for proc, _ in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def engines(count: int) -> tuple[list[EngineSpec], list[Publisher]]:
    """``count`` engines, ``e0``, ``e1``...: each a publisher bound on fresh ports, with
    its replay buffer."""
    specs, publishers = [], []
    for i in range(count):
        pub, replay = free_ports(), free_ports()
        spec = EngineSpec(
            f"e{i}", f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}"
        )
        specs.append(spec)
        publishers.append(Publisher(spec.endpoint, spec.replay_endpoint, bind=True))
    return specs, publishers


def gpu_chains(batches: list[EventBatch], count: int) -> list[tuple[int, ...]]:
    """The last ``count`` block-hash chains the batches store on GPU."""
    chains = [
        tuple(event.block_hashes)
        for batch in batches
        for event in batch.events
        if isinstance(event, BlockStored) and event.medium == GPU
    ]
    return chains[-count:]


def outage_batches(after: EventBatch) -> list[EventBatch]:
    """Batches storing blocks no query asks about, newer than ``after``."""
    return [
        EventBatch(after.ts + 1 + i / 100, [stored([(1 << 62) + i])], 0)
        for i in range(DURING_OUTAGE)
    ]


async def rows(client: httpx.AsyncClient, chain: tuple[int, ...]) -> tuple[int, Rows, dict]:
    """A prefix match's status, each rank's counts and its ``degraded`` flags."""
    answer = await client.post("/prefix-match", json={"block_hashes": list(chain)})
    if answer.status_code != 200:
        return answer.status_code, {}, {}
    found = answer.json()["engines"]
    counts = {(r["engine"], r["dp_rank"]): tuple(r[c] for c in COUNTS) for r in found}
    return 200, counts, {(r["engine"], r["dp_rank"]): r["degraded"] for r in found}


@dataclass
class Observed:
    """What the polls saw after the restart; times in seconds since it."""

    restarted: float
    answers: int = 0  # prefix matches answered (each checked row by row)
    rows: int = 0
    flagged: int = 0  # rows that differ from the reference, flagged degraded
    unflagged: list[str] = field(default_factory=list)  # rows that differ, not flagged
    unavailable: int = 0  # queries answered 503 (the store not reachable yet)
    readyz: list[tuple[float, int]] = field(default_factory=list)  # (since, status) changes
    wrong_while_ready: list[str] = field(default_factory=list)  # differing after /readyz 200

    def now(self) -> float:
        return round(time.monotonic() - self.restarted, 3)

    def ready(self, status: int) -> None:
        if not self.readyz or self.readyz[-1][1] != status:
            self.readyz.append((self.now(), status))

    def summary(self) -> str:
        return (
            f"{self.answers} answers ({self.rows} rows) checked, {self.flagged} differing rows"
            f" flagged, {len(self.unflagged)} unflagged, {self.unavailable} answered 503"
        )

    def assert_flagged(self) -> None:
        """Every differing row was flagged, and some did differ (else nothing was checked)."""
        assert not self.unflagged, self.unflagged[:10]
        assert self.flagged, "no answer fell between the restart and the rebuild: nothing checked"

    def check(self, counts: Rows, flags: dict, want: Rows, ready: bool) -> None:
        """One answer against the reference's, row by row."""
        self.answers += 1
        for rank, got in counts.items():
            self.rows += 1
            if got == want[rank]:
                continue
            wrong = f"{self.now()}s {rank}: {got}, expected {want[rank]}"
            if ready:
                self.wrong_while_ready.append(wrong)
            if flags[rank]:
                self.flagged += 1
            else:
                self.unflagged.append(wrong)


async def poll(kvindex: Kvindex, expected: dict, seen: Observed, done: Callable[[], bool]) -> None:
    """``/readyz``, then every chain, in turn, until ``done()``."""
    while not done():
        ready = await kvindex.get("/readyz")
        assert ready is not None, "kvindex stopped answering HTTP"
        seen.ready(ready.status_code)
        for chain, want in expected.items():
            status, counts, flags = await rows(kvindex.http, chain)
            if status == 503:
                seen.unavailable += 1
            else:
                assert status == 200
                seen.check(counts, flags, want, seen.readyz[-1][1] == 200)
        await asyncio.sleep(0.005)


async def save(server: RedisServer) -> None:
    """Have the server write its snapshot now (a restart comes back to it)."""
    redis = Redis.from_url(server.url)
    try:
        await redis.save()
    finally:
        await redis.aclose()


@pytest.mark.parametrize("restart", ["empty", "snapshot"])
@pytest.mark.parametrize("topology", ["serve", "scale-out"])
async def test_every_wrong_answer_after_redis_restarts_is_flagged(
    tmp_path: Path, volatile_redis: RedisServer, topology: str, restart: str
) -> None:
    """``scale-out``: an ``indexer`` worker ingests, an ``api`` replica answers.
    ``snapshot``: Redis comes back from an RDB snapshot taken at half the trace, a
    roll-back (the answers of an older state may over-report too)."""
    batches = trace_batches(*TRACE_NAMES)
    half = len(batches) // 2 if restart == "snapshot" else len(batches)
    later = outage_batches(batches[-1])
    specs, publishers = engines(ENGINES)
    reference = LiveApi()
    reference.publishers += publishers  # closed with it
    kvindex = Kvindex(tmp_path, topology, volatile_redis.url, specs)
    await reference.__aenter__()
    try:
        for spec in specs:
            await reference.registry.add(spec)

        async def publish(part: list[EventBatch]) -> None:
            for publisher in publishers:
                for batch in part:
                    assert publisher.publish(batch)
                assert await asyncio.to_thread(publisher.flush)
            last = [publishers[0].next_seq - 1]
            await asyncio.gather(*(reference.wait_applied(s.name, last) for s in specs))

        async def reference_rows() -> dict:
            return {chain: (await rows(reference.client, chain))[1] for chain in chains}

        async def publish_applied(part: list[EventBatch]) -> None:
            await publish(part)
            last = publishers[0].next_seq - 1
            await until(lambda: kvindex.applied(specs, last), 60, f"kvindex to apply {last}")

        await publish_applied(batches[:half])
        if restart == "snapshot":
            await save(volatile_redis)
            await publish_applied(batches[half:])
        chains = gpu_chains(batches, 6)
        expected = await reference_rows()
        assert any(any(counts) for want in expected.values() for counts in want.values())

        await asyncio.to_thread(volatile_redis.stop, signal.SIGKILL)
        down = time.monotonic()
        await publish(later)  # the ranks' store calls fail and back off meanwhile
        assert await reference_rows() == expected  # what is queried did not change
        await asyncio.sleep(max(0.0, down + OUTAGE - time.monotonic()))
        await asyncio.to_thread(volatile_redis.start)  # empty, or back to the snapshot
        seen = Observed(time.monotonic())
        whole: list[float] = []

        async def watch_whole() -> None:
            last = len(batches) + len(later) - 1
            while not whole:
                if await kvindex.applied(specs, last):
                    whole.append(seen.now())
                await asyncio.sleep(0.05)

        def done() -> bool:
            return bool(whole) and seen.now() > whole[0] + SETTLED

        polls = asyncio.gather(poll(kvindex, expected, seen, done), watch_whole())
        await asyncio.wait_for(polls, 120)
    finally:
        await kvindex.close()
        await reference.__aexit__()
    print(f"\nafter the restart: {seen.summary()}; /readyz {seen.readyz}; whole at {whole[0]}s")
    seen.assert_flagged()
    assert not seen.wrong_while_ready, seen.wrong_while_ready[:10]
    assert seen.readyz[0][1] == 503 and seen.readyz[-1][1] == 200, seen.readyz
