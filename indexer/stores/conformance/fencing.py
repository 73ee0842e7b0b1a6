"""Fencing, checked once for every store: the newest claim wins, and only on its rank."""

from __future__ import annotations

from indexer.core.events import CPU, GPU, RankId
from indexer.stores.base import Store, Watermark
from indexer.stores.conformance.kit import (
    RANK,
    apply,
    check,
    claim,
    counts,
    expect,
    refused,
    stored,
)


@check
async def a_newer_claim_fences_writes_under_older_tokens(store: Store) -> None:
    first = await claim(store)
    expect(await apply(store, 0, stored([1]), fence=first), True, "write under the token")
    second = await claim(store)
    expect(second > first, True, f"a newer claim's token ({second}) above {first}")
    await refused(apply(store, 1, stored([2]), fence=first), "a write under the older token")
    await refused(store.clear(RANK, [GPU], fence=first), "a clear under the older token")
    expect(await store.watermark(RANK), Watermark(0, 1.0), "watermark after refused writes")
    expect(await counts(store, 1), {GPU: 1}, "counts of 1 after refused writes")
    expect(await counts(store, 2), {}, "counts of 2, refused")
    expect(await apply(store, 1, stored([2]), fence=second), True, "write under the newest")
    await store.clear(RANK, [CPU], fence=second)
    expect(await counts(store, 2), {GPU: 1}, "counts of 2 under the newest token")


@check
async def a_claim_fences_its_rank_only_and_never_unfenced_writers(store: Store) -> None:
    other = RankId(RANK.engine, 1)
    mine, theirs = await claim(store), await claim(store, other)
    await claim(store)  # RANK moves on; ``other`` does not
    await refused(apply(store, 0, stored([1]), fence=mine), "a write under the older token")
    expect(await apply(store, 0, stored([1]), rank=other, fence=theirs), True, "the other rank")
    expect(await apply(store, 0, stored([3])), True, "an unfenced write")
    expect(await counts(store, 3), {GPU: 1}, "counts of the unfenced write")


@check
async def tokens_keep_rising_through_forget(store: Store) -> None:
    first = await claim(store)
    await apply(store, 0, stored([1]), fence=first)
    await store.forget(RANK)
    second = await claim(store)
    expect(second > first, True, f"the token after forget ({second}) above {first}")
    await refused(apply(store, 0, stored([1]), fence=first), "a write under the forgotten token")
    expect(await apply(store, 0, stored([1]), fence=second), True, "write under the newest")
