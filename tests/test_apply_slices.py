"""Applying a burst in slices: a router's query gets through mid-burst, and nothing
applied is lost, doubled, reordered or seen half-applied.

One event loop runs what ``kvindex serve`` runs (the subscriber into a
MemoryStore and the HTTP API under uvicorn); a real publisher sends a
vLLM-granularity trace at once over ZeroMQ, and a real HTTP client asks for
a chain's prefix match once the burst is under way.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import msgspec
import pytest
import uvicorn

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.slices import Slices
from indexer.ingest.sockets import YIELD_EVERY
from indexer.ingest.subscriber import Subscriber
from indexer.stores import ApplyResult, MemoryStore, apply_events
from kvindex.wiring import api_app
from producer import vllm_trace
from producer.publisher import Publisher

from .conftest import free_ports, wait_until
from .test_subscriber import RecordingStore, assert_in_order_once, tuned

RANK = RankId("e", 0)


class BusyStore(RecordingStore):
    """A MemoryStore whose every apply also computes for half a millisecond, as a
    large batch does: the readers outpace it, so the intake never runs dry and only
    the slices give the loop back."""

    async def apply(self, rank: RankId, seq: int, ts: float, ops, *, fence=None) -> ApplyResult:
        until = time.perf_counter() + 0.0005
        while time.perf_counter() < until:
            pass
        return await super().apply(rank, seq, ts, ops, fence=fence)


def _batches() -> tuple[list[bytes], list[int]]:
    """A trace's payloads, and the chain of a prompt it stores halfway through
    (so its match changes while the burst is applied)."""
    trace, _ = vllm_trace.generate(60_000)
    payloads = [payload for _, payload in trace]
    decode = msgspec.msgpack.Decoder(EventBatch).decode
    middle = decode(payloads[len(payloads) // 2]).events
    stored = [e for e in middle if type(e) is BlockStored and e.parent_block_hash is None]
    stored = stored or [e for p in payloads for e in decode(p).events if type(e) is BlockStored]
    return payloads, list(stored[0].block_hashes[:64])


async def _answers_by_prefix(payloads: list[bytes], chain: list[int]) -> list[int]:
    """The rank's GPU hit for ``chain`` after each prefix of the stream (index k: k batches)."""
    store, hits = MemoryStore(), []
    decode = msgspec.msgpack.Decoder(EventBatch).decode
    for seq, payload in enumerate([None, *payloads]):
        if payload is not None:
            await apply_events(store, RANK, seq - 1, decode(payload))
        hits.append(
            getattr((await store.prefix_match(chain, {"e": None})).get(RANK), "gpu_blocks", 0)
        )
    return hits


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def _batches_before_a_query(slices: Slices) -> int:
    """Batches a consumer applied (1 ms each, under ``slices``) from a query's bytes
    reaching a socket, mid-slice, until the handler its read callback starts runs."""
    loop = asyncio.get_running_loop()
    reader, writer = socket.socketpair()
    applied, sent_at, handled_at, handlers = 0, 0, [], []

    async def handle() -> None:
        handled_at.append(applied)

    def read() -> None:  # as uvicorn's read callback starts a request's handler
        reader.recv(1)
        handlers.append(loop.create_task(handle()))

    loop.add_reader(reader, read)
    try:
        while not handled_at:
            _busy(0.001)
            applied += 1
            if applied == 3:  # the first pause opened the slice at batch 1
                writer.send(b"q")
                sent_at = applied
            await slices.pause_if_spent()
    finally:
        loop.remove_reader(reader)
        reader.close()
        writer.close()
    return handled_at[0] - sent_at


async def test_a_query_read_mid_slice_is_handled_before_the_next_slice() -> None:
    # the rest of its slice (3 batches of 1 ms, and one over), not the next slice or
    # two as well (8 to 13 batches here when consumers resumed ahead of the handler)
    assert await _batches_before_a_query(Slices(budget=0.005)) <= 4


@pytest.mark.slow  # a few thousand batches through sockets and an HTTP server
async def test_a_query_is_answered_mid_burst_from_whole_batches() -> None:
    payloads, chain = _batches()
    payloads = payloads * 3  # long enough for several queries to go in mid-burst
    expected_hits = await _answers_by_prefix(payloads, chain)
    base = free_ports(2)
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    publisher = Publisher(
        endpoint, replay, bind=True, max_queue_size=len(payloads), buffer_steps=len(payloads)
    )
    store, registry = BusyStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, tuned(sub_hwm=10 * len(payloads)))
    applied: list[int] = []  # batches applied so far, as the observer counts them
    subscriber.add_observer(lambda rank, batch: applied.append(len(applied)))
    app = api_app(store, registry, subscriber, ApiSettings())
    port = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    await subscriber.start()
    try:
        # its batches repeat: copies counted, as the reference counts them
        spec = EngineSpec("e", endpoint, replay_endpoint=replay, reuse_reports="counted")
        await registry.add(spec)
        await wait_until(lambda: subscriber.rank_status("e")[0].connected, what="connected")
        await wait_until(lambda: server.started, what="uvicorn")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for payload in payloads:
                assert publisher.publish_encoded(payload)
            await wait_until(lambda: len(applied) > 0, timeout=30, what="the burst to start")
            mid_burst, waited = [], []
            while len(applied) < len(payloads) // 2:
                before = len(applied)
                answer = await client.post("/prefix-match", json={"block_hashes": chain})
                after = len(applied)
                assert answer.status_code == 200, answer.text
                (match,) = [m for m in answer.json()["engines"] if m["dp_rank"] == 0]
                # the answer is the state some whole prefix of the stream left: never half a batch
                assert match["gpu_blocks"] in expected_hits[before : after + 1]
                mid_burst.append(after)
                waited.append(after - before)
            await wait_until(lambda: len(applied) == len(payloads), timeout=120, what="the burst")
        assert mid_burst and mid_burst[0] < len(payloads) // 2  # queries got in while applying
        # a query waits for a few batches, not for the readers' whole drain of 64 a turn
        # (what a query waited for before slicing: 64 to 256 batches here)
        assert max(waited) < YIELD_EVERY, waited
        assert subscriber.rank_status("e")[0].applied_seq == len(payloads) - 1
        assert subscriber.rank_status("e")[0].gaps == 0
        assert_in_order_once(store, RANK)
        assert store.asked[RANK] == list(range(len(payloads)))
        reference = MemoryStore()
        decode = msgspec.msgpack.Decoder(EventBatch).decode
        for seq, payload in enumerate(payloads):
            await apply_events(reference, RANK, seq, decode(payload))
        assert await store.block_counts(RANK) == await reference.block_counts(RANK)
        final = await store.prefix_match(chain, {"e": None})
        assert final[RANK].gpu_blocks == expected_hits[-1]
    finally:
        server.should_exit = True
        await serving
        await subscriber.stop()
        publisher.close()
