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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial, reduce
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
        self._owners: dict[int, RankId] = {}
        self._digits: _Digits | None = None  # rebuilt when a bit changes hands

    def take_bit(self, owner: RankId) -> int:
        """A bit no live rank uses (its hashes were all discarded when it was released)."""
        if self._free:
            bit = self._free.pop()
        else:
            self._slots += 1
            bit = 1 << (self._slots - 1)
        self._owners[bit] = owner
        self._digits = None
        return bit

    def release_bit(self, bit: int) -> None:
        self._free.append(bit)
        del self._owners[bit]
        self._digits = None

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
        (see :func:`_segments`); ranks are then split into the few classes
        that share every run length, and each class gets one (shared) answer.
        A rank holding neither the first block nor the first chunk of any
        tier matches nothing and gets the shared empty answer.

        The prefix is the GPU run extended by the chunks after it that a
        lower tier holds: the leading run of chunks each either wholly
        inside the rank's GPU run or on CPU or STORAGE. With no STORAGE
        chunk on that way, every extending chunk comes from CPU; a rank that
        has one is combined chunk by chunk (:meth:`_lower`), CPU first.
        """
        out = dict.fromkeys(ranks, _EMPTY)
        if not chain or not ranks:
            return out
        gpu_index, cpu, storage = self.media[GPU], self.media[CPU], self.media[STORAGE]
        distinct = set(sizes)
        if len(distinct) == 1:
            groups = {distinct.pop() or 0: reduce(or_, bits)}
        else:
            groups = {}
            for bit, size in zip(bits, sizes, strict=True):
                groups[size or 0] = groups.get(size or 0, 0) | bit
        head = gpu_index.get(chain[0], 0)
        everyone = 0
        for size, group in groups.items():
            if size:
                end = chain[size - 1] if size <= len(chain) else None
                group &= head | cpu.get(end, 0) | storage.get(end, 0)
            else:
                group &= head
            groups[size] = group
            everyone |= group
        if not everyone:
            return out
        owners = self._digits or self._owned()
        gpu = _segments(partial(_read, gpu_index.get, chain), len(chain), everyone)
        for size, group in groups.items():
            if not group:
                continue
            classes = [(group & m, n) for n, m in gpu if group & m]
            if not size:
                for mask, g in classes:
                    if g:
                        owners.assign(out, mask, self._cached(g, 0, 0, g, 0, 0))
                continue
            ends = chain[size - 1 :: size]
            chunks = len(ends)
            on_cpu_masks = _Lookup(cpu, ends)  # read once: the CPU run is found from the same masks
            on_storage_masks = _Lookup(storage, ends) if storage else None
            steps = _segments(
                partial(_either, on_cpu_masks, on_storage_masks, _covered(gpu, size, chunks)),
                chunks,
                group,
            )
            on_cpu = _segments(on_cpu_masks, chunks, group)
            on_storage = (
                _segments(on_storage_masks, chunks, group) if on_storage_masks else [(0, group)]
            )
            mixed = 0  # ranks with a STORAGE chunk where the prefix may extend
            if on_storage_masks:
                reach = max(n for n, _ in steps)
                mixed = group & reduce(or_, on_storage_masks(0, reach), 0)
            for mask, (g, n, c, s) in _refine(classes, steps, on_cpu, on_storage):
                if mask & mixed:
                    for bit in _bits(mask & mixed):
                        owners.assign(out, bit, self._lower(bit, g, size, ends, c, s))
                    mask &= ~mixed
                    if not mask:
                        continue
                prefix = max(g, n * size)
                if prefix or c or s:  # the rest already have the (equal) empty answer
                    match = self._cached(g, c * size, s * size, prefix, prefix - g, 0)
                    owners.assign(out, mask, match)
        return out

    def _owned(self) -> _Digits:
        digits = self._digits = _Digits(self._owners, self._slots)
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


def _segments(
    masks: Callable[[int, int], list[int]], length: int, active: int
) -> list[tuple[int, int]]:
    """``(run length, bits)`` pairs: how many leading positions each bit of ``active`` holds.

    ``masks(a, b)`` gives the bitmask of each position ``a .. b - 1`` (fewer
    past ``length``). The pairs partition ``active`` (a bit holding nothing
    has length 0). The masks are and-ed in C, in slices that grow, so a
    short match stops early; the and-ed masks only lose bits (so they only
    decrease), and each point where bits drop out is found by bisection. A
    slice held by exactly the bits still running (past a shared prefix,
    typically one rank) needs no and-ing at all.
    """
    out: list[tuple[int, int]] = []
    pos, step = 0, 16
    while active and pos < length:
        piece = masks(pos, pos + step)
        pos += len(piece)
        step = min(2 * step, _MAX_STEP)
        if piece.count(active) == len(piece):
            continue
        acc = list(accumulate(piece, and_, initial=active))
        start = pos - len(piece)
        k = 0
        while acc[-1] != active:
            k = bisect_right(acc, -active, k, key=neg)  # the first mask below ``active``
            out.append((start + k - 1, active & ~acc[k]))
            active = acc[k]
    if active:
        out.append((length, active))
    return out


class _Lookup:
    """``(a, b)`` -> the masks of ``keys[a:b]`` in ``index``, each read once and kept."""

    __slots__ = ("get", "keys", "seen")

    def __init__(self, index: dict[BlockHash, int], keys: Sequence[BlockHash]) -> None:
        self.get, self.keys, self.seen = index.get, keys, []

    def __call__(self, a: int, b: int) -> list[int]:
        seen = self.seen
        if b > len(seen):
            seen.extend(map(self.get, self.keys[len(seen) : b], repeat(0)))
        return seen[a:b]


def _read(get: Callable, keys: Sequence[BlockHash], a: int, b: int) -> list[int]:
    return list(map(get, keys[a:b], repeat(0)))


def _either(cpu: _Lookup, storage: _Lookup | None, covered: list[int], a: int, b: int) -> list[int]:
    """Per chunk ``a .. b - 1``: the bits holding it on CPU, on STORAGE or in their GPU run."""
    held = map(or_, cpu(a, b), covered[a:b])
    return list(map(or_, held, storage(a, b)) if storage else held)


def _covered(gpu: list[tuple[int, int]], size: int, chunks: int) -> list[int]:
    """Per chunk, the bits whose GPU run holds the whole chunk."""
    out: list[int] = []
    rest = 0
    for _, bits in gpu:
        rest |= bits
    for n, bits in sorted(gpu):
        first = min(n // size, chunks)
        if first > len(out):
            out.extend(repeat(rest, first - len(out)))
        rest &= ~bits
    out.extend(repeat(0, chunks - len(out)))
    return out


def _refine(
    classes: list[tuple[int, int]], *runs: list[tuple[int, int]]
) -> list[tuple[int, tuple]]:
    """Split ``(bits, GPU run)`` classes until each shares every run's length too."""
    out = [(bits, (n,)) for bits, n in classes]
    for run in runs:
        out = [(bits & m, (*key, n)) for bits, key in out for n, m in run if bits & m]
    return out


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


_FLAGS = bytes.maketrans(b"01", b"\x00\x01")


class _Digits:
    """Which rank each binary digit of a mask is, to hand a whole class its answer in C."""

    __slots__ = ("by_digit", "spec")

    def __init__(self, owners: dict[int, RankId], width: int) -> None:
        self.by_digit = [owners.get(1 << i) for i in reversed(range(width))]
        self.spec = f"0{width}b"

    def assign(self, out: dict[RankId, PrefixMatch], mask: int, match: PrefixMatch) -> None:
        """``out[rank] = match`` for each rank whose bit is in ``mask``."""
        flags = format(mask, self.spec).encode().translate(_FLAGS)
        out.update(zip(compress(self.by_digit, flags), repeat(match)))


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
