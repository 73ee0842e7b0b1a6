"""The pure reference a store is checked against, and the random events fed to both.

Shared by the differential tests of every store (tests/test_differential.py)
and of the compiled holder index (tests/test_compiled_core.py), so both hold
the stores to the same rules and the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, MEDIA, AllBlocksCleared, EventBatch, RankId
from indexer.core.matching import PrefixMatch
from indexer.core.residency import RankResidency, plan_batch
from indexer.stores import Store, Watermark

from .events import removed, stored

#: int hashes and bytes hashes (a bytes hash is its own key, never its int)
POOL = [*range(1, 11), b"\x01" * 32, b"\x02" * 32, (1).to_bytes(32, "big")]
CHAINS = [POOL[:12], POOL[::-1], [1, 2, 3, 7, 8, 9, 10, POOL[10], POOL[11]], POOL[10:]]


@dataclass
class Reference:
    """The rules of :mod:`indexer.core` and the watermark rule, nothing else."""

    states: dict[RankId, RankResidency] = field(default_factory=dict)
    marks: dict[RankId, Watermark] = field(default_factory=dict)

    def apply(self, rank: RankId, seq: int, batch: EventBatch) -> bool:
        mark = self.marks.get(rank)
        if mark is not None and seq <= mark.seq:
            return False
        self.states.setdefault(rank, RankResidency()).apply(plan_batch(batch))
        self.marks[rank] = Watermark(seq, batch.ts)
        return True

    def clear(self, rank: RankId, media: list[str], reset_seq: bool) -> None:
        if rank in self.states:
            self.states[rank].clear(media)
        if reset_seq:
            self.marks.pop(rank, None)

    def forget(self, rank: RankId) -> None:
        self.states.pop(rank, None)
        self.marks.pop(rank, None)

    def residency(self, h: object) -> set[tuple]:
        return {
            (rank.engine, rank.dp_rank, *tier, table.locality, table.counts[h])
            for rank, state in self.states.items()
            for tier, table in state.tables.items()
            if h in table.counts
        }


_hashes = st.lists(st.sampled_from(POOL), min_size=1, max_size=6)
#: one random event: stored or removed in any tier, group, kind and ownership, or a clear
EVENT = st.one_of(
    st.builds(
        stored,
        _hashes,
        medium=st.sampled_from([GPU, GPU, CPU, "STORAGE", "cpu"]),
        owner=st.sampled_from([None, None, "kvcr"]),
        group=st.sampled_from([0, 0, 1, 2]),
        kind=st.sampled_from([None, "full_attention", "sliding_window", "mamba"]),
        locality=st.sampled_from([None, "LOCAL"]),
        block_size=st.sampled_from([0, 4, 4, 16]),
        window=st.sampled_from([None, 8, 13]),
    ),
    st.builds(
        removed,
        _hashes,
        medium=st.sampled_from([GPU, CPU, "STORAGE"]),
        owner=st.sampled_from([None, "kvcr"]),
        group=st.sampled_from([0, 1, 2]),
    ),
    st.just(AllBlocksCleared()),
)


async def check_answers(
    store: Store, ref: Reference, ranks: list[RankId], engines: dict[str, int | None], at: int
) -> None:
    """The store answers as the reference: counts and anomalies of ``ranks``, every
    residency of the pool's hashes, every chain's prefix match (``at``: the step)."""
    for rank in ranks:
        state = ref.states.get(rank)
        want = {m: state.distinct_blocks(m) if state else 0 for m in MEDIA}
        assert await store.block_counts(rank) == want, (at, rank)
        unknown = state.unknown_removals if state else 0
        assert await store.anomalies(rank) == {"unknown_removals": unknown}, (at, rank)
    for h in POOL:
        rows = await store.block_residency(h)
        got = {
            (r.engine, r.dp_rank, r.medium, r.ownership, r.group_idx, r.locality, r.count)
            for r in rows
        }
        assert got == ref.residency(h), (at, h)
    for chain in CHAINS:
        want_match = {  # a rank matching nothing is left out
            rank: match
            for rank, state in ref.states.items()
            if (match := state.match(chain, engines[rank.engine] or state.chunk_blocks))
            != PrefixMatch()
        }
        assert await store.prefix_match(chain, engines) == want_match, (at, chain)
