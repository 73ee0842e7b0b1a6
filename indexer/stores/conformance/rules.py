"""The residency rules every store keeps: watermarks, clears, counts, prefix matches."""

from __future__ import annotations

import random

from indexer.core.events import CPU, GPU, STORAGE, AllBlocksCleared, RankId
from indexer.core.matching import PrefixMatch
from indexer.stores.base import Store, Watermark
from indexer.stores.conformance.kit import (
    ENGINE,
    RANK,
    apply,
    blocks,
    check,
    counts,
    expect,
    hit,
    removed,
    stored,
    where,
)

# --- watermark, clear, forget -------------------------------------------------


@check
async def watermark_admits_each_seq_once_and_allows_holes(store: Store) -> None:
    expect(await store.watermark(RANK), None, "watermark of an unseen rank")
    expect(await apply(store, 5, stored([1]), ts=10.0), True, "first batch applied")
    expect(await store.watermark(RANK), Watermark(5, 10.0), "watermark")
    expect(await apply(store, 5, stored([1]), ts=11.0), False, "the same seq again applied")
    expect(await apply(store, 3, stored([1])), False, "an older seq applied")
    expect(await counts(store, 1), {GPU: 1}, "counts after duplicates")
    expect(await apply(store, 9, removed([1]), ts=12.0), True, "a seq past a hole applied")
    expect(await store.watermark(RANK), Watermark(9, 12.0), "watermark past the hole")
    expect(await counts(store, 1), {}, "counts after the removal")


@check
async def empty_batch_advances_the_watermark(store: Store) -> None:
    expect(await apply(store, 0), True, "empty batch applied")
    expect(await store.watermark(RANK), Watermark(0, 1.0), "watermark")
    expect(await store.ranks(), [RANK], "ranks")


@check
async def clear_drops_only_the_given_media(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([2], CPU), stored([3], STORAGE))
    await store.clear(RANK, [GPU, CPU])
    expect(await store.block_counts(RANK), blocks(storage=1), "block counts after clear")
    expect(await store.watermark(RANK), Watermark(0, 1.0), "watermark kept by clear")
    expect(await apply(store, 0, stored([1])), False, "seq 0 again after clear applied")
    expect(await apply(store, 1, stored([2])), True, "seq 1 after clear applied")
    expect(await counts(store, 2), {GPU: 1}, "a fresh count, nothing resurrected")


@check
async def reset_seq_takes_a_restarted_engines_stream_from_zero(store: Store) -> None:
    for seq in range(3):
        await apply(store, seq, stored([10 + seq]), stored([20 + seq], STORAGE))
    await store.clear(RANK, [GPU, CPU], reset_seq=True)
    expect(await store.watermark(RANK), None, "watermark after reset_seq")
    expect(await apply(store, 0, stored([10]), stored([20], STORAGE), ts=5.0), True, "seq 0")
    expect(await store.watermark(RANK), Watermark(0, 5.0), "watermark after restart")
    expect(await counts(store, 10), {GPU: 1}, "GPU count after restart")
    expect(await counts(store, 20), {STORAGE: 2}, "STORAGE kept through the restart, then +1")
    expect(await store.block_counts(RANK), blocks(1, 0, 3), "block counts")


@check
async def forget_drops_everything_about_the_rank(store: Store) -> None:
    other = RankId("engine-b", 0)
    await apply(store, 4, stored([1, 2]), stored([2], CPU), removed([9]))
    await apply(store, 0, stored([1]), rank=other)
    await store.forget(RANK)
    expect(await store.ranks(), [other], "ranks after forget")
    expect(await store.watermark(RANK), None, "watermark after forget")
    expect(await where(store, 1), {("engine-b", 0, GPU, None, 0, None, 1)}, "residency of 1")
    expect(await store.block_counts(RANK), blocks(), "block counts after forget")
    expect(await store.anomalies(RANK), {"unknown_removals": 0}, "anomalies after forget")
    expect(set(await store.prefix_match([1, 2], ENGINE)), set(), "ranks matched after forget")
    expect(await apply(store, 0, stored([2])), True, "seq 0 of a rank registered again")
    expect(await counts(store, 2), {GPU: 1}, "a rank registered again starts from nothing")


