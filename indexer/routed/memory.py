"""Routed entries of ``kvindex serve`` with the embedded store: in process.

Each rank keeps its entries in a dict (hash -> deadline) for lookups and a
heap of deadlines for what ends first, expired or evicted. An entry routed
again gets a new deadline and leaves its old heap item behind; those are
skipped when they surface and dropped wholesale once they outnumber the
live ones, so a rank's memory stays within twice its bound.

Every method runs without awaiting, so ``route`` reads and records in one
step of the event loop: two concurrent routers cannot both see the same
empty rank.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

from indexer.core.events import BlockHash, EventBatch, RankId
from indexer.core.matching import TierWeights
from indexer.core.routed import Candidate, best, confirmations, deadline, routed_run, score
from indexer.routed.base import COUNTS


class _RankEntries:
    """One rank's entries and the heap of their deadlines."""

    def __init__(self) -> None:
        self.entries: dict[BlockHash, float] = {}
        self.heap: list[tuple[float, int, BlockHash]] = []
        self.pushed = 0  # tie-break of equal deadlines: first recorded ends first

    def expire(self, now: float) -> int:
        """Drop the entries whose deadline has passed; how many."""
        heap, entries, gone = self.heap, self.entries, 0
        while heap and heap[0][0] <= now:
            d, _, block_hash = heapq.heappop(heap)
            if entries.get(block_hash) == d:
                del entries[block_hash]
                gone += 1
        return gone

    def record(self, chain: Sequence[BlockHash], now: float, ttl: float, bound: int) -> tuple:
        """Route ``chain`` here; (new entries, entries evicted past ``bound``)."""
        entries, heap, new = self.entries, self.heap, 0
        for position, block_hash in enumerate(chain):
            d = deadline(now, ttl, position)
            new += block_hash not in entries
            entries[block_hash] = d
            heapq.heappush(heap, (d, self.pushed, block_hash))
            self.pushed += 1
        evicted = 0
        while len(entries) > bound:
            d, _, block_hash = heapq.heappop(heap)
            if entries.get(block_hash) == d:
                del entries[block_hash]
                evicted += 1
        if len(heap) > 2 * len(entries) + 1024:
            self.heap = [(d, n, h) for d, n, h in heap if entries.get(h) == d]
            heapq.heapify(self.heap)
        return new, evicted


class MemoryRouted:
    """:class:`~indexer.routed.base.RoutedEntries` in process. ``clock``: seconds,
    monotonic (tests may pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ranks: dict[RankId, _RankEntries] = {}
        self._counts: Counter[str] = Counter()

    def _live_ranks(self, engines: Collection[str] | None, now: float) -> list[tuple]:
        """``(rank, entries)`` of the ranks of ``engines`` (None: all), expired
        entries dropped first."""
        found = []
        for rank, held in list(self._ranks.items()):
            if engines is not None and rank.engine not in engines:
                continue
            self._counts["expired"] += held.expire(now)
            if not held.entries:
                del self._ranks[rank]
                continue
            found.append((rank, held))
        return found

    def _record(self, rank: RankId, chain: Sequence[BlockHash], ttl: float, bound: int) -> int:
        now = self._clock()
        held = self._ranks.get(rank)
        if held is None:
            held = self._ranks[rank] = _RankEntries()
        self._counts["expired"] += held.expire(now)
        new, evicted = held.record(chain, now, ttl, bound)
        self._counts["recorded"] += new
        self._counts["evicted"] += evicted
        return new

    async def record(self, rank: RankId, chain: Sequence[BlockHash], ttl: float, bound: int) -> int:
        return self._record(rank, chain, ttl, bound)

    async def lookup(
        self, chain: Sequence[BlockHash], starts: Mapping[RankId, int], engines: Collection[str]
    ) -> dict[RankId, int]:
        if not self._ranks or not chain:
            return {}
        found = {}
        for rank, held in self._live_ranks(engines, self._clock()):
            start = starts.get(rank, 0)
            end = routed_run(chain, start, held.entries.__contains__)
            if end > start:
                found[rank] = end
        return found

    async def route(
        self,
        chain: Sequence[BlockHash],
        candidates: Sequence[Candidate],
        weights: TierWeights,
        ttl: float,
    ) -> tuple[Candidate | None, dict[RankId, int]]:
        held = dict(self._live_ranks({c.engine for c in candidates}, self._clock()))
        runs: dict[RankId, int] = {}
        scored = []
        for c in candidates:
            rank, start = RankId(c.engine, c.dp_rank), c.match.gpu_blocks
            entries = held[rank].entries if rank in held else {}
            end = routed_run(chain, start, entries.__contains__)
            if end > start:
                runs[rank] = end
            scored.append((c, score(c.match, end, weights), len(entries)))
        pick = best(scored)
        if pick is not None and pick.match.gpu_blocks < len(chain):
            rank = RankId(pick.engine, pick.dp_rank)
            self._record(rank, chain[pick.match.gpu_blocks :], ttl, pick.bound)
            runs[rank] = len(chain)
        return pick, runs

    def _confirm(self, rank: RankId, hashes: Sequence[BlockHash]) -> None:
        held = self._ranks.get(rank)
        if held is None:
            return
        now = self._clock()
        self._counts["expired"] += held.expire(now)
        entries = held.entries
        confirmed = sum(entries.pop(h, None) is not None for h in hashes)
        self._counts["confirmed"] += confirmed
        if not entries:
            del self._ranks[rank]

    def _clear(self, rank: RankId) -> None:
        held = self._ranks.pop(rank, None)
        if held is not None:
            self._counts["expired"] += held.expire(self._clock())
            self._counts["cleared"] += len(held.entries)

    async def confirm(self, rank: RankId, hashes: Sequence[BlockHash]) -> None:
        self._confirm(rank, hashes)

    async def clear(self, rank: RankId) -> None:
        self._clear(rank)

    async def forget(self, engine: str) -> None:
        for rank in [r for r in self._ranks if r.engine == engine]:
            self._clear(rank)

    def observe(self, rank: RankId, batch: EventBatch) -> None:
        if rank not in self._ranks:
            return  # the common case: nothing routed to this rank
        stored, cleared = confirmations(batch)
        if cleared:
            self._clear(rank)
        if stored:
            self._confirm(rank, stored)

    async def counts(self) -> dict[str, int]:
        self._live_ranks(None, self._clock())
        return self.local_counts()

    def local_counts(self) -> dict[str, int]:
        counts = {name: self._counts[name] for name in COUNTS}
        counts["live"] = sum(len(held.entries) for held in self._ranks.values())
        return counts

    async def close(self) -> None:
        self._ranks.clear()
