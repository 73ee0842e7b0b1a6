"""A misbehaving engine cannot exhaust the consumer's memory.

Each scenario runs the engine in a process of its own (:mod:`tests.flood`)
over real ZMQ sockets and reads this process's peak resident memory (VmHWM,
reset before the scenario). Unbounded, the 200 MB frame costs twice its
size, the 500 batches of 1 MB sent faster than a slow store applies them
as much as ZeroMQ queues (all of them), and the replay flood 1.5 GB;
bounded, each stays within what its settings promise, the state is exact
but for the lost seqs, and those are reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import REGISTRY

from indexer.core.events import GPU, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.rank_consumer import RankConsumer
from indexer.ingest.settings import SubscriberSettings
from indexer.ingest.subscriber import Subscriber
from indexer.stores import MemoryStore

from . import flood
from .conftest import free_ports, wait_until
from .test_subscriber import FAST, SlowStore

MB = 1 << 20
RANK = RankId("e", 0)
ROOT = Path(__file__).resolve().parents[1]


def memory(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since :func:`reset_peak`) of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Start measuring the peak from now; the resident memory now."""
    Path("/proc/self/clear_refs").write_text("5")
    return memory("VmRSS")


@contextlib.asynccontextmanager
async def engine_process(scenario: str, pub: int, replay: int) -> AsyncIterator[None]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "tests.flood", scenario, str(pub), str(replay)),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,  # it ends when this closes, even if the test dies
    )
    try:
        yield
    finally:
        proc.kill()
        await proc.wait()


def spec(pub: int, replay: int | None) -> EngineSpec:
    return EngineSpec(
        "e",
        f"tcp://127.0.0.1:{pub}",
        replay_endpoint=None if replay is None else f"tcp://127.0.0.1:{replay}",
    )


async def consume(store, engine: EngineSpec, **settings) -> tuple[Subscriber, EngineRegistry]:
    registry = EngineRegistry()
    await registry.add(engine)
    sub = Subscriber(store, registry, msgspec.structs.replace(FAST, **settings))
    await sub.start()
    return sub, registry


async def applied(sub: Subscriber, seq: int) -> None:
    await wait_until(lambda: sub.rank_status("e")[0].applied_seq == seq, 120, f"seq {seq}")


async def test_a_frame_over_the_size_limit_is_never_read() -> None:
    pub = free_ports()
    store = MemoryStore()
    sub, _ = await consume(store, spec(pub, None))
    try:
        before = reset_peak()
        async with engine_process("oversize", pub, 0):
            await applied(sub, 19)
        grew = memory("VmHWM") - before
        st = sub.rank_status("e")[0]
    finally:
        await sub.stop()
    assert grew < 100 * MB, f"peak grew {grew / MB:.0f} MB for a 200 MB frame"
    assert st.degraded and [(g.first, g.last) for g in st.missing] == [(10, 10)]
    assert (await store.block_counts(RANK))[GPU] == 19  # every batch but the oversize one


def oversize_count() -> float:
    labels = {"engine": "e", "dp_rank": "0", "reason": "oversize"}
    return REGISTRY.get_sample_value("kvindex_ingest_rejected_frames_total", labels) or 0.0


def disconnections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.reason for r in caplog.records if r.getMessage() == "rank disconnected"]


async def test_an_oversize_frame_is_a_rejected_frame_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """libzmq reports only a disconnection: the rank says why, and counts it, while a
    publisher that merely closes is neither counted nor blamed."""
    caplog.set_level(logging.INFO, "kvindex.subscriber")
    pub, before = free_ports(), oversize_count()
    ctx = zmq.asyncio.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.bind(f"tcp://127.0.0.1:{pub}")
    sub, _ = await consume(MemoryStore(), spec(pub, None), max_message_bytes=4096)
    try:
        assert await xpub.recv() == b"\x01"  # subscribed
        await xpub.send_multipart(flood._frame(0, flood.batch(0, 8192)))
        await wait_until(lambda: sub.rank_status("e")[0].rejected, 10, "the frame counted")
        assert sub.rank_status("e")[0].rejected == {"oversize": 1}
        assert oversize_count() == before + 1
        assert disconnections(caplog) == [
            "ZeroMQ dropped the publisher for breaking the protocol, most likely with a frame"
            " over max_message_bytes (4096 bytes)"
        ]
        await wait_until(lambda: sub.rank_status("e")[0].connected, 10, "reconnected")
        xpub.close(linger=0)
        await wait_until(lambda: not sub.rank_status("e")[0].connected, 10, "closed")
        assert sub.rank_status("e")[0].rejected == {"oversize": 1}
        assert oversize_count() == before + 1
        assert disconnections(caplog)[1:] == ["the publisher closed the connection"]
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


