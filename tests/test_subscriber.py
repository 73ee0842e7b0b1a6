"""The subscriber over real ZMQ sockets, against kvindex's vLLM-wire publisher.

Every scenario ends with the store equal to what the events say: vLLM's own
final refcounts for a whole fixture trace, or a MemoryStore into which the
batches that should count were applied directly.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio

from indexer.core.events import RankId
from indexer.stores import MemoryStore
from producer.publisher import Publisher

from .conftest import assert_matches_trace, trace_batches, wait_until
from .subscriber_kit import (
    CLEAR,
    RANK,
    RecordingStore,
    applied,
    assert_in_order_once,
    assert_same,
    consuming,
    engines,
    publish,
    reference,
    status,
    tuned,
)

# Other test modules (test_many_ranks, test_metrics, ...) import the subscriber's helpers
# from here; those this module does not use itself are re-exported by name.
from .subscriber_kit import FAST as FAST
from .subscriber_kit import Engine as Engine
from .subscriber_kit import SlowStore as SlowStore


@pytest.fixture
def engine():
    with engines() as make:
        yield make


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
