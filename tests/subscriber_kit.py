"""What the subscriber's tests share: engines publishing on free ports, a
subscriber consuming them, and the store a scenario must end with, so every
test states its scenario and its expected store, not the plumbing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

from indexer.core.events import CPU, GPU, EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores import ApplyResult, MemoryStore, apply_events
from producer.publisher import Publisher

from .conftest import free_ports, wait_until

FAST = SubscriberSettings(replay_timeout=0.5, probe_interval=0.2, stop_grace=2.0)
CLEAR = "clear GPU/CPU"


def tuned(**changes) -> SubscriberSettings:
    return msgspec.structs.replace(FAST, **changes)


class RecordingStore(MemoryStore):
    """A MemoryStore that remembers every seq it was asked to apply, per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: dict[RankId, list[int]] = {}

    async def apply(self, rank: RankId, seq: int, ts: float, ops, *, fence=None) -> ApplyResult:
        self.asked.setdefault(rank, []).append(seq)
        return await super().apply(rank, seq, ts, ops, fence=fence)


class SlowStore(MemoryStore):
    async def apply(self, rank: RankId, seq: int, ts: float, ops, *, fence=None) -> ApplyResult:
        await asyncio.sleep(0.002)
        return await super().apply(rank, seq, ts, ops, fence=fence)


class Engine:
    """One engine's endpoints on free ports, its spec, and its publishers' lifecycle."""

    def __init__(self, name: str = "e", dp_ranks: int = 1, replay: bool = True) -> None:
        self.pub, self.replay = free_ports(dp_ranks), free_ports(dp_ranks) if replay else None
        self.spec = EngineSpec(
            name,
            f"tcp://127.0.0.1:{self.pub}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay}" if replay else None,
            dp_ranks=dp_ranks,
            reuse_reports="counted",  # vLLM's traces: every GPU store a copy, no reports
        )
        self.publishers: list[Publisher] = []

    def publisher(self, dp_rank: int = 0, **options) -> Publisher:
        """A new incarnation of rank ``dp_rank``'s publisher (seq from 0)."""
        publisher = Publisher(
            self.spec.endpoint,
            self.spec.replay_endpoint,
            data_parallel_rank=dp_rank,
            bind=True,
            **options,
        )
        self.publishers.append(publisher)
        return publisher

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()


@contextlib.contextmanager
def engines() -> Iterator[Callable[..., Engine]]:
    """The engines a test makes (its ``engine`` fixture), closed after it."""
    made: list[Engine] = []

    def make(**kw) -> Engine:
        made.append(Engine(**kw))
        return made[-1]

    try:
        yield make
    finally:
        for e in made:
            e.close()


async def publish(publisher: Publisher, items: Iterable[EventBatch]) -> None:
    for batch in items:
        assert publisher.publish(batch)
    assert await asyncio.to_thread(publisher.flush)


async def consuming(store, *specs: EngineSpec, settings=FAST) -> Subscriber:
    registry = EngineRegistry()
    for spec in specs:
        await registry.add(spec)
    subscriber = Subscriber(store, registry, settings)
    await subscriber.start()
    return subscriber


def status(subscriber: Subscriber, engine: str = "e", dp_rank: int = 0):
    return subscriber.rank_status(engine)[dp_rank]


async def applied(subscriber: Subscriber, seq: int, engine: str = "e", dp_rank: int = 0) -> None:
    await wait_until(
        lambda: status(subscriber, engine, dp_rank).applied_seq == seq,
        what=f"{engine}/{dp_rank} to apply seq {seq}",
    )


async def counts(store, rank: RankId, hashes: Iterable) -> dict:
    """Every residency of ``rank`` for these hashes: the store's observable state."""
    found = {}
    for h in hashes:
        rows = [dataclasses.astuple(r) for r in await store.block_residency(h)]
        found[h] = sorted(r for r in rows if (r[0], r[1]) == rank)
    return found


async def reference(rank: RankId, steps: Sequence) -> MemoryStore:
    """A MemoryStore fed ``(seq, batch)`` steps directly; ``CLEAR`` drops GPU/CPU."""
    store = MemoryStore()
    for step in steps:
        if step == CLEAR:
            await store.clear(rank, (GPU, CPU))
        else:
            await apply_events(store, rank, *step)
    return store


def hashes_of(items: Iterable[EventBatch]) -> set:
    return {h for b in items for e in b.events for h in getattr(e, "block_hashes", ())}


async def assert_same(store, expected: MemoryStore, rank: RankId, items: list[EventBatch]):
    hashes = hashes_of(items)
    assert await store.block_counts(rank) == await expected.block_counts(rank)
    assert await counts(store, rank, hashes) == await counts(expected, rank, hashes)


def assert_in_order_once(store: RecordingStore, rank: RankId) -> None:
    asked = store.asked[rank]
    assert asked == sorted(set(asked)), "a seq was applied twice or out of order"


RANK = RankId("e", 0)
