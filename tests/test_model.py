"""The residency model alone: refcount rules, group scoring, prefix combining."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, STORAGE, AllBlocksCleared, EventBatch
from indexer.core.hybrid import GroupRule
from indexer.core.matching import PrefixMatch, TierWeights, leading_run, match_prefix
from indexer.core.residency import RankResidency, Tier, plan_batch

from .events import removed, stored


def apply(state: RankResidency, *events) -> int:
    return state.apply(plan_batch(EventBatch(1.0, list(events))))


def counts(state: RankResidency, medium=GPU, owner=None, group=0) -> dict:
    table = state.tables.get(Tier(medium, owner, group))
    return dict(table.counts) if table else {}


# One (medium, ownership, group) tier, a hash from a small pool, store or remove.
_ops = st.lists(
    st.tuples(
        st.booleans(),
        st.sampled_from([GPU, CPU, STORAGE]),
        st.sampled_from([None, "kvcr"]),
        st.integers(0, 1),
        st.lists(st.integers(0, 7), min_size=1, max_size=4),
    ),
    max_size=60,
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(_ops, st.integers(1, 60))
def test_random_interleavings_match_a_naive_reference(ops, per_batch: int) -> None:
    """Event by event, or many per batch (where planning may reorder them)."""
    state, naive, unknown = RankResidency(), Counter(), 0
    events = [
        stored(hashes, medium, group, owner=owner)
        if is_store
        else removed(hashes, medium, group, owner)
        for is_store, medium, owner, group, hashes in ops
    ]
    for start in range(0, len(events), per_batch):
        apply(state, *events[start : start + per_batch])
    for is_store, medium, owner, group, hashes in ops:
        for h in hashes:
            key = (medium, owner, group, h)
            if is_store:
                naive[key] += 1
            elif naive[key] > 0:
                naive[key] -= 1
            else:
                unknown += 1
    got = {(*tier, h): n for tier, t in state.tables.items() for h, n in t.counts.items()}
    assert all(n > 0 for n in got.values())
    assert got == {k: n for k, n in naive.items() if n > 0}
    assert state.unknown_removals == unknown


def test_all_blocks_cleared_clears_gpu_only() -> None:
    state = RankResidency()
    apply(
        state,
        stored([1, 2]),
        stored([1, 2, 3, 4], CPU),
        stored([9], STORAGE, owner="kvcr"),
        AllBlocksCleared(),
        stored([5]),
    )
    assert counts(state) == {5: 1}
    assert counts(state, CPU) == {1: 1, 2: 1, 3: 1, 4: 1}
    assert counts(state, STORAGE, "kvcr") == {9: 1}


def test_repeated_announcements_are_reference_counted() -> None:
    state = RankResidency()
    apply(state, stored([1, 2]), stored([1]), removed([1]), removed([2]), removed([2]))
    assert counts(state) == {1: 1}
    assert state.unknown_removals == 1


def test_chunk_size_learned_from_self_describing_lower_tier_stores_only() -> None:
    state = RankResidency()
    apply(state, stored([1, 2, 3]), stored([7], CPU, block_size=0))
    assert state.chunk_blocks is None  # GPU stores and placeholders teach nothing
    apply(state, stored([1, 2, 3, 4], CPU, group=1, kind="mamba"))
    assert state.chunk_blocks is None  # recurrent groups may publish partial tails
    apply(state, stored([1, 2, 3, 4], CPU))
    assert state.chunk_blocks == 4


def test_sliding_window_groups_are_tracked_but_not_scored() -> None:
    state = RankResidency()
    apply(state, stored([1, 2], group=1, kind="sliding_window"), stored([1], group=0))
    assert counts(state, group=1) == {1: 1, 2: 1}
    assert state.distinct_blocks(GPU) == 2
    assert leading_run([1, 2], state.scored_tables(GPU)) == 1


def test_a_groups_window_is_remembered_until_its_kind_changes() -> None:
    state = RankResidency()
    apply(state, stored([1], group=1, kind="sliding_window", window=128))
    assert state.group_rules() == (GroupRule(1, 128, 16),)
    # a chunk-end placeholder (no block size) and a removal say less: both keep it
    apply(state, stored([2], CPU, group=1, kind="sliding_window", block_size=0, window=128))
    apply(state, removed([1], group=1))
    assert state.group_kinds == {1: "sliding_window:128:16"}
    apply(state, stored([1], group=1, kind="mamba"))  # another kind replaces it
    assert state.group_rules() == (GroupRule(1, 0),)
    apply(state, stored([1], group=1, kind="full_attention"))
    assert state.group_rules() == ()  # every group full attention: not a hybrid model


def test_unclassified_group_is_scored_and_removal_keeps_its_kind() -> None:
    state = RankResidency()
    apply(state, stored([1], group=2, kind=None), removed([1], group=2))
    apply(state, stored([3], group=2, kind=None))
    assert state.group_kinds == {2: None}
    assert leading_run([3], state.scored_tables(GPU)) == 1


def _chunks(present: dict[str, set[int]]):
    return lambda medium, j: j in present.get(medium, set())


@pytest.mark.parametrize(
    ("gpu", "present", "want"),
    [
        # The example: 12 GPU blocks, 24 CPU blocks in chunks of 4.
        (12, {CPU: set(range(6))}, PrefixMatch(12, 24, 0, 24, 12, 0)),
        # GPU ends mid-chunk: the engine loads that whole chunk from CPU.
        (5, {CPU: {1}}, PrefixMatch(5, 0, 0, 8, 3, 0)),
        # CPU preferred over STORAGE chunk by chunk; STORAGE fills a CPU hole.
        (0, {CPU: {0, 2}, STORAGE: {0, 1, 2, 3}}, PrefixMatch(0, 4, 16, 16, 8, 8)),
        # Both lower-tier runs end at chunk 0, inside the GPU run; the prefix still
        # extends past the GPU run, from STORAGE and then CPU.
        (8, {STORAGE: {2}, CPU: {3}}, PrefixMatch(8, 0, 0, 16, 4, 4)),
        # Nothing past the GPU run.
        (7, {}, PrefixMatch(7, 0, 0, 7, 0, 0)),
    ],
)
def test_match_prefix_combines_tiers(gpu, present, want) -> None:
    assert match_prefix(37, gpu, 4, _chunks(present)) == want


def test_match_prefix_without_chunk_size_is_gpu_only() -> None:
    assert match_prefix(8, 3, None, _chunks({CPU: {0, 1}})) == PrefixMatch(3, prefix_blocks=3)


def test_score_weights_each_prefix_block_by_its_tier() -> None:
    match = PrefixMatch(12, 24, 0, 24, 12, 0)
    assert match.score(TierWeights()) == pytest.approx(21.6)
    assert match.score(TierWeights(gpu=2, cpu=0)) == 24


def test_plan_batch_merges_runs_on_one_tier_and_keeps_order() -> None:
    batch = EventBatch(
        1.0,
        [
            removed([1]),
            removed([2]),
            stored([3]),
            removed([4]),
            removed([5], CPU),
            AllBlocksCleared(),
            removed([6]),
            removed([7]),
        ],
    )
    ops = plan_batch(batch)
    assert _summary(ops) == [
        (-1, [1, 2, 4]),  # no hash both stored and removed: removals first
        (1, [3]),
        (-1, [5]),
        (None, []),
        (-1, [6, 7]),
    ]
    assert batch.events[0].block_hashes == [1]  # the decoded events are left as they were


def _summary(ops: list) -> list[tuple[int | None, list]]:
    return [(getattr(op, "delta", None), list(getattr(op, "hashes", []))) for op in ops]


def test_plan_batch_keeps_order_when_a_hash_is_removed_after_it_was_stored() -> None:
    evict_then_store = [removed([1]), stored([1]), removed([2]), stored([3])]
    assert _summary(plan_batch(EventBatch(1.0, evict_then_store))) == [(-1, [1, 2]), (1, [1, 3])]
    store_then_evict = [removed([2]), stored([1]), removed([1]), stored([3])]
    assert _summary(plan_batch(EventBatch(1.0, store_then_evict))) == [
        (-1, [2]),
        (1, [1]),
        (-1, [1]),
        (1, [3]),
    ]
