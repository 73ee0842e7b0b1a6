"""The subscriber while it runs, over real ZMQ sockets: a failing or slow store,
engines added and removed under it, observers, and an engine that connects to
it, since these are what a long-running kvindex meets besides lost batches."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import REGISTRY

from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry, UnknownEngine
from indexer.engines.vllm.wire import STORED, StoredHashes
from indexer.ingest.subscriber import Subscriber
from indexer.stores import ApplyResult, MemoryStore, StoreUnavailable
from producer.publisher import Publisher

from .conftest import assert_matches_trace, trace_batches, wait_until
from .subscriber_kit import (
    FAST,
    RANK,
    RecordingStore,
    SlowStore,
    applied,
    consuming,
    engines,
    publish,
    status,
    tuned,
)


@pytest.fixture
def engine():
    with engines() as make:
        yield make


class FlakyStore(RecordingStore):
    """Fails every third apply, and the first watermark read, as a store outage would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def apply(self, rank: RankId, seq: int, ts: float, ops, *, fence=None) -> ApplyResult:
        self.calls += 1
        if self.calls % 3 == 0:
            raise StoreUnavailable("down")
        return await super().apply(rank, seq, ts, ops, fence=fence)

    async def watermark(self, rank: RankId):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("not yet")
        return await super().watermark(rank)


@pytest.mark.slow
async def test_store_errors_are_retried_without_loss(engine) -> None:
    e = engine()
    pub = e.publisher()
    store = FlakyStore()
    sub = await consuming(store, e.spec, settings=tuned(store_retry_max=0.01))
    try:
        await publish(pub, trace_batches("chat-placeholders"))
        await applied(sub, 199)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.store_errors >= 60 and not st.degraded
    await assert_matches_trace(store, RANK, "chat-placeholders")


async def test_lag_is_measured_while_behind(engine) -> None:
    e = engine()
    pub = e.publisher()
    sub = await consuming(SlowStore(), e.spec)
    seen: list[tuple[int, float]] = []
    try:
        await wait_until(lambda: status(sub).connected, what="connected")
        await publish(pub, trace_batches("chat-sha256"))

        def sample() -> bool:
            st = status(sub)
            seen.append((st.lag_batches, st.lag_seconds))
            return st.applied_seq == 249

        await wait_until(sample)
        st = status(sub)
    finally:
        await sub.stop()
    assert max(lag for lag, _ in seen) > 50
    assert max(seconds for _, seconds in seen) > 0
    assert (st.lag_batches, st.lag_seconds) == (0, 0.0)


@pytest.mark.parametrize("reads_tokens", [False, True])
async def test_registry_changes_at_runtime_and_observers(engine, reads_tokens: bool) -> None:
    """Observers see every applied batch, with token ids only if one of them reads them."""
    e = engine()
    registry = EngineRegistry()
    store = MemoryStore()
    sub = Subscriber(store, registry, FAST)
    observed: list[tuple[RankId, float]] = []
    stores: set[type] = set()

    def observe(rank: RankId, batch: EventBatch) -> None:
        observed.append((rank, batch.ts))
        stores.update(type(event) for event in batch.events if type(event) in STORED)

    sub.add_observer(observe, (lambda name: name == "e") if reads_tokens else None)
    await sub.start()
    try:
        assert sub.running()
        await registry.add(e.spec)
        items = trace_batches("chat-gpu-only")
        await publish(e.publisher(), items)
        await applied(sub, 199)
        assert observed == [(RANK, b.ts) for b in items]
        assert stores == {BlockStored if reads_tokens else StoredHashes}
        series = ("kvindex_ingest_batches_total", {"engine": "e", "dp_rank": "0"})
        assert REGISTRY.get_sample_value(*series) >= len(items)
        await registry.remove("e")
        assert await store.ranks() == []
        assert REGISTRY.get_sample_value(*series) is None
        with pytest.raises(UnknownEngine):
            sub.rank_status("e")
    finally:
        await sub.stop()
    assert not sub.running()


async def test_engine_connects_to_a_binding_subscriber(engine) -> None:
    """``bind: true``: kvindex binds the SUB socket, the engine's PUB connects."""
    e = engine()
    spec = msgspec.structs.replace(e.spec, bind=True)
    store = MemoryStore()
    sub = await consuming(store, spec)
    try:
        pub = Publisher(spec.endpoint, spec.replay_endpoint, bind=False)
        e.publishers.append(pub)
        await publish(pub, trace_batches("chat-placeholders"))
        await applied(sub, 199)
    finally:
        await sub.stop()
    await assert_matches_trace(store, RANK, "chat-placeholders")
