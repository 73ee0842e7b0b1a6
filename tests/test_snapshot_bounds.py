"""A snapshot that asks for more than any engine holds is refused before anything is built.

Issue 34: a 70-byte answer at a rank's snapshot endpoint claiming one hash held
10**9 times took kvindex from 70 MB to gigabytes. Here a real snapshot endpoint
(:class:`~producer.snapshots.SnapshotServer`, real ZMQ) answers a rank whose
engine's replay buffer moved on, with snapshots past each bound: the rank refuses
it within a second, counts the reason, stays degraded, and this process's RSS
does not grow; one within the bounds is applied, so the refusals are not the
setup's doing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from indexer.core.events import EventBatch
from indexer.core.snapshot import SNAPSHOT_OVER_CAPACITY, Snapshot, SnapshotTier
from indexer.engine_registry import EngineRegistry, EngineSpec, RankStatus
from indexer.ingest.settings import SubscriberSettings
from indexer.ingest.subscriber import Subscriber
from indexer.stores import MemoryStore
from producer.publisher import Publisher
from producer.snapshots import SnapshotServer

from .conftest import free_ports, wait_until
from .events import stored

pytestmark = pytest.mark.slow  # real sockets, replay and snapshot round trips

TOKEN = "bounds-token"
#: Batches the engine published before kvindex starts; its replay buffer holds the last 2.
PUBLISHED = 5
#: The engine's declared GPU capacity: its rank may hold twice that on GPU.
GPU_BLOCKS = 8
#: The subscriber's max_blocks: the rank's bound on CPU and storage.
MAX_BLOCKS = 4096
#: RSS growth allowed while a refused snapshot is handled (allocator noise).
RSS_SLACK = 32 << 20


def rss() -> int:
    """This process's resident set, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS in /proc/self/status")


class Answered:
    """A snapshot endpoint answering ``tiers`` as of the engine's last batch."""

    def __init__(self, endpoint: str, tiers: list[SnapshotTier], last: EventBatch) -> None:
        self.tiers, self.last = tiers, last
        self.asked: list[float] = []
        self.server = SnapshotServer(endpoint, TOKEN, self._take)

    def _take(self) -> Snapshot:
        self.asked.append(time.monotonic())
        return Snapshot(PUBLISHED - 1, self.last.ts, self.tiers)


@pytest.fixture
async def rank_answering() -> AsyncIterator:
    """Start kvindex's ingest on an engine whose snapshot endpoint answers ``tiers``;
    yields a function of ``tiers`` returning the endpoint and the rank's status."""
    made: list[tuple[Subscriber, Publisher, Answered]] = []

    async def start(tiers: list[SnapshotTier]):
        port = free_ports(3)
        pub, replay, snap = (f"tcp://127.0.0.1:{port + i}" for i in range(3))
        publisher = Publisher(pub, replay, bind=True, buffer_steps=2)
        batches = [EventBatch(1000.0 + i, [stored([100 + i])], 0) for i in range(PUBLISHED)]
        for batch in batches:
            assert publisher.publish(batch)
        assert await asyncio.to_thread(publisher.flush)
        answered = Answered(snap, tiers, batches[-1])
        registry = EngineRegistry()
        settings = SubscriberSettings(max_blocks=MAX_BLOCKS, snapshot_retry=60.0)
        subscriber = Subscriber(MemoryStore(), registry, settings, token=TOKEN)
        made.append((subscriber, publisher, answered))
        await subscriber.start()
        spec = EngineSpec(
            "e", pub, replay_endpoint=replay, snapshot_endpoint=snap, gpu_blocks=GPU_BLOCKS
        )
        await registry.add(spec)

        def status() -> RankStatus:
            return subscriber.rank_status("e")[0]

        return answered, status

    yield start
    for subscriber, publisher, answered in made:
        await subscriber.stop()
        answered.server.close()
        publisher.close()


def tier(medium: str, hashes: list[int], counts: list[int] | None = None) -> SnapshotTier:
    return SnapshotTier(medium, None, 0, None, hashes, counts)


@pytest.mark.parametrize(
    "tiers",
    [
        pytest.param([tier("GPU", [1], [10**9])], id="one hash held 10**9 times"),
        pytest.param([tier("CPU", [1], [MAX_BLOCKS + 1])], id="one hash past max_blocks"),
        pytest.param(
            [tier("GPU", [1, 2, 3], [7, 7, 7])], id="GPU references past twice gpu_blocks"
        ),
        pytest.param(
            [tier("STORAGE", list(range(1, MAX_BLOCKS + 2)))], id="storage blocks past max_blocks"
        ),
    ],
)
async def test_a_snapshot_beyond_capacity_is_refused_at_once_and_counted(
    rank_answering, tiers: list[SnapshotTier]
) -> None:
    before = rss()
    answered, status = await rank_answering(tiers)

    def refused() -> bool:
        state = status()
        return state.rejected.get(SNAPSHOT_OVER_CAPACITY, 0) > 0 and bool(state.snapshot_error)

    await wait_until(refused, 30, "the snapshot to be refused")
    took = time.monotonic() - answered.asked[0]
    grew = rss() - before
    print(f"\nrefused {took * 1000:.1f} ms after the engine was asked; RSS grew {grew >> 10} KiB")
    state = status()
    assert took < 1.0, f"{took:.3f} s to refuse"
    assert grew < RSS_SLACK, f"RSS grew {grew >> 20} MiB"
    assert state.degraded and state.restores == 0
    assert SNAPSHOT_OVER_CAPACITY in state.snapshot_error, state.snapshot_error
    assert len(answered.asked) == 1  # asked again only after snapshot_retry


async def test_a_snapshot_at_the_bounds_is_applied(rank_answering) -> None:
    """Right at each bound (one hash held as many times as the rank may hold blocks
    too): applied, so the refusals above are the bounds' doing."""
    bounded = [tier("GPU", [1, 2], [GPU_BLOCKS, GPU_BLOCKS]), tier("CPU", [3], [MAX_BLOCKS])]
    _, status = await rank_answering(bounded)
    await wait_until(lambda: status().restores == 1, 30, "the snapshot to be applied")
    assert not status().rejected and status().snapshot_error is None
    assert not status().degraded
