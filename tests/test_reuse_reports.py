"""Reuse reports on vLLM's own wire: never a phantom, over real ZMQ sockets.

A request asking vLLM for a reuse report makes it announce each GPU block it
reused as a ``BlockStored`` shaped like a new copy, and no removal follows. An
engine registered without kvindex's plugin gets ``reuse_reports: capped``: a
GPU block holds at most one reference, so the eviction of its copy ends it.
"""

from __future__ import annotations

import msgspec
import pytest

from indexer.core.events import GPU, BlockRemoved, BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineSpec
from indexer.stores import MemoryStore

from .test_subscriber import Engine, applied, consuming, publish

CHAIN = [11, 12, 13, 14, 15, 16, 17, 18, 19]
RANK = RankId("e", 0)


def prompt_stored(hashes: list[int]) -> BlockStored:
    """A prompt's blocks as vLLM announces them: a new store and a reuse report alike."""
    tokens = list(range(len(hashes) * 32))
    return BlockStored(hashes, None, tokens, 32, None, GPU)


def evicted(hashes: list[int]) -> list[BlockRemoved]:
    """One removal per evicted hash, as vLLM's block pool sends them."""
    return [BlockRemoved([h], GPU) for h in hashes]


def reported_then_evicted() -> list[EventBatch]:
    """The prefix stored once, reported by four reused turns, then evicted."""
    stores = [prompt_stored(CHAIN)] * 5
    return [EventBatch(float(t), [event], 0) for t, event in enumerate(stores)] + [
        EventBatch(9.0, evicted(CHAIN), 0)
    ]


async def gpu_prefix_after(items: list[EventBatch], **spec) -> tuple[int, dict]:
    """The GPU prefix of CHAIN and the anomalies once kvindex consumed ``items``."""
    e = Engine()
    e.spec = msgspec.structs.replace(e.spec, **spec)
    store = MemoryStore()
    sub = await consuming(store, e.spec)
    try:
        await publish(e.publisher(), items)
        await applied(sub, len(items) - 1)
    finally:
        await sub.stop()
        e.close()
    found = (await store.prefix_match(CHAIN, {"e": None})).get(RANK)
    return (found.gpu_blocks if found else 0), await store.anomalies(RANK)


def test_an_engine_registered_by_hand_caps_its_reports() -> None:
    assert EngineSpec("e", "tcp://127.0.0.1:1").reuse_reports == "capped"


async def test_a_reported_prefix_ends_with_its_eviction() -> None:
    gpu, anomalies = await gpu_prefix_after(reported_then_evicted(), reuse_reports="capped")
    assert gpu == 0, "a reported prefix outlived its eviction: a phantom"
    assert anomalies.get("unknown_removals", 0) == 0


async def test_counted_reports_leave_the_phantom_capping_prevents() -> None:
    """What kvindex did before ``reuse_reports``: every report counted as a copy."""
    gpu, _ = await gpu_prefix_after(reported_then_evicted(), reuse_reports="counted")
    assert gpu == len(CHAIN)


@pytest.mark.parametrize(("mode", "gpu", "unknown"), [("capped", 0, 2), ("counted", 2, 0)])
async def test_a_second_copy_is_a_counted_miss_when_capped(mode, gpu, unknown) -> None:
    """Two physical copies of a prefix, one evicted: capped misses the other, and
    counts its later eviction as unknown removals; counted keeps it."""
    two = CHAIN[:2]
    copies = EventBatch(1.0, [prompt_stored(two), prompt_stored(two)], 0)
    one_evicted = [copies, EventBatch(2.0, evicted(two), 0)]
    found, _ = await gpu_prefix_after(one_evicted, reuse_reports=mode)
    assert found == gpu
    both = [*one_evicted, EventBatch(3.0, evicted(two), 0)]
    _, anomalies = await gpu_prefix_after(both, reuse_reports=mode)
    assert anomalies.get("unknown_removals", 0) == unknown
