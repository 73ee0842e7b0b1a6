"""The embedded store's holder index: for each block hash, which ranks hold it.

A prefix query asks how far each of many engine ranks holds one chain, per
tier. Walking every rank's own tables costs a Python loop per rank per
block (64 engines x 512 blocks: ~3 ms). This index answers for all ranks in
one walk: per medium, ``hash -> bitmask`` of the rank slots whose *scored*
tables of that medium hold the hash; a chain is walked once, its masks
read in C a slice at a time, and each rank's run ends where its bit drops
out.

The index is derived, never the source of truth: each rank's
:class:`~indexer.stores.memory.residency.IndexedResidency` keeps
:class:`~indexer.core.residency.RankResidency`'s exact per-tier refcounts and
sets or clears the rank's bit when a hash enters or leaves the union of its
scored tables of a medium (count 0 <-> above 0, clears, a group's kind
turning scored or not). A hash held by one rank maps to that rank's own bit
object, and masks several ranks share are pooled (one object per distinct
value), so the index costs one dict slot per distinct hash and medium, and
a walk compares runs of equal masks by identity.

Hybrid models' window groups (sliding window, Mamba) have masks of their
own, kept the same way: a hybrid rank's full-attention answer stands where
those masks hold what it ends with (:class:`~indexer.stores.memory.hybrids.Hybrids`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import and_, ne, or_

from indexer.core.events import CPU, GPU, MEDIA, STORAGE, BlockHash, RankId
from indexer.core.matching import PrefixMatch
from indexer.stores.memory.hybrids import Hybrids
from indexer.stores.memory.walk import (
    EMPTY,
    MIN_STEP,
    Digits,
    Media,
    bits_of,
    extended,
    run_classes,
    runs_of,
    segments,
)

_MATCHES_CACHED = 4096
#: Distinct masks kept as one shared object each; past this many the pool starts over
#: (masks already in the index keep their objects: only sharing is lost, not answers).
_POOLED_MASKS = 1 << 12


class HolderIndex:
    """Per medium, ``hash -> bitmask of rank slots``; slots are handed out and reused."""

    def __init__(self) -> None:
        self.media: dict[str, dict[BlockHash, int]] = {m: {} for m in MEDIA}
        #: the same for the window groups (sliding window, Mamba) of hybrid models' ranks
        self.windows: dict[str, dict[BlockHash, int]] = {m: {} for m in MEDIA}
        self._free: list[int] = []
        self._slots = 0
        self._matches: dict[tuple, PrefixMatch] = {}
        self._pool: dict[int, int] = {}  # mask -> the one object the index holds for it
        self._digits: Digits | None = None  # rebuilt when the number of slots grows
        self._named: dict[int, RankId] = {}  # bit -> the rank on it
        self._learned: dict[int, int] = {}  # bit -> the chunk size its rank learned

    def take_bit(self) -> int:
        """A bit no live rank uses (its hashes were all discarded when it was released)."""
        if self._free:
            return self._free.pop()
        self._slots += 1
        self._digits = None
        bit = 1 << (self._slots - 1)
        return self._pool.setdefault(bit, bit)

    def release_bit(self, bit: int) -> None:
        self._named.pop(bit, None)
        self._learned.pop(bit, None)
        self._free.append(bit)

    def name(self, bit: int, rank: RankId) -> None:
        """Name ``rank`` as the one on ``bit``: answers are keyed by it."""
        self._named[bit] = rank
        self._learned.pop(bit, None)

    def learned(self, bit: int, size: int | None) -> None:
        """The chunk size ``bit``'s rank learned from its events (None: none): its
        size wherever a query declares none for its engine."""
        if bit not in self._named:
            raise KeyError(bit)
        if size:
            self._learned[bit] = size
        else:
            self._learned.pop(bit, None)

    def add(
        self, medium: str, bit: int, hashes: Iterable[BlockHash], media: Media | None = None
    ) -> None:
        """Set ``bit`` on every hash (idempotent). A new hash gets ``bit`` itself.

        All in C: a hash seen for the first time takes the rank's own bit object
        (``setdefault``); only hashes other ranks hold too get a new mask.
        ``media``: :attr:`media` (the default) or :attr:`windows`.
        """
        index = (media or self.media)[medium]
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        before = list(map(index.setdefault, hashes, repeat(bit)))
        if before.count(bit) != len(before):
            shared = list(map(ne, before, repeat(bit)))
            masks = self._pooled(map(or_, compress(before, shared), repeat(bit)))
            index.update(zip(compress(hashes, shared), masks, strict=True))

    def discard(
        self, medium: str, bit: int, hashes: Iterable[BlockHash], media: Media | None = None
    ) -> None:
        """Clear ``bit`` on every hash (idempotent); a hash no rank holds leaves."""
        index = (media or self.media)[medium]
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        before = list(map(index.pop, hashes, repeat(0)))
        if before.count(bit) != len(before):
            rest = list(map(and_, before, repeat(~bit)))
            masks = self._pooled(compress(rest, rest))
            index.update(zip(compress(hashes, rest), masks, strict=True))

    def _pooled(self, masks: Iterable[int]) -> Iterator[int]:
        """The masks as the pool's objects: a walk compares runs of equal masks by
        identity, and a mask many hashes share costs one int, not one per hash."""
        pool = self._pool
        if len(pool) > _POOLED_MASKS:
            pool.clear()
        masks = list(masks)
        return map(pool.setdefault, masks, masks)

    def match(
        self,
        chain: Sequence[BlockHash],
        chunk_blocks: Mapping[str, int | None],
        hybrids: Hybrids | None = None,
    ) -> dict[RankId, PrefixMatch]:
        """The prefix match of each named rank of the engines ``chunk_blocks`` lists
        that matches something (the others are left out), with the chunk size it gives
        the engine, else the one the rank learned (none: GPU only).
        """
        listed = [
            (rank, bit, chunk_blocks[rank.engine] or self._learned.get(bit))
            for bit, rank in self._named.items()
            if rank.engine in chunk_blocks
        ]
        if not listed:
            return {}
        ranks, bits, sizes = (list(column) for column in zip(*listed, strict=True))
        found = self._match(chain, ranks, bits, sizes, hybrids)
        return {rank: match for rank, match in found.items() if match != EMPTY}

    def _match(
        self,
        chain: Sequence[BlockHash],
        ranks: list[RankId],
        bits: list[int],
        sizes: list[int | None],
        hybrids: Hybrids | None,
    ) -> dict[RankId, PrefixMatch]:
        """Every rank's prefix match, given its bit (from :meth:`take_bit`) and chunk size
        (None or 0: GPU only).

        Same answers as :func:`~indexer.core.matching.match_prefix` over each rank's
        own tables (the conformance suite and ``tests/test_holders.py`` hold
        it to that). Every run is found for all ranks at once, on bitmasks
        (see :func:`segments`): the GPU run here, the lower tiers' in
        :meth:`_chunked`. Ranks sharing every run length form a class and
        share one answer; :meth:`Digits.spread` hands each rank its class's.
        A rank holding neither the first block nor the first chunk of any
        tier matches nothing and gets the shared empty answer. The ranks of
        ``hybrids`` then have their answers taken to vLLM's hybrid rule
        (:meth:`Hybrids.refine`).
        """
        if not chain or not ranks:
            return dict.fromkeys(ranks, EMPTY)
        gpu_index, cpu, storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        head = gpu_index.get(chain[0], 0)
        groups: dict[int, int] = {}
        asked = _groups(bits, sizes)
        for size, group in asked.items():
            if size:  # a chunk size longer than the chain means GPU only, like size 0
                end = chain[size - 1] if size <= len(chain) else None
                group &= head | cpu.get(end, 0) | storage.get(end, 0)
            else:
                group &= head
            if group:
                groups[size] = group
        if not groups and hybrids is None:
            return dict.fromkeys(ranks, EMPTY)
        everyone = sum(groups.values())  # the groups are disjoint
        gpu = segments(gpu_index.get, chain, everyone & head)
        if everyone & ~head:
            gpu.append((0, everyone & ~head))
        answers: list[tuple[int, PrefixMatch]] = []
        for size, group in groups.items():
            if 0 < size <= len(chain):
                self._chunked(answers, gpu, chain, size, group)
            else:
                answers += [
                    (m & group, self._cached(g, 0, 0, g, 0, 0)) for g, m in gpu if g and m & group
                ]
        if hybrids is not None:
            answers = hybrids.refine(answers, chain, asked, self.windows)
        return (self._digits or self._owned()).spread(answers, ranks, bits)

    def _chunked(
        self,
        answers: list[tuple[int, PrefixMatch]],
        gpu: list[tuple[int, int]],
        chain: Sequence[BlockHash],
        size: int,
        group: int,
    ) -> None:
        """Add the answers of the ``group`` ranks, matched in chunks of ``size`` blocks.

        The prefix is the GPU run extended by the chunks after it that a
        lower tier holds, CPU first. Were CPU the only lower tier, a rank's
        prefix would stop at a chunk found by :func:`extended`. Only a rank
        holding that chunk on STORAGE goes further: it is combined chunk by
        chunk (:meth:`_lower`); everyone else's extension is all from CPU.
        """
        ends = chain[size - 1 :: size]
        cpu, storage = self.media[CPU], self.media[STORAGE]
        on_first = group & cpu.get(ends[0], 0)
        # CPU runs mostly follow GPU runs: read that far in one slice
        guess = max([g for g, m in gpu if m & on_first], default=0) // size + 1
        on_cpu = runs_of(cpu.get, ends, group, on_first, max(guess, MIN_STEP))
        on_storage = (
            runs_of(storage.get, ends, group, group & storage.get(ends[0], 0))
            if storage
            else [(0, group)]
        )
        classes = run_classes(gpu, on_cpu, on_storage, group)
        for mask, g, c, s, n in extended(classes, cpu.get, ends, size):
            mixed = mask & storage.get(ends[n], 0) if storage and n < len(ends) else 0
            for bit in bits_of(mixed):
                answers.append((bit, self._lower(bit, g, size, ends, c, s)))
            mask &= ~mixed
            prefix = max(g, n * size)
            if mask and (prefix or c or s):  # an empty answer is the default
                answers.append((mask, self._cached(g, c * size, s * size, prefix, prefix - g, 0)))

    def _owned(self) -> Digits:
        digits = self._digits = Digits(self._slots)
        return digits

    def _lower(
        self, bit: int, gpu: int, size: int, ends: Sequence, cpu_run: int, storage_run: int
    ) -> PrefixMatch:
        """Lower-tier runs and the prefix: the GPU run extended by whole chunks, CPU first."""
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


def _groups(bits: Sequence[int], sizes: Sequence[int | None]) -> dict[int, int]:
    """Chunk size (0: GPU only) -> the bits of the ranks matched with it."""
    if sizes.count(sizes[0]) == len(sizes):
        return {sizes[0] or 0: sum(bits)}  # bits are distinct powers of two
    groups: dict[int, int] = {}
    for bit, size in zip(bits, sizes, strict=True):
        groups[size or 0] = groups.get(size or 0, 0) | bit
    return groups
