"""The subscriber over real ZMQ sockets, against kvindex's vLLM-wire publisher.

Every scenario ends with the store equal to what the events say: vLLM's own
final refcounts for a whole fixture trace, or a MemoryStore into which the
batches that should count were applied directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
from collections.abc import Iterable, Sequence

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from indexer.core.events import CPU, GPU, BlockStored, EventBatch, RankId, WireError
from indexer.engines.vllm.wire import (
    STORED,
    StoredHashes,
    batch_ts,
    decode_batch,
    encode_batch,
)
from indexer.engines.zmq_framing import split_replay
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.ingest.trace import load_trace
from indexer.registry import EngineRegistry, EngineSpec, UnknownEngine
from indexer.stores import ApplyResult, MemoryStore, StoreUnavailable, apply_events
from producer.publisher import Publisher

from .conftest import (
    FIXTURES,
    assert_matches_trace,
    free_ports,
    trace_batches,
    trace_path,
    wait_until,
)

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


@pytest.fixture
def engine():
    made: list[Engine] = []

    def make(**kw) -> Engine:
        made.append(Engine(**kw))
        return made[-1]

    yield make
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


async def test_late_start_catches_up_by_replay(engine) -> None:
    items = trace_batches("chat-sha256", "chat-gpu-only")
    e = engine()
    pub = e.publisher()
    await publish(pub, items[:300])
    store = RecordingStore()
    sub = await consuming(store, e.spec)
    try:
        await applied(sub, 299)
        await publish(pub, items[300:])
        await applied(sub, len(items) - 1)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.replays >= 1 and not st.degraded and st.gaps_unfilled == 0
    assert_in_order_once(store, RANK)
    await assert_same(store, await reference(RANK, enumerate(items)), RANK, items)


async def test_gap_filled_by_replay(engine) -> None:
    e = engine()
    pub = e.publisher(drop_live={100, 101, 102, 180})
    store = RecordingStore()
    sub = await consuming(store, e.spec)
    try:
        # Live from the start: the catch-up replay has been answered, and found nothing.
        await wait_until(lambda: status(sub).connected and pub.replays_served >= 1)
        await publish(pub, trace_batches("chat-sha256"))
        await applied(sub, 249)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.gaps_filled >= 1 and st.gaps_unfilled == 0 and not st.degraded
    assert st.gaps == st.gaps_filled and st.missing == []
    assert_in_order_once(store, RANK)
    await assert_matches_trace(store, RANK, "chat-sha256")


async def test_gap_replay_cannot_fill(engine) -> None:
    items = trace_batches("chat-sha256")
    e = engine()
    pub = e.publisher(holes={120, *range(150, 170)})
    store = RecordingStore()
    sub = await consuming(store, e.spec, settings=tuned(gap_clear_threshold=10))
    try:
        await publish(pub, items)
        await applied(sub, 249)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.degraded and st.gaps_unfilled == 2
    assert [(g.first, g.last) for g in st.missing] == [(120, 120), (150, 169)]
    seqs = list(enumerate(items))
    steps = [*seqs[:120], *seqs[121:150], CLEAR, *seqs[170:]]
    await assert_same(store, await reference(RANK, steps), RANK, items)


async def test_replay_short_after_indexer_restart(engine) -> None:
    """Down while the engine's buffer rolled over: the rest is degraded, GPU/CPU cleared."""
    items = trace_batches("chat-sha256")
    e = engine()
    pub = e.publisher(buffer_steps=100)
    store = RecordingStore()
    sub = await consuming(store, e.spec)
    await publish(pub, items[:100])
    await applied(sub, 99)
    await sub.stop()
    await publish(pub, items[100:])  # the buffer now holds 150..249 only
    sub = await consuming(store, e.spec, settings=tuned(gap_clear_threshold=10))
    try:
        await applied(sub, 249)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.degraded and [(g.first, g.last) for g in st.missing] == [(100, 149)]
    assert_in_order_once(store, RANK)
    seqs = list(enumerate(items))
    expected = await reference(RANK, [*seqs[:100], CLEAR, *seqs[150:]])
    await assert_same(store, expected, RANK, items)


async def test_engine_restart_while_consuming(engine) -> None:
    e = engine()
    first = e.publisher()
    store = MemoryStore()
    sub = await consuming(store, e.spec)
    try:
        await publish(first, trace_batches("chat-sha256"))
        await applied(sub, 249)
        first.close()
        await publish(e.publisher(), trace_batches("chat-clear"))  # numbers from 0 again
        await wait_until(lambda: status(sub).restarts == 1 and status(sub).applied_seq == 200)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.restarts == 1 and not st.degraded
    await assert_matches_trace(store, RANK, "chat-clear")


