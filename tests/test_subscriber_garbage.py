"""The subscriber against malformed frames and garbage payloads, live and in replay
answers, since bytes from the network must never corrupt the store nor pass for an
engine restart: each is counted and skipped, or leaves a known hole."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest
import zmq
import zmq.asyncio

from indexer.core.events import EventBatch, WireError
from indexer.engines.vllm.wire import batch_ts, decode_batch, encode_batch
from indexer.engines.zmq_framing import split_replay
from indexer.ingest.trace import load_trace
from indexer.stores import MemoryStore, apply_events

from .conftest import FIXTURES, assert_matches_trace, trace_batches, trace_path, wait_until
from .subscriber_kit import FAST, RANK, applied, assert_same, consuming, engines, reference, status


@pytest.fixture
def engine():
    with engines() as make:
        yield make


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
