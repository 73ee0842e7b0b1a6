"""The embedded store's holder index against the residency model it is derived from.

The index must say, for every hash and medium, exactly which ranks hold it in
a scored table, whatever the history (refcounts above one, groups changing
kind, clears, forgotten ranks whose bits are reused), and the store's prefix
match must equal the model's own walk of each rank's tables
(:meth:`~indexer.core.residency.RankResidency.match`), hybrid ranks included.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, MEDIA, AllBlocksCleared, BlockStored, EventBatch, RankId
from indexer.core.hybrid import is_scored, is_windowed
from indexer.core.matching import PrefixMatch
from indexer.stores import MemoryStore, apply_events

from .events import removed, stored

RANKS = [RankId("a", 0), RankId("a", 1), RankId("b", 0)]
KINDS = [None, "full_attention", "sliding_window", "mamba"]


def check_index(store: MemoryStore) -> None:
    """Scored groups' hashes in the index's media, window groups' in its windows."""
    index = store._holders
    for medium in MEDIA:
        for media, kept in ((index.media, is_scored), (index.windows, is_windowed)):
            want: dict[int, int] = {}
            for state in store._ranks.values():
                for tier, table in state.tables.items():
                    if tier.medium == medium and kept(state.group_kinds.get(tier.group_idx)):
                        for h in table.counts:
                            want[h] = want.get(h, 0) | state.bit
            assert media[medium] == want, (medium, media is index.windows)


_hashes = st.lists(st.integers(1, 12), min_size=1, max_size=6)
_event = st.one_of(
    st.builds(
        stored,
        _hashes,
        medium=st.sampled_from(["GPU", "GPU", "CPU", "STORAGE"]),
        owner=st.sampled_from([None, None, "kvcr"]),
        group=st.sampled_from([0, 0, 1]),
        kind=st.sampled_from(KINDS),
        block_size=st.sampled_from([0, 4]),
        window=st.sampled_from([None, 8, 13]),
    ),
    st.builds(
        removed,
        _hashes,
        medium=st.sampled_from(["GPU", "CPU", "STORAGE"]),
        owner=st.sampled_from([None, "kvcr"]),
        group=st.sampled_from([0, 1]),
    ),
    st.just(AllBlocksCleared()),
)
_step = st.one_of(
    st.tuples(st.just("batch"), st.sampled_from(RANKS), st.lists(_event, max_size=5)),
    st.tuples(st.just("clear"), st.sampled_from(RANKS), st.sampled_from([[CPU], [GPU, CPU]])),
    st.tuples(st.just("forget"), st.sampled_from(RANKS), st.none()),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=25), st.sampled_from([None, 2, 3]))
def test_index_and_matches_follow_the_model(steps, declared) -> None:
    store = MemoryStore()
    chains = [list(range(1, 13)), list(range(12, 0, -1)), [1, 2, 3, 7, 8, 9, 10, 11, 12]]

    async def run() -> None:
        seqs = dict.fromkeys(RANKS, 0)
        for what, rank, arg in steps:
            if what == "batch":
                seqs[rank] += 1
                await apply_events(store, rank, seqs[rank], EventBatch(1.0, arg, 0))
            elif what == "clear":
                await store.clear(rank, arg)
            else:
                await store.forget(rank)
            check_index(store)
        engines = {"a": declared, "b": None}
        for chain in chains:
            found = await store.prefix_match(chain, engines)
            assert set(found) <= set(store._ranks)
            for rank, state in store._ranks.items():  # one matching nothing is left out
                want = state.match(chain, engines[rank.engine] or state.chunk_blocks)
                assert found.get(rank, PrefixMatch()) == want, (rank, chain)
                assert rank in found or want == PrefixMatch(), (rank, chain)

    asyncio.run(run())


def test_a_forgotten_ranks_bit_is_reused_clean() -> None:
    store = MemoryStore()

    async def run() -> None:
        first, second = RankId("x", 0), RankId("y", 0)
        await apply_events(store, first, 0, EventBatch(1.0, [BlockStored([1, 2], medium="GPU")]))
        bit = store._ranks[first].bit
        await store.forget(first)
        assert store._holders.media[GPU] == {}
        await apply_events(store, second, 0, EventBatch(1.0, [BlockStored([2], medium="GPU")]))
        assert store._ranks[second].bit == bit
        found = await store.prefix_match([1, 2], {"y": None})
        assert second in await store.ranks() and found == {}

    asyncio.run(run())


def test_more_answer_classes_than_one_byte_counts() -> None:
    """Every rank its own GPU run length: 300 classes, past the 255 spread in one pass."""
    chain = list(range(1, 301))
    store = MemoryStore()

    async def run() -> dict:
        for i in range(len(chain)):
            batch = EventBatch(0.0, [BlockStored(chain[: i + 1])])
            await apply_events(store, RankId(f"e{i}", 0), 1, batch)
        await apply_events(store, RankId("cold", 0), 1, EventBatch(0.0, [BlockStored([999])]))
        engines = {f"e{i}": None for i in range(len(chain))} | {"cold": None}
        return await store.prefix_match(chain, engines)

    matches = asyncio.run(run())
    assert {rank.engine: m.gpu_blocks for rank, m in matches.items()} == {
        f"e{i}": i + 1 for i in range(len(chain))
    }  # "cold" holds none of the chain: left out