@check
async def chain_residency_lists_a_chains_hashes_by_medium_and_group(store: Store) -> None:
    """Each rank of the engines asked, by (medium, group): every ownership together,
    removed and cleared hashes gone, other engines' ranks and hashes off the chain not
    read."""
    other = RankId("engine-b", 0)
    await apply(store, 0, stored([1, 2, 9]), stored([2], CPU, owner="a"), stored([3], CPU))
    await apply(store, 1, stored([1], group=1, kind="mamba"), stored([4], STORAGE), removed([2]))
    await apply(store, 0, stored([1, 2]), rank=other)
    held = {(GPU, 0): {1}, (CPU, 0): {2, 3}, (GPU, 1): {1}, (STORAGE, 0): {4}}
    expect(await store.chain_residency([1, 2, 3, 4], ENGINE), {RANK: held}, "one engine's")
    both = {RANK: held, other: {(GPU, 0): {1, 2}}}
    expect(await store.chain_residency([4, 3, 2, 1], {*ENGINE, "engine-b"}), both, "both's")
    await store.clear(RANK, [CPU, STORAGE])
    expect(await store.chain_residency([2, 3, 4, 5], ENGINE), {}, "after a clear")


# --- residency rules ----------------------------------------------------------


@check
async def all_blocks_cleared_mid_batch_clears_gpu_only(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([7], CPU))
    events = [stored([3]), stored([8], CPU), AllBlocksCleared(), stored([2]), removed([1])]
    expect(await apply(store, 1, *events), True, "batch applied")
    expect(await store.block_counts(RANK), blocks(1, 2), "block counts")
    expect(await counts(store, 2), {GPU: 1}, "counts of 2, stored after the clear")
    expect(await counts(store, 3), {}, "counts of 3, stored before the clear")
    expect(await counts(store, 7), {CPU: 1}, "counts of 7 on CPU")
    expect(await store.anomalies(RANK), {"unknown_removals": 1}, "1 was cleared first")


@check
async def unknown_removals_are_counted_and_counts_never_go_negative(store: Store) -> None:
    await apply(store, 0, removed([5]), stored([1]), removed([1, 1]), removed([6], CPU))
    expect(await store.anomalies(RANK), {"unknown_removals": 3}, "anomalies")
    expect(await counts(store, 1), {}, "counts of 1 after removing it twice")
    await apply(store, 1, stored([1]))
    expect(await counts(store, 1), {GPU: 1}, "counts of 1 stored again")


@check
async def repeated_stores_are_reference_counted(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([1]), stored([1], CPU), stored([1], CPU))
    await apply(store, 1, removed([1]), removed([1], CPU))
    expect(await counts(store, 1), {GPU: 1, CPU: 1}, "counts of 1")
    expect(await store.block_counts(RANK), blocks(2, 1), "block counts")


@check
async def held_gpu_stores_keep_one_reference_and_an_eviction_ends_residency(
    store: Store,
) -> None:
    """A reuse report (or a second copy) of a held GPU block adds no reference;
    lower tiers still count every store."""
    await apply(store, 0, stored([1, 2, 1]), stored([1]), stored([3], CPU), hold_gpu=True)
    await apply(store, 1, stored([1, 2]), stored([3], CPU), hold_gpu=True)
    expect(await counts(store, 1), {GPU: 1}, "counts of 1 stored and reported thrice")
    expect(await counts(store, 3), {CPU: 2}, "counts of 3 stored twice on CPU")
    expect(await store.block_counts(RANK), blocks(2, 1), "block counts")
    await apply(store, 2, removed([1]), removed([2, 2]), hold_gpu=True)
    expect(await counts(store, 1), {}, "counts of 1 after its eviction")
    expect(await store.anomalies(RANK), {"unknown_removals": 1}, "anomalies: a second copy")
    expect(await hit(store, [1, 2]), PrefixMatch(), "prefix after the evictions")


@check
async def storage_tiers_with_ownership_are_separate_residencies(store: Store) -> None:
    await apply(
        store,
        0,
        stored([21, 22], STORAGE, owner="kvcr", locality="REMOTE"),
        stored([21], STORAGE, locality="LOCAL"),
        stored([21], "cpu"),
    )
    want = {
        ("engine-a", 0, STORAGE, "kvcr", 0, "REMOTE", 1),
        ("engine-a", 0, STORAGE, None, 0, "LOCAL", 1),
        ("engine-a", 0, CPU, None, 0, None, 1),
    }
    expect(await where(store, 21), want, "residencies of 21")
    expect(await store.block_counts(RANK), blocks(0, 1, 2), "distinct hashes per medium")
    await apply(store, 1, removed([21, 22], STORAGE, owner="kvcr"))
    expect(await where(store, 22), set(), "residencies of 22 after its removal")
    expect(await store.block_counts(RANK), blocks(0, 1, 1), "block counts after the removal")


@check
async def distinct_counts_span_groups_of_a_medium(store: Store) -> None:
    await apply(store, 0, stored([1, 2], group=0), stored([1, 3], group=1, kind="sliding_window"))
    expect(await store.block_counts(RANK), blocks(3), "block counts")
    await apply(store, 1, removed([1], group=0))
    expect(await store.block_counts(RANK), blocks(3), "1 still held by group 1")
    await apply(store, 2, removed([1, 3], group=1))
    expect(await store.block_counts(RANK), blocks(1), "block counts after group 1 let go")


