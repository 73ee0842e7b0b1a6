"""The residency rules: what a batch of KV events does to an engine's counts.

Pure logic, no I/O. Every store (in-process, Redis, Redis Cluster) turns a
batch into the same :class:`TierOp` list with :func:`plan_batch`, and
:class:`RankResidency` applies them: the reference every store is checked
against. Prefix matching over the counts is :mod:`indexer.core.matching`'s
(hybrid models: :mod:`indexer.core.hybrid`).

Counts are keyed by ``(engine, dp_rank, medium, ownership, group_idx, hash)``.
A *tier* is the ``(medium, ownership, group_idx)`` part: one refcount table
per tier per engine rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import NamedTuple

from indexer.core.events import (
    GPU,
    LOWER_TIERS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    normalise_medium,
)
from indexer.core.hybrid import (
    SLIDING_WINDOW,
    GroupRule,
    group_rules,
    hybrid_match,
    is_scored,
    refines,
    sliding_window_kind,
)
from indexer.core.matching import PrefixMatch, chunk_end, leading_run, loadable, match_prefix
from indexer.core.planning import planned_runs


class Tier(NamedTuple):
    """The part of a residency key that is not the engine rank or the hash."""

    medium: str
    ownership: str | None
    group_idx: int


class TierOp(NamedTuple):
    """+1 (``delta=1``) or -1 for each hash of one tier, in order; ``delta=0`` (a
    *hold*) gives a reference only to each hash that holds none.

    Holds are GPU stores of an engine whose reuse reports cannot be told from
    new copies (:data:`HOLD`): a request asking vLLM for a reuse report makes it
    announce every GPU block it reused as a ``BlockStored`` shaped exactly like a
    new physical copy, and no removal ever follows it. Counting one would keep a
    block resident after its last copy is evicted; holding keeps at most one
    reference per GPU hash, so an eviction always ends residency. The price is a
    second physical copy's eviction arriving as an unknown removal (counted), the
    block reported absent while that copy lived: a miss, never a phantom.

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

#: The ``delta`` of a hold (see :class:`TierOp`).
HOLD = 0


_TIERS: dict[tuple, Tier] = {}
_CLEAR_GPU = ClearMedium(GPU)


def _tier(medium: str | None, ownership: str | None, group_idx: int | None) -> Tier:
    """The tier of an event's fields; one shared object per distinct tier."""
    key = (medium, ownership, group_idx)
    tier = _TIERS.get(key)
    if tier is None:
        tier = Tier(normalise_medium(medium), ownership, group_idx or 0)
        if len(_TIERS) < 4096:  # bounded: tiers are few, raw spellings of them too
            _TIERS[key] = tier
    return tier


def plan_batch(batch: EventBatch, *, hold_gpu: bool = False) -> list[Op]:
    """Translate a decoded batch into store operations, in planning order.

    ``hold_gpu``: GPU stores become holds (:class:`TierOp`), for an engine whose
    stream may carry reuse reports that nothing tells from new copies.

    Consecutive events that do the same thing to the same tier become one
    operation (engines often remove blocks one event at a time), and within a
    stretch of events on one tier removals go first when that changes no
    count: :func:`~indexer.core.planning.planned_runs`' rule, the one order
    every reader of a batch takes. This runs for every event the indexer sees:
    events are grouped in C by the fields that make them one operation, and
    Python runs once per group.
    """
    ops: list[Op] = []
    gpu_store = HOLD if hold_gpu else 1
    for signature, events in planned_runs(batch.events):
        _plan_run(ops, signature, events, gpu_store)
    return ops


