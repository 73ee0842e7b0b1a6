"""A rank cannot hold more blocks than its bound: the excess is refused, not memory.

Against every store (the subscriber only uses the Store protocol's counts
and clears): a rank past its bound on a medium has that medium cleared and
its events there dropped, counted and degraded, until the engine restarts.
And a real ``kvindex serve`` fed 110,000 fresh hashes a batch (what made a
rank reach 26.8 M GPU blocks and 2.3 GB in 15 s) stays within its bound.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from indexer.core.events import CPU, GPU, BlockStored, EventBatch, RankId
from indexer.engine_registry import degraded_reasons, is_degraded
from indexer.ingest.capacity import OVER_CAPACITY
from indexer.stores import MemoryStore
from producer.publisher import Publisher

from .conftest import free_ports, wait_until
from .served import memory, poll, reset_peak, serve
from .test_e2e import until
from .test_subscriber import Engine, applied, consuming, publish, status, tuned

MB = 1 << 20
RANK = RankId("e", 0)


def stores(first: int, count: int, ts: float, medium: str | None = None) -> EventBatch:
    """A batch storing ``count`` fresh hashes from ``first`` on one medium."""
    event = BlockStored(list(range(first, first + count)), block_size=16, medium=medium)
    return EventBatch(ts, [event], 0)


async def test_a_rank_past_its_bound_is_cleared_and_refused_until_its_engine_restarts(
    store,
) -> None:
    e = Engine(replay=False)
    spec = msgspec.structs.replace(e.spec, gpu_blocks=100)  # GPU bound: 200 blocks
    sub = await consuming(store, spec, settings=tuned(max_blocks=1000))
    try:
        pub = e.publisher()
        await wait_until(lambda: status(sub).connected, what="connected")
        await publish(pub, [stores(0, 150, 1000.0)])
        await applied(sub, 0)
        assert (await store.block_counts(RANK))[GPU] == 150 and not status(sub).over_capacity
        await publish(pub, [stores(1000, 100, 1001.0)])  # 250 blocks: over
        await applied(sub, 1)  # then counted exactly in the store, and refused
        await wait_until(lambda: status(sub).over_capacity is not None, what="the refusal")
        st = status(sub)
        assert st.over_capacity == "GPU held 250 blocks, over 200"
        assert is_degraded(st) and "over capacity: GPU held 250 blocks, over 200" in (
            degraded_reasons(st)
        )

        async def cleared() -> bool:  # flagged first, then cleared: one store call later
            return (await store.block_counts(RANK))[GPU] == 0

        await until(cleared, 30, "the refused GPU blocks to be cleared")
        await publish(pub, [stores(2000, 10, 1002.0), stores(3000, 10, 1003.0, "cpu")])
        await applied(sub, 3)
        counts = await store.block_counts(RANK)
        assert (counts[GPU], counts[CPU]) == (0, 10)  # GPU refused, CPU within its bound
        assert status(sub).rejected == {OVER_CAPACITY: 2}  # the bound passed, a batch dropped

        pub.close()
        await wait_until(lambda: not status(sub).connected, what="disconnected")
        restarted = e.publisher()  # seq 0 again, newer batches
        await wait_until(lambda: status(sub).connected, what="connected again")
        await publish(restarted, [stores(4000, 20, 2000.0)])
        await wait_until(lambda: status(sub).restarts == 1, what="the restart")
        await applied(sub, 0)
        st = status(sub)
        assert st.over_capacity is None and not is_degraded(st)
        assert (await store.block_counts(RANK))[GPU] == 20
    finally:
        await sub.stop()
        e.close()


BATCH = 110_000  # fresh hashes per batch
BATCHES = 30
GPU_BLOCKS = 150_000  # the engine's declared capacity: its GPU bound is twice that
#: Batches applied before the bound is passed (by the third: 330,000 blocks).
WITHIN = 2
#: The server's growth besides the bound's blocks: a batch in hand (its payload
#: and decoded hashes, ~12 MB), allocator slack.
SLACK = 48 * MB
#: What 2 x GPU_BLOCKS blocks of 32-byte hashes cost the embedded store, at most
#: (measured: ~160 bytes a block).
BOUND_BYTES = 2 * GPU_BLOCKS * 200


def flood_batch(seq: int) -> EventBatch:
    hashes = os.urandom(32 * BATCH)
    digests = [hashes[i : i + 32] for i in range(0, len(hashes), 32)]
    return EventBatch(1000.0 + seq, [BlockStored(digests, block_size=16)], 0)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 30 floods, each answered when a busy machine gets to it
def test_fresh_hashes_every_batch_cost_the_bound_not_memory(tmp_path: Path) -> None:
    pub = free_ports()
    config = tmp_path / "kvindex.yaml"
    config.write_text(
        f"engines:\n  - name: e\n    endpoint: tcp://127.0.0.1:{pub}\n"
        f"    gpu_blocks: {GPU_BLOCKS}\n"
    )
    engine = Publisher(f"tcp://127.0.0.1:{pub}", bind=True, buffer_steps=1)
    try:
        with serve(config) as (port, pid):
            rank = lambda ready, what: poll(  # noqa: E731
                port, "/engines/e", lambda engine: ready(engine["ranks"][0]), what
            )["ranks"][0]
            rank(lambda st: st["connected"], "the engine's connection")
            before = reset_peak(pid)
            for seq in range(BATCHES):  # paced: each applied before the next is sent
                engine.publish(flood_batch(seq))
                rank(lambda st, seq=seq: st["applied_seq"] == seq, f"seq {seq} applied")
            grew = memory(pid, "VmHWM") - before
            left = memory(pid, "VmRSS") - before
            st = rank(lambda st: True, "the rank's state")
    finally:
        engine.close()
    assert grew < BOUND_BYTES + SLACK, (
        f"peak grew {grew / MB:.0f} MB for {BATCHES} batches of {BATCH} fresh hashes; the"
        f" bound ({2 * GPU_BLOCKS} blocks) costs at most {BOUND_BYTES / MB:.0f} MB"
        f" (+{SLACK / MB:.0f} MB slack)"
    )
    # What the rank held is cleared and its room given back: the store's tables
    # shrink and the allocator returns the pages (measured: 18 MB of a 78 MB peak
    # left; 56-58 MB before either)
    assert left < grew / 2, f"{left / MB:.0f} of {grew / MB:.0f} MB still held once refused"
    assert st["over_capacity"] and st["degraded_reasons"], st
    assert st["rejected"][OVER_CAPACITY] == BATCHES - WITHIN  # the bound passed, then each dropped
    assert st["blocks"]["GPU"] == 0


class CountingStore(MemoryStore):
    """A MemoryStore that counts the exact counts it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def block_counts(self, rank: RankId) -> dict[str, int]:
        self.asked += 1
        return await super().block_counts(rank)


async def test_the_store_is_asked_only_when_the_bound_may_have_passed() -> None:
    e = Engine(replay=False)
    spec = msgspec.structs.replace(e.spec, gpu_blocks=500)  # GPU bound: 1,000 blocks
    store = CountingStore()
    sub = await consuming(store, spec)
    try:
        pub = e.publisher()
        await wait_until(lambda: status(sub).connected, what="connected")
        # 150 batches storing 10 hashes each, the same 400 over and over: a full cache
        await publish(pub, [stores(seq % 40 * 10, 10, 1000.0 + seq) for seq in range(150)])
        await applied(sub, 149)
        # at the first batch (10 blocks); then when the hashes stored since could make
        # it over 1,000 (10 + 10 x 100: it holds 400); not again (400 + 490)
        assert store.asked == 2
        assert not status(sub).over_capacity
    finally:
        await sub.stop()
        e.close()