@check
async def locality_is_forgotten_with_a_cleared_tier(store: Store) -> None:
    await apply(store, 0, stored([1], CPU, locality="LOCAL"))
    await apply(store, 1, stored([2], CPU))
    expect(await where(store, 2), {("engine-a", 0, CPU, None, 0, "LOCAL", 1)}, "kept locality")
    await store.clear(RANK, [CPU])
    await apply(store, 2, stored([2], CPU))
    expect(await where(store, 2), {("engine-a", 0, CPU, None, 0, None, 1)}, "after the clear")


@check
async def a_sliding_window_group_limits_the_hit_to_what_its_window_holds(store: Store) -> None:
    window = stored([31], group=1, kind="sliding_window", window=128)
    await apply(store, 0, window)
    expect(await where(store, 31), {("engine-a", 0, GPU, None, 1, None, 1)}, "residency of 31")
    chain = [31, *range(101, 111)]  # 11 blocks, all held by full attention (group 0)
    await apply(store, 1, stored(chain), stored(chain[1:3], group=1, kind="sliding_window"))
    # a window of 128 tokens needs cdiv(127, 16) = 8 blocks: none end at or below 11,
    # so the hit is the run held from block 0
    want = PrefixMatch(3, prefix_blocks=3, full_attention_blocks=11)
    expect(await hit(store, chain), want, "hit, window not held")
    await apply(store, 2, stored(chain[3:10], group=1, kind="sliding_window"))
    expect((await hit(store, chain)).gpu_blocks, 10, "blocks 2..9 end the rightmost window")
    await apply(store, 3, removed([chain[5]], group=1))  # a removal carries no kind
    want = PrefixMatch(5, prefix_blocks=5, full_attention_blocks=11)
    expect(await hit(store, chain), want, "hit after a removal in the window")
    expect(await hit(store, chain[:5]), PrefixMatch(5, prefix_blocks=5), "hit of 5 blocks")


@check
async def a_mamba_group_hits_at_its_rightmost_state(store: Store) -> None:
    chain = list(range(1, 12))
    await apply(store, 0, stored(chain[:9]), stored([chain[3], chain[7]], group=1, kind="mamba"))
    want = PrefixMatch(8, prefix_blocks=8, full_attention_blocks=9)
    expect(await hit(store, chain), want, "hit at the rightmost state")
    expect((await hit(store, chain[:7])).gpu_blocks, 4, "hit of 7 blocks")
    await apply(store, 1, removed([chain[3]], group=1), removed([chain[7]], group=1))
    expect(await hit(store, chain), PrefixMatch(full_attention_blocks=9), "no state held")


@check
async def an_unclassified_group_counts_for_matching(store: Store) -> None:
    await apply(store, 0, stored([1, 2], kind=None))
    expect((await hit(store, [1, 2, 3])).gpu_blocks, 2, "hit of an unclassified group")


@check
async def ranks_are_independent(store: Store) -> None:
    ranks = [RankId("engine-a", 0), RankId("engine-a", 1), RankId("engine-b", 0)]
    for i, rank in enumerate(ranks):
        await apply(store, 0, stored([1, 2][: i + 1]), rank=rank, ts=float(i))
    await store.clear(ranks[0], [GPU], reset_seq=True)
    expect(await store.watermark(ranks[0]), None, "watermark of the reset rank")
    expect(await store.watermark(ranks[1]), Watermark(0, 1.0), "watermark of another rank")
    expect(await store.ranks(), sorted(ranks), "ranks")
    want = {ranks[1]: PrefixMatch(gpu_blocks=2, prefix_blocks=2)}  # the reset one: none
    expect(await store.prefix_match([1, 2], ENGINE), want, "matches of engine-a")
    expect(await counts(store, 1, ranks[2]), {GPU: 1}, "counts of engine-b")


@check
async def bytes_hashes_are_their_own_keys(store: Store) -> None:
    first, second = bytes(range(32)), bytes(range(32, 64))
    await apply(store, 0, stored([first, second], group=1, block_size=4))
    number = int.from_bytes(first, "big")
    await apply(store, 1, stored([number], group=1))
    expect(await where(store, first), {("engine-a", 0, GPU, None, 1, None, 1)}, "bytes hash")
    expect(await counts(store, number), {GPU: 1}, "the int of the same bytes")
    expect((await hit(store, [first, second])).gpu_blocks, 2, "hit of bytes hashes")