@pytest.mark.slow
@pytest.mark.parametrize(
    "second",
    [("chat-clear",), ("chat-placeholders", "chat-clear")],
    ids=["fewer-batches-than-applied", "more-batches-than-applied"],
)
async def test_engine_restarted_while_indexer_down(engine, second: tuple[str, ...]) -> None:
    """Only replay can tell: it lacks the last applied seq, or has it with a newer ts."""
    e = engine()
    store = MemoryStore()
    sub = await consuming(store, e.spec)
    first = e.publisher()
    await publish(first, trace_batches("chat-sha256"))
    await applied(sub, 249)
    await sub.stop()
    first.close()
    items = trace_batches(*second)
    await publish(e.publisher(), items)
    sub = await consuming(store, e.spec)
    try:
        await applied(sub, len(items) - 1)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.restarts == 1
    await assert_same(store, await reference(RANK, enumerate(items)), RANK, items)


async def test_two_dp_ranks(engine) -> None:
    """Port + rank for both sockets, a seq stream each; one replay slot for both."""
    e = engine(dp_ranks=2)
    traces = ("chat-sha256", "chat-gpu-only")
    store = RecordingStore()
    sub = await consuming(store, e.spec, settings=tuned(max_concurrent_replays=1))
    try:
        publishers = [e.publisher(dp_rank, drop_live={40, 41, 90}) for dp_rank in (0, 1)]
        for publisher, name in zip(publishers, traces, strict=True):
            await publish(publisher, trace_batches(name))
        await applied(sub, 249, dp_rank=0)
        await applied(sub, 199, dp_rank=1)
        statuses = sub.rank_status("e")
    finally:
        await sub.stop()
    assert [s.dp_rank for s in statuses] == [0, 1]
    assert all(s.gaps_unfilled == 0 and not s.degraded for s in statuses)
    for dp_rank, name in enumerate(traces):
        assert_in_order_once(store, RankId("e", dp_rank))
        await assert_matches_trace(store, RankId("e", dp_rank), name)


async def test_duplicate_live_and_replay_delivery(engine) -> None:
    """A replay overlaps batches already received live; each seq is applied once."""
    items = trace_batches("chat-sha256")
    e = engine()
    pub = e.publisher(drop_live={200})
    store = RecordingStore()
    # No idle probes: one landing between 200 and 201 would fetch 200 before the
    # overlap this test is about (a clean catch-up, no duplicate to see).
    sub = await consuming(store, e.spec, settings=tuned(probe_interval=0))
    try:
        await publish(pub, items[:200])
        await applied(sub, 199)
        await publish(pub, items[200:])  # 201 arrives live first, then replay from 199 on
        await applied(sub, 249)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.duplicates >= 1 and st.gaps_unfilled == 0 and not st.degraded
    assert_in_order_once(store, RANK)
    await assert_matches_trace(store, RANK, "chat-sha256")


async def test_malformed_frames_are_counted_and_skipped(engine) -> None:
    """Wrong frame counts, short seqs and garbage payloads between good frames."""
    e = engine(replay=False)
    store = MemoryStore()
    ctx = zmq.asyncio.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.bind(e.spec.endpoint)
    sub = await consuming(store, e.spec)
    try:
        assert (await asyncio.wait_for(xpub.recv(), 5)) == b"\x01"  # subscribed to every topic
        for seq, (_, payload) in enumerate(load_trace(trace_path("chat-gpu-only"))):
            seq8 = seq.to_bytes(8, "big")
            if seq % 20 == 0:
                await xpub.send_multipart([b"", seq8])
                await xpub.send_multipart([b"", seq8, payload, b""])
                await xpub.send_multipart([b"", seq8[:4], payload])
                await xpub.send_multipart([b"", seq8, b"\xc1 garbage"])
            await xpub.send_multipart([b"", seq8, payload])
        await applied(sub, 199)
        st = status(sub)
    finally:
        await sub.stop()
        ctx.destroy(linger=0)
    assert st.rejected == {"frame_count": 20, "bad_seq": 10, "bad_payload": 10}
    assert not st.degraded and st.gaps == 0
    await assert_matches_trace(store, RANK, "chat-gpu-only")


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


class SlowStore(MemoryStore):
    async def apply(self, rank: RankId, seq: int, ts: float, ops, *, fence=None) -> ApplyResult:
        await asyncio.sleep(0.002)
        return await super().apply(rank, seq, ts, ops, fence=fence)


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


