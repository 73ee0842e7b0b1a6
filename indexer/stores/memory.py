"""The embedded store: the residency model in process memory.

The default for ``kvindex serve``. It forgets everything on exit; run with a
Redis URL for an index that survives restarts and serves many API replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from indexer.model import (
    GPU,
    LOWER_TIERS,
    MEDIA,
    PrefixMatch,
    RankId,
    RankResidency,
    leading_run,
    match_prefix,
    plan_batch,
)
from indexer.stores.base import ApplyResult, Residency, Watermark
from indexer.wire import BlockHash, EventBatch


class MemoryStore:
    """Implements :class:`indexer.stores.Store` with plain dicts."""

    def __init__(self) -> None:
        self._ranks: dict[RankId, RankResidency] = {}
        self._watermarks: dict[RankId, Watermark] = {}

    def _rank(self, rank: RankId) -> RankResidency:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = RankResidency()
        return state

    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult:
        mark = self._watermarks.get(rank)
        if mark is not None and seq <= mark.seq:
            return ApplyResult(applied=False)
        ops = plan_batch(batch)
        block_ops = self._rank(rank).apply(ops)
        self._watermarks[rank] = Watermark(seq, batch.ts)
        return ApplyResult(applied=True, block_ops=block_ops)

    async def watermark(self, rank: RankId) -> Watermark | None:
        return self._watermarks.get(rank)

    async def clear(self, rank: RankId, media: Collection[str], *, reset_seq: bool = False) -> None:
        if rank in self._ranks:
            self._ranks[rank].clear(media)
        if reset_seq:
            self._watermarks.pop(rank, None)

    async def forget(self, rank: RankId) -> None:
        self._ranks.pop(rank, None)
        self._watermarks.pop(rank, None)

    async def block_residency(self, block_hash: BlockHash) -> list[Residency]:
        return [
            Residency(rank.engine, rank.dp_rank, *tier, table.locality, count)
            for rank, state in self._ranks.items()
            for tier, table in state.tables.items()
            if (count := table.counts.get(block_hash, 0)) > 0
        ]

    async def prefix_match(
        self, chain: Sequence[BlockHash], chunk_blocks: Mapping[str, int | None]
    ) -> dict[RankId, PrefixMatch]:
        return {
            rank: _match(state, chain, chunk_blocks[rank.engine] or state.chunk_blocks)
            for rank, state in self._ranks.items()
            if rank.engine in chunk_blocks
        }

    async def block_counts(self, rank: RankId) -> dict[str, int]:
        state = self._ranks.get(rank)
        return {m: state.distinct_blocks(m) if state else 0 for m in MEDIA}

    async def anomalies(self, rank: RankId) -> dict[str, int]:
        state = self._ranks.get(rank)
        return {"unknown_removals": state.unknown_removals if state else 0}

    async def ranks(self) -> list[RankId]:
        return sorted(self._ranks.keys() | self._watermarks.keys())

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _match(
    state: RankResidency, chain: Sequence[BlockHash], chunk_blocks: int | None
) -> PrefixMatch:
    gpu_tables = state.scored_tables(GPU)
    gpu = leading_run(chain, gpu_tables) if gpu_tables else 0
    lower = {m: _membership(state.scored_tables(m)) for m in LOWER_TIERS}
    if not chunk_blocks or not any(lower.values()):
        return match_prefix(len(chain), gpu, None, _nowhere)

    def chunk_in(medium: str, j: int) -> bool:
        contains = lower[medium]
        return contains is not None and contains(chain[(j + 1) * chunk_blocks - 1])

    return match_prefix(len(chain), gpu, chunk_blocks, chunk_in)


def _membership(tables: list[dict[BlockHash, int]]) -> Callable[[BlockHash], bool] | None:
    """The fastest "is this hash in any table" test; None when there are no tables."""
    if not tables:
        return None
    if len(tables) == 1:
        return tables[0].__contains__
    return lambda h: any(h in t for t in tables)


def _nowhere(medium: str, j: int) -> bool:
    return False
