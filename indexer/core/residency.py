"""The residency model: what a batch of KV events does to an engine's counts.

Pure logic, no I/O. Every store (in-process, Redis, Redis Cluster) turns a
batch into the same :class:`TierOp` list with :func:`plan_batch` and combines
per-tier lookups into a :class:`PrefixMatch` with :func:`match_prefix`, so the
rules of DESIGN §3 live in exactly one place.

Counts are keyed by ``(engine, dp_rank, medium, ownership, group_idx, hash)``.
A *tier* is the ``(medium, ownership, group_idx)`` part: one refcount table
per tier per engine rank.
"""

from __future__ import annotations

from collections import _count_elements
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, groupby, repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

import msgspec

from indexer.wire import (
    STORED,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    normalise_medium,
)

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIA = (GPU, CPU, STORAGE)
LOWER_TIERS = (CPU, STORAGE)

#: Attention kinds whose blocks make a prefix reusable (DESIGN §3). A group
#: never classified (kind None) counts too; any other kind is tracked only.
SCORED_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def is_scored(kind: str | None) -> bool:
    """Whether a KV group of this kind counts for prefix matching."""
    return kind is None or kind in SCORED_KINDS


class RankId(NamedTuple):
    """One data-parallel rank of one engine: the unit that owns a seq stream."""

    engine: str
    dp_rank: int


class Tier(NamedTuple):
    """The part of a residency key that is not the engine rank or the hash."""

    medium: str
    ownership: str | None
    group_idx: int


class TierOp(NamedTuple):
    """+1 (``delta=1``) or -1 for each hash of one tier, in order.

    ``kind`` and ``chunk_blocks`` carry what a store event teaches about the
    group (its attention kind) and the engine (blocks per offloaded chunk).
    """

    tier: Tier
    delta: int
    hashes: Sequence[BlockHash]
    locality: str | None = None
    kind: str | None = None
    chunk_blocks: int | None = None


class ClearMedium(NamedTuple):
    """Drop every count of one medium for the rank (``AllBlocksCleared`` → GPU)."""

    medium: str


Op = TierOp | ClearMedium


_TIERS: dict[tuple, Tier] = {}
_CLEAR_GPU = ClearMedium(GPU)
#: What makes consecutive events one operation, read in C for every event.
_SIGNATURE = attrgetter(
    "__class__", "medium", "ownership", "group_idx", "locality", "kv_cache_spec_kind"
)
_hashes = attrgetter("block_hashes")
_block_size = attrgetter("block_size")
_new = tuple.__new__  # a NamedTuple without its Python-level __new__: ops are built per group


def _tier(medium: str | None, ownership: str | None, group_idx: int | None) -> Tier:
    """The tier of an event's fields; one shared object per distinct tier."""
    key = (medium, ownership, group_idx)
    tier = _TIERS.get(key)
    if tier is None:
        tier = Tier(normalise_medium(medium), ownership, group_idx or 0)
        if len(_TIERS) < 4096:  # bounded: tiers are few, raw spellings of them too
            _TIERS[key] = tier
    return tier


def plan_batch(batch: EventBatch) -> list[Op]:
    """Translate a decoded batch into store operations, in event order.

    Consecutive events that do the same thing to the same tier become one
    operation (engines often remove blocks one event at a time). Within a
    stretch of events on one tier, removals go first when that changes no
    count, so that a pool evicting one chunk per chunk it stores gives two
    operations, not one per event; otherwise order is kept.
    This runs for every event the indexer sees: events are grouped in C by
    the fields that make them one operation, and Python runs once per group.
    """
    ops: list[Op] = []
    runs = groupby(batch.events, _SIGNATURE)
    for _, stretch in groupby(runs, _place):
        alike = [(signature, list(run)) for signature, run in stretch]
        for signature, events in _removals_first(alike) if len(alike) > 2 else alike:
            _plan_run(ops, signature, events)
    return ops


