"""The embedded store's holder index: for each block hash, which ranks hold it.

A prefix query asks how far each of many engine ranks holds one chain, per
tier. Walking every rank's own tables costs a Python loop per rank per
block (64 engines x 512 blocks: ~3 ms). This index answers for all ranks in
one walk: per medium, ``hash -> bitmask`` of the rank slots whose *scored*
tables of that medium hold the hash; a chain is walked once, its masks
read in C a slice at a time, and each rank's run ends where its bit drops
out.

The index is derived, never the source of truth: :class:`IndexedResidency`
keeps :class:`~indexer.model.RankResidency`'s exact per-tier refcounts and
sets or clears the rank's bit when a hash enters or leaves the union of its
scored tables of a medium (count 0 <-> above 0, clears, a group's kind
turning scored or not). A hash held by one rank maps to that rank's own bit
object, and masks several ranks share are pooled (one object per distinct
value), so the index costs one dict slot per distinct hash and medium, and
a walk compares runs of equal masks by identity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, filterfalse, repeat
from operator import and_, ne, or_

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
#: Distinct masks kept as one shared object each; past this many the pool starts over
#: (masks already in the index keep their objects: only sharing is lost, not answers).
_POOLED_MASKS = 1 << 12
_EMPTY = PrefixMatch()
#: Keys looked up per C pass of a walk: more passes cost Python, longer ones overshoot.
#: A walk starts with a short pass (many end at once), or as far as it guesses it goes.
_MIN_STEP, _MAX_STEP = 16, 64


class HolderIndex:
    """Per medium, ``hash -> bitmask of rank slots``; slots are handed out and reused."""

    def __init__(self) -> None:
        self.media: dict[str, dict[BlockHash, int]] = {m: {} for m in MEDIA}
        self._free: list[int] = []
        self._slots = 0
        self._matches: dict[tuple, PrefixMatch] = {}
        self._pool: dict[int, int] = {}  # mask -> the one object the index holds for it
        self._digits: _Digits | None = None  # rebuilt when the number of slots grows

    def take_bit(self) -> int:
        """A bit no live rank uses (its hashes were all discarded when it was released)."""
        if self._free:
            return self._free.pop()
        self._slots += 1
        self._digits = None
        bit = 1 << (self._slots - 1)
        return self._pool.setdefault(bit, bit)

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
            masks = self._pooled(map(or_, compress(before, shared), repeat(bit)))
            index.update(zip(compress(hashes, shared), masks, strict=True))

    def discard(self, medium: str, bit: int, hashes: Iterable[BlockHash]) -> None:
        """Clear ``bit`` on every hash (idempotent); a hash no rank holds leaves."""
        index = self.media[medium]
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
        ranks: Sequence[RankId],
        bits: Sequence[int],
        sizes: Sequence[int | None],
    ) -> dict[RankId, PrefixMatch]:
        """The prefix match of each rank, given its bit (from :meth:`take_bit`) and chunk size.

        A chunk size of None or 0 means the rank is matched on GPU only.

        Same answers as :func:`~indexer.model.match_prefix` over each rank's
        own tables (the conformance suite and ``tests/test_holders.py`` hold
        it to that). Every run is found for all ranks at once, on bitmasks
        (see :func:`_segments`): the GPU run here, the lower tiers' in
        :meth:`_chunked`. Ranks sharing every run length form a class and
        share one answer; :meth:`_Digits.spread` hands each rank its class's.
        A rank holding neither the first block nor the first chunk of any
        tier matches nothing and gets the shared empty answer.
        """
        if not chain or not ranks:
            return dict.fromkeys(ranks, _EMPTY)
        gpu_index, cpu, storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        head = gpu_index.get(chain[0], 0)
        groups: dict[int, int] = {}
        for size, group in _groups(bits, sizes).items():
            if size:  # a chunk size longer than the chain means GPU only, like size 0
                end = chain[size - 1] if size <= len(chain) else None
                group &= head | cpu.get(end, 0) | storage.get(end, 0)
            else:
                group &= head
            if group:
                groups[size] = group
        if not groups:
            return dict.fromkeys(ranks, _EMPTY)
        everyone = sum(groups.values())  # the groups are disjoint
        gpu = _segments(gpu_index.get, chain, everyone & head)
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
        prefix would stop at a chunk found by :func:`_extended`. Only a rank
        holding that chunk on STORAGE goes further: it is combined chunk by
        chunk (:meth:`_lower`); everyone else's extension is all from CPU.
        """
        ends = chain[size - 1 :: size]
        cpu, storage = self.media[CPU], self.media[STORAGE]
        on_first = group & cpu.get(ends[0], 0)
        # CPU runs mostly follow GPU runs: read that far in one slice
        guess = max([g for g, m in gpu if m & on_first], default=0) // size + 1
        on_cpu = _runs(cpu.get, ends, group, on_first, max(guess, _MIN_STEP))
        on_storage = (
            _runs(storage.get, ends, group, group & storage.get(ends[0], 0))
            if storage
            else [(0, group)]
        )
        classes = _classes(gpu, on_cpu, on_storage, group)
        for mask, g, c, s, n in _extended(classes, cpu.get, ends, size):
            mixed = mask & storage.get(ends[n], 0) if storage and n < len(ends) else 0
            for bit in _bits(mixed):
                answers.append((bit, self._lower(bit, g, size, ends, c, s)))
            mask &= ~mixed
            prefix = max(g, n * size)
            if mask and (prefix or c or s):  # an empty answer is the default
                answers.append((mask, self._cached(g, c * size, s * size, prefix, prefix - g, 0)))

    def _owned(self) -> _Digits:
        digits = self._digits = _Digits(self._slots)
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