@pytest.mark.parametrize("replay", ["silent", "none"])
async def test_gap_without_replay_answer(engine, replay: str) -> None:
    """A replay endpoint nobody answers (bounded attempts), or none at all."""
    items = trace_batches("chat-gpu-only")
    e = engine(replay=replay == "silent")
    pub = Publisher(e.spec.endpoint, bind=True, drop_live={50})
    e.publishers.append(pub)
    store = RecordingStore()
    settings = tuned(replay_timeout=0.1, replay_attempts=2)
    sub = await consuming(store, e.spec, settings=settings)
    try:
        await wait_until(lambda: status(sub).connected, what="connected")
        await publish(pub, items)
        await applied(sub, 199)
        st = status(sub)
    finally:
        await sub.stop()
    assert st.degraded and [(g.first, g.last) for g in st.missing] == [(50, 50)]
    assert st.gaps_unfilled == 1
    assert st.replays == 0 if replay == "none" else st.replays >= 2
    seqs = list(enumerate(items))
    await assert_same(store, await reference(RANK, seqs[:50] + seqs[51:]), RANK, items)


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


@pytest.mark.parametrize(
    "frames, expected",
    [
        ([b"", (7).to_bytes(8, "big"), b"p"], (7, b"p")),  # vLLM 0.33
        ([b"", b"topic", (7).to_bytes(8, "big"), b"p"], (7, b"p")),  # with the topic
        ([b"", b"\xff" * 8, b""], (None, b"")),  # vLLM's end marker
        ([b"", b"", b"\xff" * 8, b""], (None, b"")),  # DESIGN's end marker
    ],
)
def test_replay_answer_shapes(frames, expected) -> None:
    assert split_replay(frames) == expected


@pytest.mark.parametrize(
    "frames, reason",
    [([b""], "replay_frame_count"), ([b"", b"\x00\x07", b"p"], "bad_seq")],
)
def test_bad_replay_answers(frames, reason) -> None:
    with pytest.raises(WireError) as e:
        split_replay(frames)
    assert e.value.reason == reason


def test_batch_ts_reads_the_header_or_decodes() -> None:
    for _, payload in load_trace(trace_path("chat-clear"))[:20]:
        assert batch_ts(payload) == decode_batch(payload).ts
    legacy = (FIXTURES / "wire" / "legacy_positional.msgpack").read_bytes()
    assert batch_ts(legacy) == decode_batch(legacy).ts
    with pytest.raises(WireError):
        batch_ts(b"\x93\xcb\x00")


