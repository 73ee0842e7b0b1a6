"""The embedded store's holder index: for each block hash, which ranks hold it.

A prefix query asks how far each of many engine ranks holds one chain, per
tier. Walking every rank's own tables costs a Python loop per rank per
block (64 engines x 512 blocks: ~3 ms). This index answers for all ranks in
one walk: per medium, ``hash -> bitmask`` of the rank slots whose *scored*
tables of that medium hold the hash; a chain is walked once, in C
(``accumulate`` of ``and`` over the masks), and each rank's run ends where
its bit drops out.

The index is derived, never the source of truth: :class:`IndexedResidency`
keeps :class:`~indexer.model.RankResidency`'s exact per-tier refcounts and
sets or clears the rank's bit when a hash enters or leaves the union of its
scored tables of a medium (count 0 <-> above 0, clears, a group's kind
turning scored or not). A hash held by one rank maps to that rank's own bit
object, so the index costs one dict slot per distinct hash and medium.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, filterfalse, repeat
from operator import and_, ne, neg, or_

from indexer.model import (
    CPU,
    GPU,
    MEDIA,
    STORAGE,
    PrefixMatch,
    RankId,
    RankResidency,
    Tier,
    TierOp,
    _decrement,
    is_scored,
)
from indexer.wire import BlockHash

_MATCHES_CACHED = 4096
_EMPTY = PrefixMatch()
#: Blocks looked up per C pass of a walk: more passes cost Python, longer ones overshoot.
_MAX_STEP = 64


class HolderIndex:
    """Per medium, ``hash -> bitmask of rank slots``; slots are handed out and reused."""

    def __init__(self) -> None:
        self.media: dict[str, dict[BlockHash, int]] = {m: {} for m in MEDIA}
        self._free: list[int] = []
        self._slots = 0
        self._matches: dict[tuple, PrefixMatch] = {}

    def take_bit(self) -> int:
        """A bit no live rank uses (its hashes were all discarded when it was released)."""
        if self._free:
            return self._free.pop()
        self._slots += 1
        return 1 << (self._slots - 1)

    def release_bit(self, bit: int) -> None:
        self._free.append(bit)

    def add(self, medium: str, bit: int, hashes: Iterable[BlockHash]) -> None:
        """Set ``bit`` on every hash (idempotent). A new hash gets ``bit`` itself.

        All in C: a hash seen for the first time takes the rank's own bit object
        (``setdefault``); only hashes other ranks hold too get a new mask.
        """
        index = self.media[medium]
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        before = list(map(index.setdefault, hashes, repeat(bit)))
        if before.count(bit) != len(before):
            shared = list(map(ne, before, repeat(bit)))
            masks = map(or_, compress(before, shared), repeat(bit))
            index.update(zip(compress(hashes, shared), masks, strict=True))

    def discard(self, medium: str, bit: int, hashes: Iterable[BlockHash]) -> None:
        """Clear ``bit`` on every hash (idempotent); a hash no rank holds leaves."""
        index = self.media[medium]
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        before = list(map(index.pop, hashes, repeat(0)))
        if before.count(bit) != len(before):
            rest = list(map(and_, before, repeat(~bit)))
            index.update(zip(compress(hashes, rest), compress(rest, rest), strict=True))

    def match(
        self, chain: Sequence[BlockHash], ranks: Sequence[tuple[RankId, int, int | None]]
    ) -> dict[RankId, PrefixMatch]:
        """The prefix match of each ``(rank, bit, chunk_blocks)``.

        Same answers as :func:`~indexer.model.match_prefix` over each rank's
        own tables (the conformance suite and ``tests/test_holders.py`` hold
        it to that). A rank holding neither the first block nor the first
        chunk of any tier matches nothing: it gets the shared empty answer
        without further work, so a query costs what the ranks that hold
        something cost.
        """
        out = dict.fromkeys([rank for rank, _, _ in ranks], _EMPTY)
        if not chain:
            return out
        gpu_index, cpu, storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        first = {None: gpu_index.get(chain[0], 0)}  # chunk size -> who holds anything at all
        for _, _, size in ranks:
            if size not in first:
                end = chain[size - 1] if size <= len(chain) else None
                first[size] = first[None] | cpu.get(end, 0) | storage.get(end, 0)
        relevant = [(rank, bit, size) for rank, bit, size in ranks if bit & first[size or None]]
        if not relevant:
            return out
        everyone = 0
        for _, bit, _ in relevant:
            everyone |= bit
        gpu = _runs(gpu_index, chain, everyone & first[None])
        lower: dict[int, tuple] = {}  # chunk size -> chunk ends, CPU runs, STORAGE runs
        for rank, bit, size in relevant:
            held = gpu.get(bit, 0)
            if not size:
                out[rank] = self._cached(held, 0, 0, held, 0, 0)
                continue
            tiers = lower.get(size)
            if tiers is None:
                ends = chain[size - 1 :: size]
                group = 0
                for _, b, s in relevant:
                    group |= b if s == size else 0
                tiers = lower[size] = (
                    ends,
                    _runs(cpu, ends, group),
                    _runs(storage, ends, group) if storage else {},
                )
            out[rank] = self._lower(bit, held, size, *tiers)
        return out

    def _lower(
        self, bit: int, gpu: int, size: int, ends: Sequence, cpu_runs: dict, storage_runs: dict
    ) -> PrefixMatch:
        """Lower-tier runs and the prefix: the GPU run extended by whole chunks, CPU first."""
        cpu_run, storage_run = cpu_runs.get(bit, 0), storage_runs.get(bit, 0)
        prefix, from_cpu, from_storage = gpu, 0, 0
        cpu, storage = self.media[CPU], self.media[STORAGE]
        j = gpu // size
        while j < len(ends):
            if j < cpu_run:  # chunks j .. cpu_run - 1 are all on CPU
                from_cpu += cpu_run * size - prefix
                prefix, j = cpu_run * size, cpu_run
                continue
            if cpu.get(ends[j], 0) & bit:
                from_cpu += (j + 1) * size - prefix
            elif j < storage_run or storage.get(ends[j], 0) & bit:
                from_storage += (j + 1) * size - prefix
            else:
                break
            prefix, j = (j + 1) * size, j + 1
        return self._cached(gpu, cpu_run * size, storage_run * size, prefix, from_cpu, from_storage)

    def _cached(self, *fields: int) -> PrefixMatch:
        """One shared (immutable) answer per distinct value: most ranks repeat a few."""
        match = self._matches.get(fields)
        if match is None:
            match = PrefixMatch(*fields)
            if len(self._matches) < _MATCHES_CACHED:
                self._matches[fields] = match
        return match


def _runs(index: dict[BlockHash, int], keys: Sequence[BlockHash], active: int) -> dict[int, int]:
    """``bit -> length`` of the leading run of ``keys`` each bit of ``active`` holds.

    Bits that hold not even the first key are left out. The masks are read
    and and-ed in C, in slices that grow, so a short match stops early; the
    and-ed masks only lose bits (so they only decrease), and each point where
    bits drop out is found by bisection.
    """
    out: dict[int, int] = {}
    get = index.get
    if keys:
        active &= get(keys[0], 0)
    pos, step = 0, 16
    while active and pos < len(keys):
        piece = keys[pos : pos + step]
        masks = list(accumulate(map(get, piece, repeat(0)), and_, initial=active))
        k = 0
        while masks[-1] != active:
            k = bisect_right(masks, -active, k, key=neg)  # the first mask below ``active``
            _record(out, active & ~masks[k], pos + k - 1)
            active = masks[k]
        pos += len(piece)
        step = min(2 * step, _MAX_STEP)
    _record(out, active, len(keys))
    return out


def _record(out: dict[int, int], bits: int, length: int) -> None:
    if not length:
        return
    while bits:
        low = bits & -bits
        out[low] = length
        bits ^= low


@dataclass
class IndexedResidency(RankResidency):
    """A rank's exact residency that keeps its bit in a :class:`HolderIndex` in step."""

    index: HolderIndex = field(default_factory=HolderIndex)
    bit: int = 0
    #: tier -> the other scored tables of its medium, or None if the tier is not scored;
    #: valid while the rank's tables and group kinds stay as they were.
    _peers: dict[Tier, list | None] = field(default_factory=dict, repr=False, compare=False)
    _peers_of: int = -1  # len(tables) when _peers was filled

    def _store(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> None:
        fresh = list(filterfalse(counts.__contains__, hashes))
        super()._store(tier, counts, hashes)
        if fresh:
            peers = self._scored_peers(tier)
            if peers is not None:
                self.index.add(tier.medium, self.bit, _alone(fresh, peers))

    def _remove(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> int:
        gone: list[BlockHash] = []
        unknown = _decrement(counts, hashes, gone)
        if gone:
            peers = self._scored_peers(tier)
            if peers is not None:
                self.index.discard(tier.medium, self.bit, _alone(gone, peers))
        return unknown

    def _learn(self, op: TierOp) -> None:
        group = op.tier.group_idx
        was = is_scored(self.group_kinds.get(group))
        super()._learn(op)
        if is_scored(self.group_kinds.get(group)) != was:
            self._rescore(group, was)

    def clear(self, media: Iterable[str]) -> None:
        media = list(media)
        for medium in media:
            self.index.discard(medium, self.bit, self._union(medium))
        super().clear(media)
        self._peers_of = -1

    def release(self) -> None:
        """Leave the index: the rank is forgotten."""
        self.clear(MEDIA)
        self.index.release_bit(self.bit)

    def _scored_peers(self, tier: Tier) -> list | None:
        """None if the tier is not scored, else the other scored tables of its medium."""
        if self._peers_of != len(self.tables):
            self._peers.clear()
            self._peers_of = len(self.tables)
        if tier not in self._peers:
            kinds = self.group_kinds
            self._peers[tier] = (
                [
                    t.counts
                    for other, t in self.tables.items()
                    if other != tier
                    and other.medium == tier.medium
                    and is_scored(kinds.get(other.group_idx))
                ]
                if is_scored(kinds.get(tier.group_idx))
                else None
            )
        return self._peers[tier]

    def _union(self, medium: str) -> Iterable[BlockHash]:
        tables = self.scored_tables(medium)
        return tables[0].keys() if len(tables) == 1 else set().union(*tables)

    def _rescore(self, group: int, was_scored: bool) -> None:
        """A group's kind turned it scored or not: move its tables' hashes in or out."""
        self._peers_of = -1
        media = {tier.medium for tier in self.tables if tier.group_idx == group}
        for medium in media:
            moved = set().union(
                *(
                    t.counts
                    for tier, t in self.tables.items()
                    if tier.medium == medium and tier.group_idx == group
                )
            )
            if was_scored:  # out, unless another scored table still holds them
                self.index.discard(medium, self.bit, moved.difference(self._union(medium)))
            else:
                self.index.add(medium, self.bit, moved)


def _alone(hashes: list[BlockHash], peers: list[dict[BlockHash, int]]) -> list[BlockHash]:
    """The hashes none of ``peers`` holds: those that enter or leave the medium's union."""
    if not peers:
        return hashes
    return [h for h in hashes if not any(h in t for t in peers)]
