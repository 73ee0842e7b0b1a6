"""The rows of a prefix-match answer: one per engine rank, built from what the store
and the routed entries answered, or, for the many ranks that match nothing,
encoded once and reused."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from answers import EngineMatch
from indexer.core.events import RankId
from indexer.core.matching import NO_MATCH, PrefixMatch, TierWeights
from indexer.core.routed import score as routed_score
from indexer.engine_registry import EngineSpec, RankStatus, is_degraded

_encode = msgspec.json.Encoder().encode
#: Engines a cache keeps entries for (names of removed ones linger): past it, all go.
ENGINES = 1 << 16


def entries(
    spec: EngineSpec,
    block_size: int,
    statuses: list[RankStatus],
    flags: tuple[bool, ...],
    ranks: set[int],
    found: dict[RankId, PrefixMatch],
    routed: dict[RankId, int],
    weights: TierWeights,
) -> dict[int, EngineMatch]:
    """The entries of an engine's ``ranks`` (those the store or routed entries
    answered), by rank; a declared rank left out takes its pre-encoded row."""
    name, events, declared = spec.name, spec.events, spec.dp_ranks
    # A rank whose store lost data may hold older state: it matches nothing until rebuilt.
    lost = [s.dp_rank for s in statuses if s.store_loss is not None]
    built = {}
    for dp_rank in ranks:
        m = NO_MATCH if dp_rank in lost else found.get((name, dp_rank), NO_MATCH)
        routed_blocks = routed.get((name, dp_rank), 0)
        if dp_rank < declared:
            if m is NO_MATCH and not routed_blocks:
                continue
            degraded = flags[dp_rank]
        else:  # a rank the engine does not declare: by its status if it has one
            degraded = events and all(is_degraded(s) for s in statuses if s.dp_rank == dp_rank)
        if routed_blocks > m.gpu_blocks:
            score = routed_score(m, routed_blocks, weights)
        else:  # no routed block beyond the exact GPU run: the exact score
            routed_blocks, score = m.gpu_blocks, m.score(weights)
        built[dp_rank] = EngineMatch(
            name,
            dp_rank,
            spec.model,
            block_size,
            m.gpu_blocks,
            m.cpu_blocks,
            m.storage_blocks,
            m.prefix_blocks,
            m.prefix_blocks * block_size,
            round(score, 6),
            degraded,
            m.gpu_blocks_full_attention,
            routed_blocks,
            not events,  # an engine without events has no connection to lose
        )
    return built


def rank_order(spec: EngineSpec, ranks: set[int]) -> Iterable[int]:
    """An engine's rows' ranks: its declared ones, and any other that was answered."""
    if max(ranks) < spec.dp_ranks:
        return range(spec.dp_ranks)
    return sorted(ranks.union(range(spec.dp_ranks)))


def degraded_flags(spec: EngineSpec, statuses: list[RankStatus]) -> tuple[bool, ...]:
    """Each declared rank's ``degraded``: by its status, and a rank without one is not
    connected; an engine without events is never degraded (its rows are approximate)."""
    if not spec.events:
        return (False,) * spec.dp_ranks
    if spec.dp_ranks == len(statuses) == 1 and statuses[0].dp_rank == 0:  # the common case
        return (is_degraded(statuses[0]),)
    flags = [True] * spec.dp_ranks
    for status in statuses:
        if status.dp_rank < spec.dp_ranks:
            flags[status.dp_rank] = is_degraded(status)
    return tuple(flags)


class ZeroRows:
    """The answer rows of ranks that match nothing, encoded once per engine, block size
    and degraded flags (the only fields such a row has besides zeros).

    Most of a fleet matches any one prompt not at all (bench 6: 51 of 64 ranks),
    and building their entries was most of the API's own cost of a query. Each
    engine keeps its latest rows: a status that changes, or a query overriding
    the block size, has them made again, at what building the entries cost.
    """

    def __init__(self) -> None:
        self._rows: dict[str, tuple[EngineSpec, int, tuple[bool, ...], list[msgspec.Raw]]] = {}

    def of(self, spec: EngineSpec, block_size: int, flags: tuple[bool, ...]) -> list[msgspec.Raw]:
        """The rows of ranks ``0..len(flags)-1``, each rank degraded as ``flags`` says."""
        kept = self._rows.get(spec.name)
        if kept is not None and kept[0] is spec and kept[1] == block_size and kept[2] == flags:
            return kept[3]
        if len(self._rows) >= ENGINES:
            self._rows.clear()
        rows = [
            msgspec.Raw(_encode(EngineMatch(spec.name, dp_rank, spec.model, block_size, 0, 0, 0,
                                            0, 0, 0.0, degraded, 0, 0, not spec.events)))
            for dp_rank, degraded in enumerate(flags)
        ]  # fmt: skip
        self._rows[spec.name] = (spec, block_size, flags, rows)
        return rows