async def test_garbage_from_replay_is_given_up(engine) -> None:
    """An engine whose replay copy of a lost seq is garbage: bounded retries, then a hole."""
    items = trace_batches("chat-gpu-only")[:40]
    payloads = [encode_batch(b) for b in items]
    e = engine()
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(e.spec.endpoint)
    router.bind(e.spec.replay_endpoint)

    async def answer_replays() -> None:
        while True:
            peer, _, start = await router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(payloads)):
                payload = b"\x93\xcb" + bytes(8) + b"garbage" if seq == 10 else payloads[seq]
                await router.send_multipart([peer, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([peer, b"", b"\xff" * 8, b""])

    answering = asyncio.create_task(answer_replays())
    store = MemoryStore()
    sub = await consuming(store, e.spec)
    try:
        await wait_until(lambda: status(sub).connected, what="connected")
        for seq, payload in enumerate(payloads):
            if seq != 10:  # lost live
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        await applied(sub, 39)
        st = status(sub)
    finally:
        await sub.stop()
        answering.cancel()
        ctx.destroy(linger=0)
    assert [(g.first, g.last) for g in st.missing] == [(10, 10)]
    assert st.rejected["bad_payload"] >= FAST.replay_attempts
    seqs = list(enumerate(items))
    await assert_same(store, await reference(RANK, seqs[:10] + seqs[11:]), RANK, items)


def retimed(items: list[EventBatch], start: float = 1000.0) -> list[EventBatch]:
    """The batches one second apart, so a test can place a ts between two of them."""
    return [msgspec.structs.replace(b, ts=start + i) for i, b in enumerate(items)]


def garbage_with_ts(ts: float) -> bytes:
    """A payload whose header is a valid batch ts and whose body is not a batch."""
    return b"\x93\xcb" + struct.pack(">d", ts) + b"garbage"


async def test_garbage_behind_a_valid_ts_changes_nothing(engine) -> None:
    """Live garbage with a plausible ts must pass neither for a restart (a seq already
    applied, newer) nor for the newest seq seen (a seq ahead, then the real next one)."""
    items = retimed(trace_batches("chat-gpu-only")[:40])
    payloads = [encode_batch(b) for b in items]
    e = engine(replay=False)
    ctx = zmq.asyncio.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.bind(e.spec.endpoint)
    store = MemoryStore()
    sub = await consuming(store, e.spec)
    try:
        assert (await asyncio.wait_for(xpub.recv(), 5)) == b"\x01"
        for seq, payload in enumerate(payloads):
            if seq == 10:
                between = items[9].ts + 0.5
                await xpub.send_multipart([b"", (5).to_bytes(8, "big"), garbage_with_ts(between)])
                await xpub.send_multipart([b"", (30).to_bytes(8, "big"), garbage_with_ts(between)])
            await xpub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        await applied(sub, 39)
        st = status(sub)
    finally:
        await sub.stop()
        ctx.destroy(linger=0)
    assert st.rejected == {"bad_payload": 2}
    assert (st.restarts, st.gaps, st.degraded, st.last_seq) == (0, 0, False, 39)
    await assert_same(store, await reference(RANK, enumerate(items)), RANK, items)


@pytest.mark.parametrize("answer", ["undecodable", "anchor with a newer ts"])
async def test_a_garbage_replay_answer_is_no_restart(engine, answer: str) -> None:
    """The catch-up replay from a watermark answered with garbage only: an engine
    restart would wipe the rank; garbage must be counted and ignored instead."""
    items = retimed(trace_batches("chat-gpu-only")[:20])
    store = MemoryStore()
    for seq, batch in enumerate(items[:10]):
        await apply_events(store, RANK, seq, batch)
    before = await store.block_counts(RANK)
    e = engine()
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(e.spec.endpoint)
    router.bind(e.spec.replay_endpoint)
    starts: list[int] = []

    async def answer_with_garbage() -> None:
        while True:
            peer, _, start = await router.recv_multipart()
            starts.append(int.from_bytes(start, "big"))
            if answer == "undecodable":
                frames = [[b"\x00\x09", b"p"], [(9).to_bytes(8, "big"), b"\xc1 garbage"]]
            else:
                frames = [[(9).to_bytes(8, "big"), garbage_with_ts(items[9].ts + 100)]]
            for frame in frames:
                await router.send_multipart([peer, b"", *frame])
            await router.send_multipart([peer, b"", b"\xff" * 8, b""])

    answering = asyncio.create_task(answer_with_garbage())
    sub = await consuming(store, e.spec)
    try:
        await wait_until(lambda: len(starts) >= 2, what="two replay requests")  # one answered
        st = status(sub)
        assert (st.restarts, st.applied_seq) == (0, 9)
        assert starts[:2] == [9, 9]  # asked from the last applied seq itself, both times
        assert await store.block_counts(RANK) == before
        for seq, batch in enumerate(items[10:], start=10):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch)])
        await applied(sub, 19)
        st = status(sub)
    finally:
        await sub.stop()
        answering.cancel()
        ctx.destroy(linger=0)
    assert st.restarts == 0 and not st.degraded
    assert sum(st.rejected.values()) >= 2
    await assert_same(store, await reference(RANK, enumerate(items)), RANK, items)


@pytest.mark.slow
async def test_unanswered_probes_back_off(engine, caplog) -> None:
    """A replay endpoint that never answers: each unanswered request doubles the wait
    before the next probe, and the timeout is logged once, not at every probe."""
    e = engine()
    pub = Publisher(e.spec.endpoint, bind=True)  # live, but nothing answers replay
    e.publishers.append(pub)
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(e.spec.replay_endpoint)
    asked: list[float] = []

    async def never_answer() -> None:
        while True:
            await router.recv_multipart()
            asked.append(asyncio.get_running_loop().time())

    listening = asyncio.create_task(never_answer())
    settings = tuned(replay_timeout=0.1, probe_interval=0.2, probe_backoff_max=30.0)
    with caplog.at_level(logging.INFO, logger="kvindex.subscriber"):
        sub = await consuming(MemoryStore(), e.spec, settings=settings)
        try:
            await asyncio.sleep(4.0)
        finally:
            await sub.stop()
            listening.cancel()
            ctx.destroy(linger=0)
    # Three catch-up attempts, then probes 0.2 s x 2^3, x 2^4 ... apart: at most two more.
    # Unbounded, a probe went out every 0.3 s: a dozen.
    assert 3 <= len(asked) <= 5, asked
    timeouts = [r for r in caplog.records if r.getMessage() == "replay timed out"]
    assert [r.levelno for r in timeouts].count(logging.INFO) == 1