Run = tuple[tuple, list[Event]]


def _place(run: tuple[tuple, object]) -> tuple:
    """Where a run's events act: runs of one place act on one tier."""
    return run[0][1:5]


def _removals_first(runs: list[Run]) -> list[Run]:
    """The runs with every removal moved ahead of every store, if that changes nothing.

    Counts of distinct hashes do not interact, so the move changes nothing
    unless the stretch clears, or removes a hash after storing it (an
    eviction of a block stored moments before; evicting, then storing again,
    keeps its order). Runs left next to a run alike are joined.
    """
    classes = [signature[0] for signature, _ in runs]
    if AllBlocksCleared in classes or BlockRemoved not in classes:
        return runs
    removed = [run for run in runs if run[0][0] is BlockRemoved]
    stored = [run for run in runs if run[0][0] is not BlockRemoved]
    both = set(_all_hashes(removed))
    both.intersection_update(_all_hashes(stored))
    if both and _removed_after_stored(runs, both):
        return runs
    return [
        (signature, [*chain.from_iterable(events for _, events in alike)])
        for signature, alike in groupby(removed + stored, itemgetter(0))
    ]


def _all_hashes(runs: list[Run]) -> Iterable[BlockHash]:
    return chain.from_iterable(map(_hashes, chain.from_iterable(map(itemgetter(1), runs))))


def _removed_after_stored(runs: list[Run], hashes: set[BlockHash]) -> bool:
    """Whether some run removes one of ``hashes`` after an earlier run stored it."""
    stored: set[BlockHash] = set()
    for signature, events in runs:
        for event in events:
            if signature[0] is BlockRemoved:
                if not stored.isdisjoint(event.block_hashes):
                    return True
            else:
                stored.update(hashes.intersection(event.block_hashes))
    return False


def _plan_run(ops: list[Op], signature: tuple, events: list[Event]) -> None:
    """Append the operation of a run of alike events (several for lower-tier stores)."""
    cls, medium, ownership, group_idx, locality, kind = signature
    if cls is AllBlocksCleared:
        ops.extend(repeat(_CLEAR_GPU, len(events)))
        return
    tier = _TIERS.get((medium, ownership, group_idx)) or _tier(medium, ownership, group_idx)
    if cls is BlockRemoved:
        _add(ops, tier, -1, events, locality, None, None)
        return
    if kind == SLIDING_WINDOW:  # one group, one window: the run's first event says it
        first = events[0]
        kind = sliding_window_kind(first.kv_cache_spec_sliding_window, first.block_size)
    if tier.medium == GPU or not is_scored(kind):
        _add(ops, tier, 1, events, locality, kind, None)
    else:  # lower-tier stores: self-describing chunks teach the chunk size
        sizes = list(map(len, map(_hashes, events)))
        if sizes.count(sizes[0]) == len(sizes) and min(map(_block_size, events)) > 0:
            _add(ops, tier, 1, events, locality, kind, sizes[0])  # all one chunk size
            return
        for chunk, stores in groupby(events, _chunk_blocks):
            _add(ops, tier, 1, list(stores), locality, kind, chunk)


def _add(
    ops: list[Op],
    tier: Tier,
    delta: int,
    events: list[Event],
    locality: str | None,
    kind: str | None,
    chunk: int | None,
) -> None:
    """Append the events' operation, or fold it into the last one if only hashes differ.

    Events group by their raw fields, so two spellings of one tier (``cpu``
    and ``CPU``, group nil and 0) meet here. A lone event's hash list is
    used as it is, not copied.
    """
    last = ops[-1] if ops else None
    if (
        type(last) is TierOp
        and last.tier is tier
        and last[1] == delta
        and last[3:] == (locality, kind, chunk)
    ):
        hashes = [*last.hashes, *chain.from_iterable(map(_hashes, events))]
        ops[-1] = _new(TierOp, (tier, delta, hashes, locality, kind, chunk))
        return
    hashes = (
        events[0].block_hashes if len(events) == 1 else [*chain.from_iterable(map(_hashes, events))]
    )
    ops.append(_new(TierOp, (tier, delta, hashes, locality, kind, chunk)))