def _plan_run(ops: list[Op], signature: tuple, events: list[Event], gpu_store: int) -> None:
    """Append the operation of a run of alike events (several for lower-tier stores);
    a GPU store's delta is ``gpu_store`` (1, or :data:`HOLD`)."""
    cls, medium, ownership, group_idx, locality, kind = signature
    if cls is AllBlocksCleared:
        ops.extend([_CLEAR_GPU] * len(events))
        return
    tier = _TIERS.get((medium, ownership, group_idx)) or _tier(medium, ownership, group_idx)
    if cls is BlockRemoved:
        _add(ops, tier, -1, events, locality, None, None)
        return
    if kind == SLIDING_WINDOW:  # one group, one window: the run's first event says it
        first = events[0]
        kind = sliding_window_kind(first.kv_cache_spec_sliding_window, first.block_size)
    if tier.medium == GPU:
        _add(ops, tier, gpu_store, events, locality, kind, None)
    elif not is_scored(kind):
        _add(ops, tier, 1, events, locality, kind, None)
    else:  # lower-tier stores: self-describing chunks teach the chunk size
        sizes = [len(event.block_hashes) for event in events]
        if sizes.count(sizes[0]) == len(sizes) and min(e.block_size for e in events) > 0:
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
        hashes = [*last.hashes, *_all_of(events)]
        ops[-1] = TierOp(tier, delta, hashes, locality, kind, chunk)
        return
    hashes = events[0].block_hashes if len(events) == 1 else _all_of(events)
    ops.append(TierOp(tier, delta, hashes, locality, kind, chunk))


def _all_of(events: list[Event]) -> list[BlockHash]:
    """The events' hashes, one list, in order."""
    return [h for event in events for h in event.block_hashes]


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
                table = tables[tier] = self.new_table()
                self._by_group = None
            if locality is not None:
                table.locality = locality
            if delta >= 0:
                if self.group_kinds.get(tier.group_idx, _UNSEEN) != kind:
                    self.learn_kind(op)
                if chunk and self.chunk_blocks is None:
                    self.chunk_blocks = chunk
                self.add(tier, table.counts, hashes if delta else unheld(table.counts, hashes))
            else:
                self.unknown_removals += self.drop(tier, table.counts, hashes)
            applied += len(hashes)
        return applied

    def new_table(self) -> TierTable:
        """A new tier's table: a store may keep its counts in a container of its own
        that reads like the dict (the embedded store's compiled tables)."""
        return TierTable()

    # The three methods below are where counts and kinds change: a store that
    # keeps an index derived from residency (the embedded store's holder
    # index) overrides them to see what a tier gained or lost, in the same
    # pass. An override must leave ``counts`` and ``group_kinds`` as these do.

    def add(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> None:
        """Add one reference per hash of ``tier`` (``counts`` is its table)."""
        add_references(counts, hashes)

    def drop(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> int:
        """Drop one reference per hash of ``tier``; returns the removals of unknown hashes."""
        return drop_references(counts, hashes)

    def learn_kind(self, op: TierOp) -> None:
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
        if rules:
            full = hybrid_match(chain, full, chunk_blocks, rules, self.group_tables)
        return loadable(full, chunk_blocks)

    def distinct_blocks(self, medium: str) -> int:
        """Distinct resident hashes of a medium, across ownerships and groups."""
        tables = [t.counts for tier, t in self.tables.items() if tier.medium == medium]
        if len(tables) == 1:
            return len(tables[0])
        return len(set().union(*tables))


def add_references(
    counts: dict[BlockHash, int], hashes: Sequence[BlockHash], fresh: list | None = None
) -> None:
    """One more reference per hash (a hash listed twice gets two).

    ``fresh``, if given, receives the hashes that this gave their first reference.
    """
    for h in hashes:
        held = counts.get(h, 0)
        counts[h] = held + 1
        if not held and fresh is not None:
            fresh.append(h)


def unheld(counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """The hashes a hold gives a reference: those ``counts`` lacks, each once."""
    return [h for h in dict.fromkeys(hashes) if h not in counts]


def drop_references(
    counts: dict[BlockHash, int], hashes: Sequence[BlockHash], gone: list | None = None
) -> int:
    """One reference fewer per hash, never below zero: a hash leaves with its last.

    Returns the removals of hashes not held (counted, never applied); ``gone``,
    if given, receives the hashes whose last reference this dropped.
    """
    unknown = 0
    for h in hashes:
        held = counts.get(h, 0)
        if held > 1:
            counts[h] = held - 1
        elif held == 1:
            del counts[h]
            if gone is not None:
                gone.append(h)
        else:
            unknown += 1
    return unknown