def _segments(
    get: Callable[[BlockHash], int | None],
    keys: Sequence[BlockHash],
    active: int,
    step: int = _MIN_STEP,
    start: int = 0,
) -> list[tuple[int, int]]:
    """``(end, bits)`` pairs: where each bit of ``active`` stops holding ``keys[start:]``.

    ``get`` gives a key's holder mask (None: no holder). The pairs partition
    ``active``; a bit holding every key ends at ``len(keys)``. Keys are read
    in C, a slice at a time (``step`` keys, doubling up to ``_MAX_STEP``), so
    a walk ends within a slice of where the last bit drops out. Masks come in long
    runs of equal values (a shared system prompt, then one rank's turns):
    a slice that only repeats the last mask is passed over in C (``count``),
    and elsewhere only the positions where the mask changes are looked at.
    """
    out: list[tuple[int, int]] = []
    pos, last, length = start, None, len(keys)
    while active and pos < length:
        piece = list(map(get, keys[pos : pos + step]))
        step = min(2 * step, _MAX_STEP)
        if piece.count(last) != len(piece):
            for i in compress(count(pos), map(ne, piece, [last, *piece])):
                kept = active & (piece[i - pos] or 0)
                if kept != active:
                    out.append((i, active ^ kept))
                    active = kept
                    if not active:
                        break
            last = piece[-1]
        pos += len(piece)
    if active:
        out.append((length, active))
    return out


def _runs(
    get: Callable[[BlockHash], int | None],
    keys: Sequence[BlockHash],
    group: int,
    first: int,
    step: int = _MIN_STEP,
) -> list[tuple[int, int]]:
    """:func:`_segments` over ``group``, given ``first``, the mask of ``keys[0]``.

    Most walks of a lower tier end at once: those cost no slice.
    """
    active = group & first
    out = _segments(get, keys, active, step) if active else []
    if group != active:
        out.append((0, group & ~active))
    return out


def _classes(
    gpu: list[tuple[int, int]],
    on_cpu: list[tuple[int, int]],
    on_storage: list[tuple[int, int]],
    group: int,
) -> list[tuple[int, int, int, int]]:
    """``(bits, GPU run, CPU run, STORAGE run)``: the ``group`` ranks sharing all three runs."""
    out = []
    for g, on_gpu in gpu:
        on_gpu &= group
        for c, bits in on_cpu:
            if on_gpu & bits:
                for s, more in on_storage:
                    if on_gpu & bits & more:
                        out.append((on_gpu & bits & more, g, c, s))
    return out


def _extended(
    classes: list[tuple[int, int, int, int]],
    get: Callable[[BlockHash], int | None],
    ends: Sequence[BlockHash],
    size: int,
) -> list[tuple[int, int, int, int, int]]:
    """Each class with ``n``, the chunk where its prefix stops if only CPU may extend it.

    Chunk ``g // size`` is the first not wholly inside the GPU run. A CPU
    run reaching it ends there too; otherwise the CPU run starting at that
    chunk is walked (once for all the classes starting there), and the
    classes split by it.
    """
    out = []
    later: dict[int, list[tuple[int, int, int, int]]] = {}
    for bits, g, c, s in classes:
        if c >= g // size:
            out.append((bits, g, c, s, c))
        else:
            later.setdefault(g // size, []).append((bits, g, c, s))
    for first, waiting in later.items():
        active = sum(bits for bits, *_ in waiting)
        if first < len(ends):
            on = active & (get(ends[first]) or 0)
            runs = _segments(get, ends, on, _MIN_STEP, first) if on else []
            if active != on:
                runs.append((first, active & ~on))
        else:
            runs = [(first, active)]
        for bits, g, c, s in waiting:
            out += [(bits & held, g, c, s, n) for n, held in runs if bits & held]
    return out


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


#: ``_CLASS[k]`` turns a mask's binary digits into bytes: k for each 1, 0 for each 0.
_CLASS = [bytes.maketrans(b"01", bytes((0, k))) for k in range(256)]


class _Digits:
    """The binary digits of a rank mask, to hand whole classes of ranks their answer in C."""

    __slots__ = ("spec", "width")

    def __init__(self, width: int) -> None:
        self.width, self.spec = width, f"0{width}b"

    def spread(
        self, answers: list[tuple[int, PrefixMatch]], ranks: Sequence[RankId], bits: Sequence[int]
    ) -> dict[RankId, PrefixMatch]:
        """Each rank's answer: that of the (disjoint) mask holding its bit, else the empty one.

        Class k numbers its digits k in one byte string (up to 255 classes;
        the rest, rare, one bit at a time); a rank then reads its digit.
        """
        table, ids = [_EMPTY], 0
        for mask, match in answers[:255]:
            ids |= int.from_bytes(format(mask, self.spec).encode().translate(_CLASS[len(table)]))
            table.append(match)
        by_bit = [_EMPTY, *map(table.__getitem__, ids.to_bytes(self.width)[::-1])]
        for mask, match in answers[255:]:
            for bit in _bits(mask):
                by_bit[bit.bit_length()] = match
        return dict(zip(ranks, map(by_bit.__getitem__, map(int.bit_length, bits)), strict=True))


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
