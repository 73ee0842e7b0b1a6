"""The embedded store's holder index: for each block hash, which ranks hold it.

A prefix query asks how far each of many engine ranks holds one chain, per
tier. Walking every rank's own tables costs a Python loop per rank per
block (64 engines x 512 blocks: ~3 ms). This index answers for all ranks in
one walk: per medium, ``hash -> bitmask`` of the rank slots whose *scored*
tables of that medium hold the hash; a chain is walked once, its masks
read in C a slice at a time, and each rank's run ends where its bit drops
out.

The index is derived, never the source of truth: :class:`IndexedResidency`
keeps :class:`~indexer.core.residency.RankResidency`'s exact per-tier refcounts and
sets or clears the rank's bit when a hash enters or leaves the union of its
scored tables of a medium (count 0 <-> above 0, clears, a group's kind
turning scored or not). A hash held by one rank maps to that rank's own bit
object, and masks several ranks share are pooled (one object per distinct
value), so the index costs one dict slot per distinct hash and medium, and
a walk compares runs of equal masks by identity.

Hybrid models' window groups (sliding window, Mamba) have masks of their
own, kept the same way: a hybrid rank's full-attention answer stands where
those masks hold what it ends with (:class:`Hybrids`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, filterfalse, repeat
from operator import and_, ne, or_

from indexer.core.events import CPU, GPU, MEDIA, STORAGE, BlockHash, RankId
from indexer.core.hybrid import GroupRule, hybrid_match, is_scored, is_windowed
from indexer.core.matching import PrefixMatch
from indexer.core.residency import RankResidency, Tier, TierOp, _decrement

_MATCHES_CACHED = 4096
#: Distinct masks kept as one shared object each; past this many the pool starts over
#: (masks already in the index keep their objects: only sharing is lost, not answers).
_POOLED_MASKS = 1 << 12
_EMPTY = PrefixMatch()
#: Keys looked up per C pass of a walk: more passes cost Python, longer ones overshoot.
#: A walk starts with a short pass (many end at once), or as far as it guesses it goes.
_MIN_STEP, _MAX_STEP = 16, 64
Media = dict[str, dict[BlockHash, int]]


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
        ranks: Sequence[RankId],
        bits: Sequence[int],
        sizes: Sequence[int | None],
        hybrids: Hybrids | None = None,
    ) -> dict[RankId, PrefixMatch]:
        """The prefix match of each rank, given its bit (from :meth:`take_bit`) and chunk size.

        A chunk size of None or 0 means the rank is matched on GPU only.

        Same answers as :func:`~indexer.core.matching.match_prefix` over each rank's
        own tables (the conformance suite and ``tests/test_holders.py`` hold
        it to that). Every run is found for all ranks at once, on bitmasks
        (see :func:`_segments`): the GPU run here, the lower tiers' in
        :meth:`_chunked`. Ranks sharing every run length form a class and
        share one answer; :meth:`_Digits.spread` hands each rank its class's.
        A rank holding neither the first block nor the first chunk of any
        tier matches nothing and gets the shared empty answer. The ranks of
        ``hybrids`` then have their answers taken to vLLM's hybrid rule
        (:meth:`Hybrids.refine`).
        """
        if not chain or not ranks:
            return dict.fromkeys(ranks, _EMPTY)
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


class Hybrids:
    """The ranks of hybrid models in a store, by how their answers are refined.

    A rank with one full-attention group and one window group (the common
    hybrid: gpt-oss, hybrid Mamba models) keeps its full-attention answer
    where its window group holds the units that answer ends with: checked on
    the index's window masks, for every rank sharing an answer and a window
    at once. The other ranks, and those failing the check, are walked one by
    one on their own tables (:func:`~indexer.core.hybrid.hybrid_match`).
    """

    def __init__(self) -> None:
        self.bits = 0  # every hybrid rank
        self.unanchored = 0  # those without a full-attention group
        self.states: dict[int, RankResidency] = {}  # bit -> rank
        self.simple: dict[GroupRule, int] = {}  # window group's rule -> bits of such ranks
        self._rules: dict[int, tuple[GroupRule, ...]] = {}  # bit -> rules registered
        #: (window rule, chunk size) -> the units it needs, in blocks and in chunks
        self._needs: dict[tuple[GroupRule, int], tuple[int, int]] = {}

    def update(self, state: RankResidency, bit: int) -> None:
        """Register a rank after a batch (its groups may have changed kind)."""
        rules = state.group_rules()
        if self._rules.get(bit) is rules or (not rules and not self.bits & bit):
            return
        self.drop(bit)
        if rules:
            self.bits |= bit
            self.states[bit] = state
            self._rules[bit] = rules
            windows = [r for r in rules if r.window is not None]
            if len(windows) == len(rules):
                self.unanchored |= bit
            if len(rules) == 2 and len(windows) == 1:
                self.simple[windows[0]] = self.simple.get(windows[0], 0) | bit

    def drop(self, bit: int) -> None:
        if self.bits & bit:
            self.bits &= ~bit
            self.unanchored &= ~bit
            del self.states[bit], self._rules[bit]
            self.simple = {r: m & ~bit for r, m in self.simple.items() if m & ~bit}

    def refine(
        self,
        answers: list[tuple[int, PrefixMatch]],
        chain: Sequence[BlockHash],
        asked: dict[int, int],
        windows: Media,
    ) -> list[tuple[int, PrefixMatch]]:
        """``answers`` (disjoint masks, full-attention answers) with the hybrid ranks' own."""
        out: list[tuple[int, PrefixMatch]] = []
        covered = 0
        for mask, match in answers:
            covered |= mask
            hybrid = mask & self.bits
            if not hybrid:
                out.append((mask, match))
                continue
            walk = hybrid
            for size, group in asked.items():
                for rule, bits in self.simple.items():
                    if bits & hybrid & group:
                        needs = self._needs.get((rule, size)) or self._need(rule, size)
                        walk &= ~_unchanged(bits & walk & group, needs, size, match, chain, windows)
            if mask & ~walk:
                out.append((mask & ~walk, match))
            if walk:
                out += [(bit, self._walk(bit, match, chain, asked)) for bit in _bits(walk)]
        # a rank without a full-attention group may match with nothing on it
        lonely = sum(asked.values()) & self.unanchored & ~covered
        out += [(bit, self._walk(bit, _EMPTY, chain, asked)) for bit in _bits(lonely)]
        return out

    def _need(self, rule: GroupRule, size: int) -> tuple[int, int]:
        needs = self._needs[rule, size] = (rule.need(), rule.need(size) if size else 0)
        return needs

    def _walk(
        self, bit: int, full: PrefixMatch, chain: Sequence[BlockHash], asked: dict[int, int]
    ) -> PrefixMatch:
        state = self.states[bit]
        rules = self._rules[bit]
        size = next(size for size, group in asked.items() if group & bit)
        return hybrid_match(chain, full, size, rules, state.group_tables)


