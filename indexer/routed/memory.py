"""Routed entries of ``kvindex serve`` with the embedded store: in process.

Each rank keeps its entries in a dict (hash -> deadline) for lookups and, for
what ends first (expired or evicted), the chains they were recorded in, in a
heap by the deadline of their tail: one heap item per ``record``, so routing
a prompt costs C-speed dict work, not a heap push per block. An entry routed
again gets a new deadline and leaves its old copy in an older chain; those
are skipped when they surface and dropped wholesale once they outnumber the
live ones, so a rank's memory stays within about twice its bound.

Beside them, one index for all ranks: hash -> the bits of the ranks it is routed to
(an int mask). A lookup whose prompt several ranks were routed (a shared system
prompt, a conversation routed again) walks the chain once for all of them, not
once per rank.

Every method runs without awaiting, so ``route`` reads and records in one
step of the event loop: two concurrent routers cannot both see the same
empty rank.
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import groupby, islice, repeat, takewhile
from operator import or_

from indexer.core.events import BlockHash, EventBatch, RankId
from indexer.core.load import queued_blocks
from indexer.core.matching import TierWeights
from indexer.core.routed import Candidate, best, confirmations, deadlines, routed_run, score
from indexer.routed.base import COUNTS, Routing


class _RankEntries:
    """One rank's entries (hash -> deadline) and, in a heap by their earliest deadline,
    the chains they were recorded in (hashes with their deadlines, tail last: a chain's
    deadlines fall along it, so its tail ends first)."""

    def __init__(self, holders: dict[BlockHash, int], bit: int) -> None:
        self.holders, self.bit, self._others = holders, bit, ~bit
        self.entries: dict[BlockHash, float] = {}
        self.heap: list[tuple[float, int, list[BlockHash], list[float]]] = []  # chains
        self.pushed = 0  # tie-break of equal deadlines: first recorded ends first
        self.kept = 0  # hashes the heap's chains hold, current or not

    def _push(self, hashes: list[BlockHash], ends: list[float]) -> None:
        heapq.heappush(self.heap, (ends[-1], self.pushed, hashes, ends))
        self.pushed += 1
        self.kept += len(hashes)

    def _drop_tail(self, stop: Callable[[float], bool]) -> int:
        """Pop the chain ending first and drop its entries from the tail while
        ``stop(deadline)`` is false, pushing back what is left; how many were current."""
        _, _, hashes, ends = heapq.heappop(self.heap)
        self.kept -= len(hashes)
        entries, gone, i = self.entries, 0, len(hashes)
        while i and not stop(ends[i - 1]):
            i -= 1
            if entries.get(hashes[i]) == ends[i]:  # else routed again since
                del entries[hashes[i]]
                self._unhold(hashes[i])
                gone += 1
        if i:
            self._push(hashes[:i], ends[:i])
        return gone

    def expire(self, now: float) -> int:
        """Drop the entries whose deadline has passed; how many."""
        gone = 0
        while self.heap and self.heap[0][0] <= now:
            gone += self._drop_tail(lambda d: d > now)
        return gone

    def record(self, chain: Sequence[BlockHash], now: float, ttl: float, bound: int) -> tuple:
        """Route ``chain`` here; (new entries, entries evicted past ``bound``)."""
        entries, hashes = self.entries, list(chain)
        if not hashes:
            return 0, 0
        ends = deadlines(now, ttl, len(hashes))
        new = len(hashes) - sum(map(entries.__contains__, hashes))
        entries.update(zip(hashes, ends, strict=True))
        holders = self.holders
        masks = list(map(or_, map(holders.get, hashes, repeat(0)), repeat(self.bit)))
        holders.update(zip(hashes, masks, strict=True))
        self._push(hashes, ends)
        evicted = 0
        while len(entries) > bound:
            evicted += self._drop_tail(lambda d: len(entries) <= bound)
        if self.kept > 2 * len(entries) + 1024:
            self._compact()
        return new, evicted

    def _unhold(self, h: BlockHash) -> None:
        """This rank no longer holds ``h`` (its entry is gone)."""
        mask = self.holders[h] & self._others
        if mask:
            self.holders[h] = mask
        else:
            del self.holders[h]

    def pop(self, hashes: Sequence[BlockHash]) -> int:
        """End the entries of ``hashes`` held here; how many there were."""
        entries, popped = self.entries, 0
        for h in hashes:
            if entries.pop(h, None) is not None:
                self._unhold(h)
                popped += 1
        return popped

    def release(self) -> None:
        """End every entry (the rank is dropped): its bit leaves the index."""
        for h in self.entries:
            self._unhold(h)
        self.entries.clear()

    def _compact(self) -> None:
        """Forget what the heap's chains hold that was routed again since."""
        entries, chains = self.entries, self.heap
        self.heap, self.kept = [], 0
        for _, _, hashes, ends in chains:
            kept = [(h, d) for h, d in zip(hashes, ends, strict=True) if entries.get(h) == d]
            if kept:
                self._push([h for h, _ in kept], [d for _, d in kept])


