"""The embedded store: the residency model in process memory.

The default for ``kvindex serve``. It forgets everything on exit; run with a
Redis URL for an index that survives restarts and serves many API replicas.

Each rank's exact refcounts live in its :class:`~indexer.core.residency.RankResidency`
(on the compiled core, the :class:`~indexer.stores.memory.residency.IndexedResidency`
flavour); prefix queries read the compiled holder index, which walks a chain once
for all ranks instead of once per rank, and takes the answers of hybrid models'
ranks to vLLM's hybrid rule (:class:`~indexer.stores.memory.hybrids.Hybrids`).
Without the build each rank is walked on its own tables by the core's rule
(:meth:`~indexer.core.residency.RankResidency.match`), the reference the compiled
index is held to.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from indexer.core.events import MEDIA, BlockHash, RankId
from indexer.core.matching import NO_MATCH, PrefixMatch, loadable
from indexer.core.residency import Op, RankResidency
from indexer.memory_trim import return_freed_memory
from indexer.stores.base import ApplyResult, Fenced, Loss, Residency, Watermark
from indexer.stores.memory import compiled
from indexer.stores.memory.hybrids import Hybrids
from indexer.stores.memory.residency import IndexedResidency


class MemoryStore:
    """Implements :class:`indexer.stores.Store` in process memory.

    ``core``: the compiled module by default when it built, else None: the
    core's reference, rank by rank (:mod:`indexer.stores.memory.compiled`).
    """

    def __init__(self, core: compiled.StoreCore = compiled.CORE) -> None:
        self._ranks: dict[RankId, RankResidency] = {}
        self._watermarks: dict[RankId, Watermark] = {}
        self._fences: dict[RankId, int] = {}  # the newest claim's token, kept by forget
        self._holders = core.HolderIndex() if core is not None else None
        self._hybrids = Hybrids()  # the ranks of hybrid models

    def _rank(self, rank: RankId) -> RankResidency:
        state = self._ranks.get(rank)
        if state is None:
            holders = self._holders
            if holders is None:
                state = self._ranks[rank] = RankResidency()
            else:
                state = self._ranks[rank] = IndexedResidency(index=holders, bit=holders.take_bit())
                holders.name(state.bit, rank)
        return state

    def _check_fence(self, rank: RankId, fence: int | None) -> None:
        newest = self._fences.get(rank, 0)
        if fence is not None and fence != newest:
            raise Fenced(f"{rank.engine}/{rank.dp_rank}: token {fence}, rank at {newest}")

    async def apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], *, fence: int | None = None
    ) -> ApplyResult:
        self._check_fence(rank, fence)
        mark = self._watermarks.get(rank)
        if mark is not None and seq <= mark.seq:
            return ApplyResult(applied=False)
        state = self._rank(rank)
        learned = state.chunk_blocks
        block_ops = state.apply(ops)
        if self._holders is not None:  # the compiled index follows the rank
            if state.chunk_blocks != learned:
                self._holders.learned(state.bit, state.chunk_blocks)
            self._hybrids.update(state, state.bit)
        self._watermarks[rank] = Watermark(seq, ts)
        return ApplyResult(applied=True, block_ops=block_ops)

    async def watermark(self, rank: RankId) -> Watermark | None:
        return self._watermarks.get(rank)

    async def claim(self, rank: RankId, owner: bytes) -> int:
        """Always granted: this store keeps no engine registry to check ``owner`` against."""
        token = self._fences.get(rank, 0) + 1
        self._fences[rank] = token
        return token

    async def clear(
        self,
        rank: RankId,
        media: Collection[str],
        *,
        reset_seq: bool = False,
        fence: int | None = None,
    ) -> None:
        self._check_fence(rank, fence)
        if rank in self._ranks:
            self._ranks[rank].clear(media)
            return_freed_memory()  # a rank's tables go at once: give their room back
        if reset_seq:
            self._watermarks.pop(rank, None)

    async def forget(self, rank: RankId) -> None:
        state = self._ranks.pop(rank, None)
        if state is not None and self._holders is not None:
            self._hybrids.drop(state.bit)
            state.release()
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
        if self._holders is None:  # the reference: each listed rank by the core's rule
            found = (
                (rank, state.match(chain, chunk_blocks[rank.engine] or state.chunk_blocks))
                for rank, state in self._ranks.items()
                if rank.engine in chunk_blocks
            )
            return {rank: match for rank, match in found if match != NO_MATCH}
        hybrids = self._hybrids if self._hybrids.bits else None
        matched = self._holders.match(chain, chunk_blocks, hybrids)
        return {
            rank: loadable(match, chunk_blocks[rank.engine] or self._ranks[rank].chunk_blocks)
            for rank, match in matched.items()
        }

    async def chain_residency(
        self, chain: Sequence[BlockHash], engines: Collection[str]
    ) -> dict[RankId, dict[tuple[str, int], set[BlockHash]]]:
        found: dict[RankId, dict[tuple[str, int], set[BlockHash]]] = {}
        for rank, state in self._ranks.items():
            if rank.engine not in engines:
                continue
            for tier, table in state.tables.items():
                held = {h for h in chain if table.counts.get(h, 0) > 0}
                if held:
                    by_tier = found.setdefault(rank, {})
                    by_tier.setdefault((tier.medium, tier.group_idx), set()).update(held)
        return found

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

    def last_loss(self) -> Loss | None:
        return None  # process memory loses nothing while the process lives

    def on_loss(self, listener: Callable[[Loss], None]) -> None:
        return None

    async def close(self) -> None:
        return None
