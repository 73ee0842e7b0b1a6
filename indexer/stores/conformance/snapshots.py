"""Restoring a rank from an engine's snapshot, checked once for every store: the
counts, kinds and watermark become the snapshot's, whatever the rank held."""

from __future__ import annotations

from indexer.core.events import CPU, GPU, STORAGE, EventBatch
from indexer.core.residency import RankResidency, plan_batch
from indexer.core.snapshot import NOTHING_PUBLISHED, Snapshot, snapshot_of
from indexer.stores.base import Store, Watermark, apply_snapshot
from indexer.stores.conformance.kit import (
    RANK,
    apply,
    batch,
    blocks,
    check,
    claim,
    expect,
    hit,
    refused,
    removed,
    stored,
    where,
)

CHAIN = list(range(1, 13))
#: What the engine holds when it is asked: GPU copies (two of block 2), chunks of 4 on
#: CPU, a secondary storage tier, and a sliding-window group holding the chain's tail.
HELD = batch(
    stored(CHAIN[:8]),
    stored(CHAIN[1:2]),
    stored(CHAIN[:4], CPU),
    stored(CHAIN[4:8], CPU),
    stored(CHAIN[:4], STORAGE, owner="kvcr", locality="rack-1"),
    stored(CHAIN[5:8], group=1, kind="sliding_window", window=48),
)


def reference(held: EventBatch) -> RankResidency:
    """The counts of an engine that stored what ``held`` stores."""
    residency = RankResidency()
    residency.apply(plan_batch(held))
    return residency


def engine_snapshot(held: EventBatch, seq: int, ts: float) -> Snapshot:
    """The snapshot such an engine answers with."""
    return snapshot_of(reference(held), seq, ts)


@check
async def a_snapshot_replaces_what_the_rank_held(store: Store) -> None:
    await apply(store, 0, stored([90, 91]), stored([92], CPU), stored([93], STORAGE), ts=1.0)
    await apply(store, 1, stored(CHAIN[:3]), ts=2.0)
    await apply_snapshot(store, RANK, engine_snapshot(HELD, 41, 9.0))
    expect(await store.watermark(RANK), Watermark(41, 9.0), "watermark from the snapshot")
    for gone in (90, 92, 93):
        expect(await where(store, gone), set(), f"residency of {gone}, not in the snapshot")
    expect(
        await where(store, 2),
        {("engine-a", 0, GPU, None, 0, None, 2), ("engine-a", 0, CPU, None, 0, None, 1)}
        | {("engine-a", 0, STORAGE, "kvcr", 0, "rack-1", 1)},
        "residency of 2",
    )
    expect(await store.block_counts(RANK), blocks(gpu=8, cpu=8, storage=4), "block counts")
    for chain in (CHAIN, CHAIN[:7], CHAIN[2:]):
        want = reference(HELD).match(chain, 4)
        expect(await hit(store, chain, 4), want, f"hit of {chain}, with the window group")
    expect(await apply(store, 41, stored([94])), False, "the snapshot's seq again")
    expect(await apply(store, 42, removed(CHAIN[1:2])), True, "the batch after it")
    expect(
        (await where(store, 2)) & {("engine-a", 0, GPU, None, 0, None, 1)},
        {("engine-a", 0, GPU, None, 0, None, 1)},
        "one copy of 2 evicted",
    )


@check
async def a_snapshot_of_an_engine_that_published_nothing_empties_the_rank(store: Store) -> None:
    await apply(store, 3, stored([1]), stored([2], STORAGE))
    await apply_snapshot(store, RANK, Snapshot(NOTHING_PUBLISHED, 0.0, []))
    expect(await store.block_counts(RANK), blocks(), "block counts")
    expect(await store.watermark(RANK), None, "watermark")
    expect(await apply(store, 0, stored([3])), True, "the engine's first batch")


@check
async def a_snapshot_under_an_older_token_is_refused(store: Store) -> None:
    first = await claim(store)
    await apply(store, 0, stored([1]), fence=first)
    second = await claim(store)
    await refused(
        apply_snapshot(store, RANK, engine_snapshot(HELD, 5, 2.0), fence=first),
        "a snapshot under the older token",
    )
    expect(await store.watermark(RANK), Watermark(0, 1.0), "watermark after the refusal")
    await apply_snapshot(store, RANK, engine_snapshot(HELD, 5, 2.0), fence=second)
    expect(await store.watermark(RANK), Watermark(5, 2.0), "under the newest token")
