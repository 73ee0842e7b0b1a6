"""Hybrid models: KV groups of several attention kinds, and how each limits a hit.

Pure logic, no I/O: which kinds count for prefix matching (:func:`is_scored`),
the rule of each group (:func:`group_rules`), the hybrid prefix match
(:func:`hybrid_match`) and an engine's declared groups (:class:`GroupDeclaration`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

import msgspec

from indexer.core.events import CPU, GPU, LOWER_TIERS, STORAGE, BlockHash, BlockStored, EventBatch
from indexer.core.matching import PrefixMatch

#: Attention kinds whose blocks make a prefix reusable: a prefix is reused only as
#: far as these groups hold every block of it. A group never classified (kind
#: None) counts too; any other kind is tracked only, or limits hits by its window.
SCORED_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def is_scored(kind: str | None) -> bool:
    """Whether a KV group of this kind counts for prefix matching."""
    return kind is None or kind in SCORED_KINDS


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
#: The largest sliding window (tokens) and block size a kind's rule takes: far above
#: any model's (windows of thousands of tokens, blocks of at most thousands), yet
#: small enough that the matchers' C arithmetic on them (a window over chunks of
#: blocks) never overflows. An event's window is a number from the wire: one of
#: 2**63 made every prefix match of the memory store fail. Past either, the group
#: is tracked but does not limit hits, as a window no block size came with.
MAX_RULE_WINDOW = 1 << 32
MAX_RULE_BLOCK_SIZE = 1 << 16


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
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            window, block_size = int(parts[1]), int(parts[2])
            if window <= MAX_RULE_WINDOW and 0 < block_size <= MAX_RULE_BLOCK_SIZE:
                rule = (window, block_size)
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


class HeldUnits:
    """Which of ``keys`` a group holds, in any of its tables: ``held(i)`` for unit ``i``.

    The lookups the hybrid rule makes, stated plainly. A store may give
    :func:`hybrid_match` a subclass that answers the same faster (the
    embedded store reads whole slices at once).
    """

    __slots__ = ("keys", "tables")

    def __init__(self, tables: Sequence[Container], keys: Sequence[BlockHash]) -> None:
        self.tables, self.keys = tables, keys

    def __call__(self, unit: int) -> bool:
        key = self.keys[unit]
        return any(key in table for table in self.tables)

    def flags(self, start: int, stop: int) -> Sequence[int]:
        """For each unit of ``[start, stop)``: true if held."""
        return [self(unit) for unit in range(start, stop)]

    def leading_end(self, start: int, cap: int) -> int:
        """The end of the run of held units from ``start``, at most ``cap``."""
        end = start
        while end < cap and self(end):
            end += 1
        return end

    def window_end(self, need: int, start: int, cap: int) -> int:
        """Units ``[start, cap)``: the end of the rightmost run of ``need`` held units,
        else the run held from ``start``: vLLM's scan, right to left from the cap."""
        run = 0
        for unit in range(cap - 1, start - 1, -1):
            run = run + 1 if self(unit) else 0
            if run == need:
                return unit + need
        return start + run


def _fixed_point(
    fulls: Sequence[HeldUnits], windows: Sequence[tuple[int, HeldUnits]], start: int, cap: int
) -> int:
    """The hit of all groups over units ``[start, cap)``: each lowers the cap in turn
    until none does. Full attention's run only shrinks the cap, so it is walked once."""
    hit = cap
    for held in fulls:
        hit = held.leading_end(start, hit)
    while hit > start:
        low = hit
        for need, held in windows:
            low = held.window_end(need, start, low)
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
    held_units: type[HeldUnits] = HeldUnits,
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
    ``held_units``: how a group's units are looked up (:class:`HeldUnits`).
    """
    fulls = [r for r in rules if r.window is None]
    windows = [r for r in rules if r.window is not None]
    known = len(fulls) == 1  # its tables are all the scored ones: ``full`` walked them
    walked = [] if known else fulls
    cap = full.gpu_blocks if fulls else len(chain)
    gpu = _fixed_point(
        [held_units(tables(GPU, r.group_idx), chain) for r in walked],
        [(r.need(), held_units(tables(GPU, r.group_idx), chain)) for r in windows],
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

        def held(r: GroupRule) -> HeldUnits:
            return held_units([c for m in media for c in tables(m, r.group_idx)], ends)

        windowed = [(r.need(chunk_blocks), held(r)) for r in windows]
        return _fixed_point([held(r) for r in walked], windowed, start, cap)

    whole = len(ends)
    cpu = lower((CPU,), 0, full.cpu_blocks // chunk_blocks if known else whole)
    storage = lower((STORAGE,), 0, full.storage_blocks // chunk_blocks if known else whole)
    first = gpu // chunk_blocks
    reach = whole
    if known:  # the full-attention group's lower-tier run from ``first``
        stop = full.gpu_blocks // chunk_blocks
        reach = held_units(_lower_tables(tables, fulls[0]), ends).leading_end(first, stop)
        if reach == stop:
            reach = full.prefix_blocks // chunk_blocks
    end = lower(LOWER_TIERS, first, reach)
    prefix = max(gpu, end * chunk_blocks)
    from_cpu = 0
    if end > first:
        groups = fulls or rules
        on_cpu = [held_units(tables(CPU, r.group_idx), ends).flags(first, end) for r in groups]
        taken = [all(chunk) for chunk in zip(*on_cpu, strict=True)]  # chunk by chunk
        from_cpu = taken.count(True) * chunk_blocks
        if taken[0]:  # the first chunk is partly on GPU
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
        self.sizes = {i: b for i, (_, _, b) in enumerate(groups)}
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
            if e.kv_cache_spec_kind is not None  # removals and clears: None, a ClassVar
        }
        new = said - self._seen
        if not new:
            return []
        self._seen |= new
        found = []
        for group, kind, window, size in sorted(new, key=repr):
            seen, declared = _kind_key(kind, window, size), self.kinds.get(group)
            agrees = declared is not None and (refines(declared, seen) or refines(seen, declared))
            if not agrees or size not in (0, self.block_size, self.sizes.get(group)):
                found.append(
                    {"group_idx": group, "declared": declared, "seen": seen, "block_size": size}
                )
        return found


def _kind_key(kind: str, window: int | None, block_size: int) -> str:
    return sliding_window_kind(window, block_size) if kind == SLIDING_WINDOW else kind