class MemoryRouted:
    """:class:`~indexer.routed.base.RoutedEntries` in process. ``clock``: seconds,
    monotonic (tests may pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ranks: dict[RankId, _RankEntries] = {}
        self._holders: dict[BlockHash, int] = {}  # hash -> bits of the ranks holding it
        self._free_bits: list[int] = []  # a heap: the lowest comes back first, masks stay short
        self._by_bit: dict[int, RankId] = {}
        self._next_expiry = math.inf  # no entry anywhere ends before it
        self._counts: Counter[str] = Counter()

    def _entries_of(self, rank: RankId) -> _RankEntries:
        held = self._ranks.get(rank)
        if held is None:
            index = heapq.heappop(self._free_bits) if self._free_bits else len(self._ranks)
            held = self._ranks[rank] = _RankEntries(self._holders, 1 << index)
            self._by_bit[held.bit] = rank
        return held

    def _drop(self, rank: RankId) -> _RankEntries:
        """Forget the rank: its entries leave the index, its bit is free again."""
        held = self._ranks.pop(rank)
        held.release()
        del self._by_bit[held.bit]
        heapq.heappush(self._free_bits, held.bit.bit_length() - 1)
        return held

    def _live_ranks(self, engines: Collection[str] | None, now: float) -> list[tuple]:
        """``(rank, entries)`` of the ranks of ``engines`` (None: all), expired
        entries dropped first."""
        found = []
        for rank, held in list(self._ranks.items()):
            if engines is not None and rank.engine not in engines:
                continue
            self._counts["expired"] += held.expire(now)
            if not held.entries:
                self._drop(rank)
                continue
            found.append((rank, held))
        return found

    def _record(self, rank: RankId, chain: Sequence[BlockHash], ttl: float, bound: int) -> int:
        now = self._clock()
        held = self._entries_of(rank)
        self._counts["expired"] += held.expire(now)
        new, evicted = held.record(chain, now, ttl, bound)
        if held.heap:
            self._next_expiry = min(self._next_expiry, held.heap[0][0])
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
        # Runs per query, so the common cases touch no rank: expiry is looked at only
        # once some entry's deadline has passed (then for every rank), and a rank is
        # walked only if it holds the block after its exact run: one index lookup per
        # rank with an exact run, one (block 0) for all the others.
        now, n, holders, ranks, walked = self._clock(), len(chain), self._holders, self._ranks, []
        if now >= self._next_expiry:
            self._live_ranks(None, now)
            self._next_expiry = min((held.heap[0][0] for held in ranks.values()), default=math.inf)
        for rank, start in starts.items():
            if start < n and chain[start] in holders and rank.engine in engines:
                held = ranks.get(rank)
                if held is not None and holders[chain[start]] & held.bit:
                    walked.append((start, rank, held.bit))
        first = holders.get(chain[0], 0)
        while first:
            bit = first & -first
            first ^= bit
            rank = self._by_bit[bit]
            if rank not in starts and rank.engine in engines:
                walked.append((0, rank, bit))
        if len(walked) == 1:
            start, rank, _ = walked[0]
            return {rank: routed_run(chain, start, self._ranks[rank].entries.__contains__)}
        return self._runs(chain, walked) if walked else {}

    def _runs(self, chain: Sequence[BlockHash], walked: list[tuple]) -> dict[RankId, int]:
        """The routed runs of several ranks (``(start, rank, bit)``) in one walk: the
        chain's masks are read from the lowest start while some of those ranks hold
        the block, in stretches of equal masks; each rank's run ends at the first
        stretch without its bit. A rank starting past the walk's end starts another."""
        walked.sort(key=lambda w: w[0])
        holders, wanted, found, i = self._holders, 0, {}, 0
        for _, _, bit in walked:
            wanted |= bit
        while i < len(walked):
            pos = walked[i][0]
            held = map(holders.get, islice(chain, pos, None), repeat(0))
            ends, masks = [], []
            for mask, stretch in groupby(takewhile(wanted.__and__, held)):
                pos += len(list(stretch))
                ends.append(pos)
                masks.append(mask)
            while i < len(walked) and walked[i][0] < pos:
                start, rank, bit = walked[i]
                k = bisect_right(ends, start)
                while k < len(ends) and masks[k] & bit:
                    k += 1
                found[rank] = ends[k - 1]
                i += 1
        return found

    async def route(
        self,
        chain: Sequence[BlockHash],
        candidates: Sequence[Candidate],
        weights: TierWeights,
        ttl: float,
    ) -> Routing:
        held = dict(self._live_ranks({c.engine for c in candidates}, self._clock()))
        runs: dict[RankId, int] = {}
        queues: dict[RankId, int] = {}
        scored = []
        for c in candidates:
            rank, start = RankId(c.engine, c.dp_rank), c.match.gpu_blocks
            entries = held[rank].entries if rank in held else {}
            end = routed_run(chain, start, entries.__contains__)
            if end > start:
                runs[rank] = end
            queued = queued_blocks(len(entries), end - start)
            if queued:
                queues[rank] = queued
            scored.append((c, score(c.match, end, weights), len(entries), queued))
        pick = best(scored, len(chain))
        if pick is not None and pick.match.gpu_blocks < len(chain):
            rank = RankId(pick.engine, pick.dp_rank)
            self._record(rank, chain[pick.match.gpu_blocks :], ttl, pick.bound)
        return pick, runs, queues

    def _confirm(self, rank: RankId, hashes: Sequence[BlockHash]) -> None:
        held = self._ranks.get(rank)
        if held is None:
            return
        now = self._clock()
        self._counts["expired"] += held.expire(now)
        self._counts["confirmed"] += held.pop(hashes)
        if not held.entries:
            self._drop(rank)

    def _clear(self, rank: RankId) -> None:
        held = self._ranks.get(rank)
        if held is not None:
            self._counts["expired"] += held.expire(self._clock())
            self._counts["cleared"] += len(held.entries)
            self._drop(rank)

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
        self._holders.clear()
        self._free_bits.clear()
        self._by_bit.clear()
        self._next_expiry = math.inf