#: Limits small beside the 500 MB the engine sends, so that a queue they miss shows.
HELD_LIMITS = {
    "intake_bytes": 32 * MB,
    "pending_bytes": 32 * MB,
    "max_message_bytes": 2 * MB,
    "queue_bytes": 16 * MB,
}
#: The interpreter's own growth while it consumes (allocator slack, the decoded batch).
SLACK = 64 * MB


def promised(settings: SubscriberSettings) -> int:
    """The bytes of received batches a rank may hold, as the settings' docstring
    states it: the intake, the held batches and ZeroMQ's queue, each up to its
    limit plus one message, and the two readers' and the sequencer's in hand."""
    queued = settings.receive_hwm(settings.sub_hwm) * settings.max_message_bytes
    over = 6 * settings.max_message_bytes
    return settings.intake_bytes + settings.pending_bytes + queued + over


@pytest.mark.slow
async def test_batches_held_behind_a_gap_are_bounded_in_bytes() -> None:
    pub, replay = free_ports(), free_ports()  # nothing listens on the replay port
    # The store is slower than the engine: the readers pause on a full intake, and
    # ZeroMQ's I/O thread queues what keeps coming until its high-water mark.
    store = SlowStore()
    last = 5 + flood.HELD
    sub, _ = await consume(store, spec(pub, replay), **HELD_LIMITS, replay_timeout=60.0)
    try:
        before = reset_peak()
        async with engine_process("held", pub, replay):
            await applied(sub, last)
        grew = memory("VmHWM") - before
        st = sub.rank_status("e")[0]
    finally:
        await sub.stop()
    bound = promised(SubscriberSettings(**HELD_LIMITS))
    assert grew < bound + SLACK, (
        f"peak grew {grew / MB:.0f} MB for 500 MB of batches; the settings promise"
        f" {bound / MB:.0f} MB (+{SLACK / MB:.0f} MB slack)"
    )
    assert st.degraded and [(g.first, g.last) for g in st.missing] == [(5, 5)]
    assert (await store.block_counts(RANK))[GPU] == last  # 0-4 and 6-505: nothing else lost
    assert [r.count for r in await store.block_residency(last + 1)] == [1]


def test_zeromq_queues_at_most_queue_bytes_of_the_largest_messages() -> None:
    assert SubscriberSettings(**HELD_LIMITS).receive_hwm(10_000) == 8  # 16 MB of 2 MB
    assert SubscriberSettings().receive_hwm(10_000) == 16  # 1 GiB of 64 MiB
    assert SubscriberSettings(queue_bytes=MB).receive_hwm(100) == 1  # one fits always
    assert SubscriberSettings(max_message_bytes=MB).receive_hwm(100) == 100  # the cap
    assert SubscriberSettings(max_message_bytes=MB).receive_hwm(0) == 1024  # no cap


@pytest.mark.slow
async def test_a_replay_flood_is_bounded_and_an_engine_removed_frees_it() -> None:
    pub, replay = free_ports(), free_ports()
    store = SlowStore()  # the store is slower than the flood: it must wait somewhere
    sub, registry = await consume(store, spec(pub, replay), replay_timeout=1.0)
    try:
        before = reset_peak()
        async with engine_process("flood", pub, replay):
            await applied(sub, flood.FLOOD - 1)
            grew = memory("VmHWM") - before
            st = sub.rank_status("e")[0]
            assert (await store.block_counts(RANK))[GPU] == flood.FLOOD
            await registry.remove("e")  # what DELETE /engines/e does
        gc.collect()
        left = memory("VmRSS") - before
        consumers = [o for o in gc.get_objects() if isinstance(o, RankConsumer)]
    finally:
        await sub.stop()
    assert grew < 600 * MB, f"peak grew {grew / MB:.0f} MB for a 1.5 GB replay answer"
    assert not st.degraded and st.gaps_unfilled == 0
    assert consumers == []  # nothing keeps the consumer, its queues or its held batches
    assert left < 100 * MB, f"{left / MB:.0f} MB still held after the engine was removed"