def _chunk_blocks(event: BlockStored) -> int | None:
    """Blocks per offloaded chunk, if this lower-tier store is a self-describing chunk.

    Placeholders (``block_size`` 0) carry only the chunk end. Only
    full-attention groups publish whole chunks (the caller checks the kind);
    recurrent groups may publish partial tails, which say nothing about it.
    """
    return len(event.block_hashes) if event.block_size > 0 else None


_UNSEEN = object()


@dataclass(slots=True)
class TierTable:
    """Refcounts of one tier of one engine rank; a hash is resident while > 0."""

    counts: dict[BlockHash, int] = field(default_factory=dict)
    locality: str | None = None


@dataclass
class RankResidency:
    """All counts of one engine rank, with what its events taught about it.

    This is the embedded store's state and the reference every other store is
    checked against by the conformance suite.
    """

    tables: dict[Tier, TierTable] = field(default_factory=dict)
    group_kinds: dict[int, str | None] = field(default_factory=dict)
    chunk_blocks: int | None = None
    unknown_removals: int = 0
    #: the rules of its groups, while ``group_kinds`` stays as it is (None: stale)
    _rules: tuple[GroupRule, ...] | None = field(default=None, repr=False, compare=False)
    #: (medium, group) -> its count tables; None when a tier came or went
    _by_group: dict[tuple[str, int], list] | None = field(default=None, repr=False, compare=False)

    def apply(self, ops: Iterable[Op]) -> int:
        """Apply operations in order; returns the number of block operations."""
        applied = 0
        tables = self.tables
        for op in ops:
            if type(op) is ClearMedium:
                self.clear((op.medium,))
                continue
            tier, delta, hashes, locality, kind, chunk = op
            table = tables.get(tier)
            if table is None:
                table = tables[tier] = TierTable()
                self._by_group = None
            if locality is not None:
                table.locality = locality
            if delta > 0:
                if self.group_kinds.get(tier.group_idx, _UNSEEN) != kind:
                    self._learn(op)
                if chunk and self.chunk_blocks is None:
                    self.chunk_blocks = chunk
                self._store(tier, table.counts, hashes)
            else:
                self.unknown_removals += self._remove(tier, table.counts, hashes)
            applied += len(hashes)
        return applied

    # The two hooks below are where counts change. They are methods so that a
    # store keeping an index of residency (the embedded store's holder index)
    # can see which hashes a tier gained or lost, in the same pass.

    def _store(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> None:
        """Add one reference per hash."""
        _count_elements(counts, hashes)

    def _remove(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> int:
        """Drop one reference per hash; returns the removals of unknown hashes."""
        return _decrement(counts, hashes)

    def _learn(self, op: TierOp) -> None:
        """Remember what a store says a group is, unless what is known already refines it.

        A removal's kind is None; a chunk-end placeholder's sliding-window kind
        lacks the block size its group's other stores taught.
        """
        group, kind = op.tier.group_idx, op.kind
        known = self.group_kinds.get(group, _UNSEEN)
        if known is _UNSEEN or (kind is not None and not refines(known, kind)):
            self.group_kinds[group] = kind
            self._rules = None

    def clear(self, media: Iterable[str]) -> None:
        for medium in media:
            for tier in [t for t in self.tables if t.medium == medium]:
                del self.tables[tier]
        self._by_group = None

    def scored_tables(self, medium: str) -> list[dict[BlockHash, int]]:
        """Count tables of a medium that prefix matching looks at."""
        return [
            table.counts
            for tier, table in self.tables.items()
            if tier.medium == medium and is_scored(self.group_kinds.get(tier.group_idx))
        ]

    def group_rules(self) -> tuple[GroupRule, ...]:
        """The rank's groups with how each limits a hit; empty unless some group is
        a sliding-window or Mamba group (the rank is then matched as a hybrid)."""
        if self._rules is None:
            self._rules = group_rules(self.group_kinds)
        return self._rules

    def group_tables(self, medium: str, group_idx: int) -> list[dict[BlockHash, int]]:
        """Count tables of one group on one medium (one per ownership)."""
        by_group = self._by_group
        if by_group is None:
            by_group = self._by_group = {}
            for tier, table in self.tables.items():
                by_group.setdefault((tier.medium, tier.group_idx), []).append(table.counts)
        return by_group.get((medium, group_idx), [])

    def match(self, chain: Sequence[BlockHash], chunk_blocks: int | None) -> PrefixMatch:
        """This rank's prefix match, walked on its own tables: the reference every
        store's :meth:`~indexer.stores.Store.prefix_match` must equal."""
        gpu_tables = self.scored_tables(GPU)
        gpu = leading_run(chain, gpu_tables) if gpu_tables else 0
        lower = {m: self.scored_tables(m) for m in LOWER_TIERS}

        def chunk_in(medium: str, j: int) -> bool:
            return any(chunk_end(chain, chunk_blocks, j) in t for t in lower[medium])

        full = match_prefix(
            len(chain), gpu, chunk_blocks if any(lower.values()) else None, chunk_in
        )
        rules = self.group_rules()
        return hybrid_match(chain, full, chunk_blocks, rules, self.group_tables) if rules else full

    def distinct_blocks(self, medium: str) -> int:
        """Distinct resident hashes of a medium, across ownerships and groups."""
        tables = [t.counts for tier, t in self.tables.items() if tier.medium == medium]
        if len(tables) == 1:
            return len(tables[0])
        return len(set().union(*tables))


def _decrement(
    counts: dict[BlockHash, int], hashes: Sequence[BlockHash], gone: list | None = None
) -> int:
    """Remove one reference per hash, never below zero; returns unknown removals.

    ``gone``, if given, receives the hashes whose last reference this removed.
    Most removals drop a block's only reference: pop them all in C, and only
    if some count was above one put the pops back and go hash by hash (when
    every count was at most one, popping in order is exactly the rule).
    """
    popped = list(map(counts.pop, hashes, repeat(0)))
    unknown = popped.count(0)
    if unknown + popped.count(1) == len(popped):
        if gone is not None:
            gone.extend(compress(hashes, popped))
        return unknown
    for h, n in zip(reversed(hashes), reversed(popped), strict=True):
        if n:  # in reverse, so a hash listed twice gets its count from before the first pop
            counts[h] = n
    unknown = 0
    for h in hashes:
        n = counts.get(h, 0)
        if n > 1:
            counts[h] = n - 1
        elif n == 1:
            del counts[h]
            if gone is not None:
                gone.append(h)
        else:
            unknown += 1
    return unknown


# --- prefix matching ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TierWeights:
    """Score per prefix block by the tier it would be served from."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a block-hash chain one engine rank can serve, tier by tier.

    ``gpu_blocks``: leading blocks the engine reuses from GPU (for a hybrid model
    the fixed point over its KV groups, see :func:`hybrid_match`).
    ``cpu_blocks``/``storage_blocks``:
    leading blocks loadable from that tier alone, in whole chunks.
    ``prefix_blocks``: the GPU run extended by whole chunks from any lower
    tier; ``from_cpu``/``from_storage`` count the prefix blocks that extension
    takes from each.
    """

    gpu_blocks: int = 0
    cpu_blocks: int = 0
    storage_blocks: int = 0
    prefix_blocks: int = 0
    from_cpu: int = 0
    from_storage: int = 0
    full_attention_blocks: int | None = None  # None: the same as gpu_blocks

    @property
    def gpu_blocks_full_attention(self) -> int:
        """The leading GPU run of the full-attention groups alone (hybrid models may
        reuse less: ``gpu_blocks`` is what vLLM's scheduler would reuse)."""
        fa = self.full_attention_blocks
        return self.gpu_blocks if fa is None else fa

    def score(self, weights: TierWeights) -> float:
        from_gpu = self.prefix_blocks - self.from_cpu - self.from_storage
        return (
            from_gpu * weights.gpu
            + self.from_cpu * weights.cpu
            + self.from_storage * weights.storage
        )


#: ``chunk_in(medium, j)``: is chunk ``j`` of the chain resident on that lower medium?
ChunkLookup = Callable[[str, int], bool]


def match_prefix(
    num_blocks: int, gpu_blocks: int, chunk_blocks: int | None, chunk_in: ChunkLookup
) -> PrefixMatch:
    """Combine a GPU run and lower-tier chunk residency into a prefix match.

    Lower tiers load whole chunks, aligned to the start of the prompt, and a
    chunk is resident exactly when its end hash is (the chain hash of the end
    block fixes the whole chunk). After the GPU run, the engine loads the
    chunk holding the first missing block and the ones after it, CPU first.
    One pass over the chunks asks each tier at most once per chunk and stops
    as soon as no answer can grow.
    """
    if not chunk_blocks:
        return PrefixMatch(gpu_blocks, prefix_blocks=gpu_blocks)
    chunks = num_blocks // chunk_blocks
    runs: dict[str, int | None] = {CPU: None, STORAGE: None}  # None: still running
    taken = {CPU: 0, STORAGE: 0}
    prefix, extending, first = gpu_blocks, True, gpu_blocks // chunk_blocks
    for j in range(chunks):
        grow = extending and j >= first
        if not grow and runs[CPU] is not None and runs[STORAGE] is not None:
            if not extending:
                break
            continue  # the GPU run still covers chunk j: nothing to ask until `first`
        source = None  # the first lower tier holding chunk j, once asked
        for medium in LOWER_TIERS:
            if runs[medium] is None or (grow and source is None):
                if chunk_in(medium, j):
                    source = source or medium
                elif runs[medium] is None:
                    runs[medium] = j
        if grow:
            if source is None:
                extending = False
            else:
                taken[source] += (j + 1) * chunk_blocks - prefix
                prefix = (j + 1) * chunk_blocks
    cpu, storage = (chunks if runs[m] is None else runs[m] for m in LOWER_TIERS)
    return PrefixMatch(
        gpu_blocks, cpu * chunk_blocks, storage * chunk_blocks, prefix, taken[CPU], taken[STORAGE]
    )


def chunk_end(chain: Sequence[BlockHash], chunk_blocks: int, j: int) -> BlockHash:
    """The hash that identifies chunk ``j`` of a chain: its last block's."""
    return chain[(j + 1) * chunk_blocks - 1]


def leading_run(chain: Sequence[BlockHash], tables: Sequence[dict[BlockHash, int]]) -> int:
    """Number of leading hashes of ``chain`` resident in any of ``tables``."""
    if len(tables) == 1:
        (table,) = tables
        for i, h in enumerate(chain):
            if h not in table:
                return i
        return len(chain)
    for i, h in enumerate(chain):
        if not any(h in t for t in tables):
            return i
    return len(chain)


# --- hybrid models: KV groups of several attention kinds ------------------------
#
# vLLM runs a model whose layers mix attention kinds with one KV cache group
# per kind, and reuses a prefix only as far as every group can serve it
# (``HybridKVCacheCoordinator.find_longest_cache_hit``): each group's
# manager finds its own hit below a cap, and the cap shrinks to the smallest
# until no group lowers it. Full attention needs every block of the prefix
# (``FullAttentionManager``: the leading run); a sliding-window layer needs
# only the blocks inside its window before the hit's end
# (``SlidingWindowManager``: scanning right to left from the cap, the end
# of the rightmost run of ``cdiv(window - 1, block_size)`` cached blocks,
# else the run cached from block 0); a Mamba layer in "align" mode needs
# the state at the hit's end (``MambaManager``: the rightmost cached block).
# Groups of one spec are one lookup needing a block in each; the fixed point
# is the same either way. The offloading connector (``_lookup``) applies the
# same rules to chunks, from the chunk holding the GPU hit's end: full
# attention the leading run, a sliding window ``cdiv(window,
# tokens_per_chunk)`` chunks, Mamba one chunk.

SLIDING_WINDOW, MAMBA = "sliding_window", "mamba"
_RULES_CACHED = 256


def refines(known: object, kind: str) -> bool:
    """Whether a remembered kind says all that ``kind`` says (and perhaps more:
    ``sliding_window:128:16`` refines ``sliding_window:128`` and ``sliding_window``)."""
    return isinstance(known, str) and (known == kind or known.startswith(kind + ":"))


def sliding_window_kind(window: int | None, block_size: int) -> str:
    """The kind a sliding-window group is remembered by: its window and block size
    ride along, so that removals (which carry neither) can be matched by them."""
    if not window or window < 1:
        return SLIDING_WINDOW  # tracked, never matched: vLLM always sends the window
    return (
        f"{SLIDING_WINDOW}:{window}:{block_size}"
        if block_size > 0
        else f"{SLIDING_WINDOW}:{window}"
    )


class GroupRule(NamedTuple):
    """How one KV group limits a prefix hit.

    ``window``: None for full attention, the sliding window in tokens, or 0
    for Mamba (one state); ``block_size``: the group's, for sliding windows.
    """

    group_idx: int
    window: int | None = None
    block_size: int = 0

    def need(self, chunk_blocks: int | None = None) -> int:
        """Held units a hit must end with (0: every unit from the start): blocks,
        or offloaded chunks of ``chunk_blocks`` blocks."""
        window = self.window
        if window is None:
            return 0
        if window == 0:
            return 1
        if chunk_blocks is None:  # the input token itself is inside the window
            return max(1, -(-(window - 1) // self.block_size))
        return -(-window // (chunk_blocks * self.block_size))


_RULE_OF: dict[str | None, tuple[int | None, int] | None] = {}


def _rule_of(kind: str | None) -> tuple[int | None, int] | None:
    """``(window, block_size)`` of a kind (window None: full attention), None if unmatched."""
    if kind in _RULE_OF:
        return _RULE_OF[kind]
    rule: tuple[int | None, int] | None = None
    if is_scored(kind):
        rule = (None, 0)
    elif kind == MAMBA:
        rule = (0, 0)
    elif kind and kind.startswith(SLIDING_WINDOW + ":"):
        parts = kind.split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[2]) > 0:
            rule = (int(parts[1]), int(parts[2]))
    if len(_RULE_OF) < _RULES_CACHED:
        _RULE_OF[kind] = rule
    return rule


def is_windowed(kind: str | None) -> bool:
    """Whether a group of this kind limits hits by a window (sliding window, Mamba)."""
    rule = _rule_of(kind)
    return rule is not None and rule[0] is not None


def group_rules(kinds: dict[int, str | None]) -> tuple[GroupRule, ...]:
    """Every group with a rule, by index; empty if all are full attention.

    A group whose kind has no rule here (another kind, or a sliding window
    whose block size no event told) is tracked but does not limit hits.
    """
    rules = [(g, _rule_of(kind)) for g, kind in sorted(kinds.items())]
    if all(rule is None or rule[0] is None for _, rule in rules):
        return ()
    return tuple(GroupRule(g, *rule) for g, rule in rules if rule is not None)


#: ``tables(medium, group_idx)``: the containers holding that group's hashes on a medium.
GroupTables = Callable[[str, int], Sequence[Container]]


class _Held:
    """Which of ``keys`` a group holds (in any of its tables), read in C a slice at a time."""

    __slots__ = ("keys", "tables")

    def __init__(self, tables: Sequence[Container], keys: Sequence[BlockHash]) -> None:
        self.tables, self.keys = tables, keys

    def flags(self, start: int, stop: int) -> bytes:
        """One byte per key of ``keys[start:stop]``: 1 if held."""
        part, tables = self.keys[start:stop], self.tables
        if len(tables) == 1:
            return bytes(map(tables[0].__contains__, part))
        if not tables:
            return bytes(len(part))
        return bytes(map(any, zip(*(map(t.__contains__, part) for t in tables), strict=True)))


def _leading_hit(held: _Held, start: int, cap: int) -> int:
    """The end of the run of held units from ``start``, at most ``cap``."""
    miss = held.flags(start, cap).find(0)
    return cap if miss < 0 else start + miss


def _window_hit(need: int, held: _Held, start: int, cap: int) -> int:
    """Units ``[start, cap)``: the end of the rightmost run of ``need`` held units,
    else the run held from ``start`` (what vLLM's right-to-left scan finds).

    The run usually ends at the cap: that is read first, ``need`` keys only.
    """
    if cap - need >= start and held.flags(cap - need, cap).count(1) == need:
        return cap
    flags = held.flags(start, cap)
    at = flags.rfind(b"\x01" * need)
    if at >= 0:
        return start + at + need
    miss = flags.find(0)
    return start + (len(flags) if miss < 0 else miss)


def _fixed_point(
    fulls: Sequence[_Held], windows: Sequence[tuple[int, _Held]], start: int, cap: int
) -> int:
    """The hit of all groups over units ``[start, cap)``: each lowers the cap in turn
    until none does. Full attention's run only shrinks the cap, so it is walked once."""
    hit = cap
    for held in fulls:
        hit = _leading_hit(held, start, hit)
    while hit > start:
        low = hit
        for need, held in windows:
            low = _window_hit(need, held, start, low)
        if low == hit:
            break
        hit = low
    return max(hit, start)


def hybrid_match(
    chain: Sequence[BlockHash],
    full: PrefixMatch,
    chunk_blocks: int | None,
    rules: Sequence[GroupRule],
    tables: GroupTables,
) -> PrefixMatch:
    """A hybrid rank's match, given ``full``, its match by full-attention groups alone.

    GPU: the fixed point over the groups, capped by the full-attention run
    (every full-attention group holds at most that much) or, without one, by
    the chain. Lower tiers (whole chunks, ``chunk_blocks`` per chunk): the
    same rules on chunk ends, from the chunk holding the GPU hit's end (the
    prefix, a chunk held on CPU or STORAGE counting) or from chunk 0 (each
    tier alone). A chunk of the prefix is taken from CPU when the CPU holds it
    in every full-attention group (every group, without one), else from STORAGE.

    With one full-attention group (the common case) its runs are ``full``'s,
    found by the caller's walk, and only the other groups are walked here.
    """
    fulls = [r for r in rules if r.window is None]
    windows = [r for r in rules if r.window is not None]
    known = len(fulls) == 1  # its tables are all the scored ones: ``full`` walked them
    walked = [] if known else fulls
    cap = full.gpu_blocks if fulls else len(chain)
    gpu = _fixed_point(
        [_Held(tables(GPU, r.group_idx), chain) for r in walked],
        [(r.need(), _Held(tables(GPU, r.group_idx), chain)) for r in windows],
        0,
        cap,
    )
    full_run = full.gpu_blocks if full.gpu_blocks != gpu else None
    if not chunk_blocks:
        return PrefixMatch(gpu, prefix_blocks=gpu, full_attention_blocks=full_run)
    ends = chain[chunk_blocks - 1 :: chunk_blocks]

    def lower(media: Sequence[str], start: int, cap: int) -> int:
        if cap <= start:
            return start

        def held(r: GroupRule) -> _Held:
            return _Held([c for m in media for c in tables(m, r.group_idx)], ends)

        windowed = [(r.need(chunk_blocks), held(r)) for r in windows]
        return _fixed_point([held(r) for r in walked], windowed, start, cap)

    whole = len(ends)
    cpu = lower((CPU,), 0, full.cpu_blocks // chunk_blocks if known else whole)
    storage = lower((STORAGE,), 0, full.storage_blocks // chunk_blocks if known else whole)
    first = gpu // chunk_blocks
    reach = whole
    if known:  # the full-attention group's lower-tier run from ``first``
        stop = full.gpu_blocks // chunk_blocks
        reach = _leading_hit(_Held(_lower_tables(tables, fulls[0]), ends), first, stop)
        if reach == stop:
            reach = full.prefix_blocks // chunk_blocks
    end = lower(LOWER_TIERS, first, reach)
    prefix = max(gpu, end * chunk_blocks)
    from_cpu = 0
    if end > first:
        on_cpu = [_Held(tables(CPU, r.group_idx), ends).flags(first, end) for r in fulls or rules]
        taken = on_cpu[0] if len(on_cpu) == 1 else bytes(map(min, *on_cpu))
        from_cpu = taken.count(1) * chunk_blocks
        if taken[:1] == b"\x01":  # the first chunk is partly on GPU
            from_cpu -= gpu - first * chunk_blocks
    return PrefixMatch(
        gpu,
        cpu * chunk_blocks,
        storage * chunk_blocks,
        prefix,
        from_cpu,
        prefix - gpu - from_cpu,
        full_run,
    )


def _lower_tables(tables: GroupTables, rule: GroupRule) -> list[Container]:
    return [c for m in LOWER_TIERS for c in tables(m, rule.group_idx)]


class GroupDeclaration:
    """An engine's declared KV groups (kind, sliding window, block size) by group_idx.

    Removals carry a group_idx and no kind, so a rank whose first events for
    a group are removals (it joined late) would score that group as full
    attention until a store says otherwise. A declaration tells the store
    first: :meth:`prepended` puts one empty store per group ahead of a
    batch's events (it changes no count; what events say later still wins).
    :meth:`conflicts` finds, once each, what events say against it.
    """

    def __init__(self, groups: Sequence[tuple[str, int | None, int]], block_size: int) -> None:
        self.block_size = block_size
        self.kinds = {i: _kind_key(k, w, b) for i, (k, w, b) in enumerate(groups)}
        self.events = [
            BlockStored(
                [],
                block_size=b,
                medium=GPU,
                group_idx=i,
                kv_cache_spec_kind=k,
                kv_cache_spec_sliding_window=w,
            )
            for i, (k, w, b) in enumerate(groups)
        ]
        self._seen: set[tuple] = set()

    def prepended(self, batch: EventBatch) -> EventBatch:
        return msgspec.structs.replace(batch, events=[*self.events, *batch.events])

    def conflicts(self, batch: EventBatch) -> list[dict]:
        """What the batch's stores say that the declaration does not, not said before."""
        said = {
            (e.group_idx or 0, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size)
            for e in batch.events
            if type(e) in STORED and e.kv_cache_spec_kind is not None
        }
        new = said - self._seen
        if not new:
            return []
        self._seen |= new
        found = []
        for group, kind, window, size in sorted(new, key=repr):
            seen, declared = _kind_key(kind, window, size), self.kinds.get(group)
            agrees = declared is not None and (refines(declared, seen) or refines(seen, declared))
            if not agrees or size not in (0, self.block_size):
                found.append(
                    {"group_idx": group, "declared": declared, "seen": seen, "block_size": size}
                )
        return found


def _kind_key(kind: str, window: int | None, block_size: int) -> str:
    return sliding_window_kind(window, block_size) if kind == SLIDING_WINDOW else kind