@check
async def a_batch_adds_at_most_one_block_per_hash_it_stores(store: Store) -> None:
    """What a rank consumer's bound of its rank's blocks counts on (it asks for the
    exact counts only when that bound passes a limit): copies, holds, groups,
    owners and removals never make a medium's count grow by more."""
    rng = random.Random(28)
    for seq in range(40):
        medium = rng.choice([GPU, CPU, STORAGE])
        hashes = [rng.randrange(60) for _ in range(rng.randrange(1, 8))]
        events = [
            stored(hashes, medium, group=rng.randrange(2), owner=rng.choice([None, "kvcr"])),
            removed(rng.sample(range(60), 3), medium),
        ]
        before = await store.block_counts(RANK)
        await apply(store, seq, *rng.sample(events, 2), hold_gpu=rng.random() < 0.5)
        grew = (await store.block_counts(RANK))[medium] - before[medium]
        expect(grew <= len(hashes), True, f"batch {seq}: {grew} blocks for {len(hashes)} hashes")


# --- prefix matching ----------------------------------------------------------


@check
async def prefix_combines_gpu_blocks_with_lower_tier_chunks(store: Store) -> None:
    chain = list(range(100, 116))  # 4 chunks of 4
    await apply(
        store,
        0,
        stored(chain[:6]),
        stored(chain[:4], CPU),  # self-describing: teaches 4 blocks per chunk
        stored(chain[4:8], CPU),
        stored([chain[11]], STORAGE, block_size=0),  # placeholder: chunk 2's end hash
    )
    expect(await hit(store, chain), PrefixMatch(6, 8, 0, 12, 2, 4), "learned chunk size")
    expect(await hit(store, chain, 2), PrefixMatch(6, 8, 0, 8, 2, 0), "declared size wins")
    expect(await store.prefix_match(chain, {"engine-b": None}), {}, "another engine")


@check
async def prefix_extends_past_the_gpu_run_when_lower_runs_end_inside_it(store: Store) -> None:
    chain = list(range(200, 216))  # 4 chunks of 4; chunks 0-1 on GPU only
    await apply(store, 0, stored(chain[:8]), stored(chain[8:12], STORAGE), stored(chain[12:], CPU))
    expect(await hit(store, chain, 4), PrefixMatch(8, 0, 0, 16, 4, 4), "hit")


@check
async def a_load_shorter_than_a_chunk_after_the_gpu_run_is_not_taken(store: Store) -> None:
    """vLLM's offloading connector skips a load of fewer blocks than a chunk holds."""
    chain = list(range(400, 416))  # 4 chunks of 4
    await apply(store, 0, stored(chain[:7]), stored(chain[:4], CPU), stored(chain[4:8], CPU))
    expect(await hit(store, chain, 4), PrefixMatch(7, 8, 0, 7, 0, 0), "a block more: not loaded")
    await apply(store, 1, stored(chain[8:12], STORAGE))
    expect(await hit(store, chain, 4), PrefixMatch(7, 8, 0, 12, 1, 4), "five more: loaded")


@check
async def ranks_that_match_nothing_are_left_out(store: Store) -> None:
    chain = list(range(300, 316))  # 4 chunks of 4
    cpu_only, elsewhere = RankId("engine-a", 1), RankId("engine-a", 2)
    await apply(store, 0, stored(chain[1:]))  # all but the first block: no GPU run
    await apply(store, 0, stored(chain[:4], CPU), rank=cpu_only)  # teaches 4 blocks per chunk
    await apply(store, 0, stored([999]), stored([chain[0]], CPU, block_size=0), rank=elsewhere)
    await apply(store, 0, stored(chain), rank=RankId("engine-b", 0))
    want = {cpu_only: PrefixMatch(0, 4, 0, 4, 4, 0)}
    expect(await store.prefix_match(chain, ENGINE), want, "learned chunk sizes")
    want = {cpu_only: PrefixMatch(0, 4, 0, 4, 4, 0), elsewhere: PrefixMatch(0, 1, 0, 1, 1, 0)}
    expect(await store.prefix_match(chain, {"engine-a": 1}), want, "one block per chunk")
    expect(await store.prefix_match(chain, {"engine-a": 2}), {cpu_only: want[cpu_only]}, "2")


@check
async def long_chains_match_to_their_end(store: Store) -> None:
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(600)]
    other, chunked = RankId("engine-b", 0), RankId("c", 0)
    cpu = [stored(chain[i : i + 50], CPU) for i in range(0, 600, 50)]  # chunks of 50
    await apply(store, 0, stored(chain[:530]), *cpu)
    await apply(store, 0, stored([1]), rank=other)
    await apply(store, 0, stored(chain[:10]), stored(chain[:400], CPU), rank=chunked)
    match = await store.prefix_match(chain, {"engine-a": None, "engine-b": None, "c": 4})
    expect(match[RANK], PrefixMatch(530, 600, 0, 600, 70, 0), "engine-a")
    expect(other in match, False, "engine-b, holding none of the chain, is left out")
    expect(match[chunked], PrefixMatch(10, 400, 0, 400, 390, 0), "c")
    expect(await store.prefix_match([], ENGINE), {}, "an empty chain")