def _unchanged(
    bits: int,
    needs: tuple[int, int],
    size: int,
    match: PrefixMatch,
    chain: Sequence,
    windows: Media,
) -> int:
    """The ``bits`` whose window group holds what ``match`` ends with on every tier
    (``needs``: its units needed in blocks, in chunks): for them vLLM's hybrid
    hit is the full-attention one."""
    gpu = match.gpu_blocks
    bits = _holding(bits, windows[GPU], chain[max(0, gpu - needs[0]) : gpu])
    if bits and 0 < size <= len(chain) and (match.prefix_blocks > gpu or match.cpu_blocks):
        need, last = needs[1], size - 1
        cpu, storage = windows[CPU], windows[STORAGE]
        end = match.prefix_blocks // size
        for h in chain[max(gpu // size, end - need) * size + last : end * size : size]:
            bits &= cpu.get(h, 0) | storage.get(h, 0)
        end = match.cpu_blocks // size
        bits = _holding(bits, cpu, chain[max(0, end - need) * size + last : end * size : size])
    if bits and 0 < size <= len(chain) and match.storage_blocks:
        end = match.storage_blocks // size
        start = max(0, end - needs[1]) * size + size - 1
        bits = _holding(bits, windows[STORAGE], chain[start : end * size : size])
    return bits


def _holding(bits: int, index: dict[BlockHash, int], keys: Sequence[BlockHash]) -> int:
    """The ``bits`` holding every key in ``index``."""
    for h in keys:
        bits &= index.get(h, 0)
        if not bits:
            break
    return bits


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
    """A rank's exact residency that keeps its bit in a :class:`HolderIndex` in step.

    A group's hashes go to the index's scored media, to its window media (a
    hybrid model's sliding-window or Mamba group), or nowhere (a kind with no
    rule), by the group's kind.
    """

    index: HolderIndex = field(default_factory=HolderIndex)
    bit: int = 0
    #: tier -> its index and the other tables of its medium going there, or None;
    #: valid while the rank's tables and group kinds stay as they were.
    _peers: dict[Tier, tuple[Media, list] | None] = field(
        default_factory=dict, repr=False, compare=False
    )
    _peers_of: int = -1  # len(tables) when _peers was filled

    def _store(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> None:
        fresh = list(filterfalse(counts.__contains__, hashes))
        super()._store(tier, counts, hashes)
        if fresh:
            found = self._index_peers(tier)
            if found is not None:
                self.index.add(tier.medium, self.bit, _alone(fresh, found[1]), found[0])

    def _remove(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> int:
        gone: list[BlockHash] = []
        unknown = _decrement(counts, hashes, gone)
        if gone:
            found = self._index_peers(tier)
            if found is not None:
                self.index.discard(tier.medium, self.bit, _alone(gone, found[1]), found[0])
        return unknown

    def _learn(self, op: TierOp) -> None:
        group = op.tier.group_idx
        was = self._media_of(group)
        super()._learn(op)
        now = self._media_of(group)
        if now is not was:
            self._rescore(group, was, now)

    def clear(self, media: Iterable[str]) -> None:
        media = list(media)
        for medium in media:
            for index in (self.index.media, self.index.windows):
                self.index.discard(medium, self.bit, self._union(medium, index), index)
        super().clear(media)
        self._peers_of = -1

    def release(self) -> None:
        """Leave the index: the rank is forgotten."""
        self.clear(MEDIA)
        self.index.release_bit(self.bit)

    def _media_of(self, group: int) -> Media | None:
        """Where a group's hashes are indexed, by its kind."""
        kind = self.group_kinds.get(group)
        if is_scored(kind):
            return self.index.media
        return self.index.windows if is_windowed(kind) else None

    def _index_peers(self, tier: Tier) -> tuple[Media, list] | None:
        """None if the tier is indexed nowhere, else its index and the other tables
        of its medium indexed there."""
        if self._peers_of != len(self.tables):
            self._peers.clear()
            self._peers_of = len(self.tables)
        if tier not in self._peers:
            index = self._media_of(tier.group_idx)
            self._peers[tier] = (
                None
                if index is None
                else (
                    index,
                    [
                        t.counts
                        for other, t in self.tables.items()
                        if other != tier
                        and other.medium == tier.medium
                        and self._media_of(other.group_idx) is index
                    ],
                )
            )
        return self._peers[tier]

    def _union(self, medium: str, index: Media) -> Iterable[BlockHash]:
        tables = [
            t.counts
            for tier, t in self.tables.items()
            if tier.medium == medium and self._media_of(tier.group_idx) is index
        ]
        if not tables:
            return ()
        return tables[0].keys() if len(tables) == 1 else set().union(*tables)

    def _rescore(self, group: int, was: Media | None, now: Media | None) -> None:
        """A group's kind moved it to another index (or none): move its tables' hashes."""
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
            if was is not None:  # out, unless another table indexed there still holds them
                self.index.discard(
                    medium, self.bit, moved.difference(self._union(medium, was)), was
                )
            if now is not None:
                self.index.add(medium, self.bit, moved, now)


def _alone(hashes: list[BlockHash], peers: list[dict[BlockHash, int]]) -> list[BlockHash]:
    """The hashes none of ``peers`` holds: those that enter or leave the medium's union."""
    if not peers:
        return hashes
    return [h for h in hashes if not any(h in t for t in peers)]
