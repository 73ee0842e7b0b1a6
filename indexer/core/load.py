"""Load-aware placement: what sending a prompt to a rank costs, beyond its cached prefix.

A pick by the prefix alone sends a burst sharing one popular prefix to the one
rank holding it while the others idle, and every new prefix to whichever rank
ties first: queues grow there and its cache churns. So ``route: "best"``
weighs a rank's prefix against the work already waiting on it, in one unit, the
blocks of prefill a request must wait for:

    cost = uncached * (1 + pressure * fullness)
         + per_block * queued_blocks + per_request * requests_ahead

- ``uncached``: the prompt's blocks minus its score (the tier-weighted blocks the
  rank holds or was routed), so a rank holding the whole prompt on GPU costs 0;
- ``fullness`` (0..1): how full the rank's KV cache is (the larger of vLLM's
  ``kv_cache_usage_perc`` and the resident blocks over its capacity). Each new
  block placed on a full cache evicts one someone may want back, so a miss there
  costs more than on a rank with room;
- ``queued_blocks``: the prefill work waiting on the rank, in blocks: the blocks
  routed to it (:mod:`indexer.core.routed`) that its events have not yet stored,
  less the prompt's own (waiting for them is its score's business). vLLM stores a
  block when it schedules its computation, so these are the blocks of the requests
  queued there and of the chunks of long prefills not yet begun: work any new
  request there waits behind, whoever routed it. An engine that publishes no events
  stores nothing kvindex sees, so its routed blocks are no queue and count nothing;
- ``requests_ahead``: the requests the engine reports running and waiting, plus
  the pending ones: each stretches every step the prompt's prefill shares with it.

The cheapest rank wins; a rank holding a popular prefix wins until the work queued
there is worth more than the prefill of the prompt elsewhere, which is when a second
copy pays. A rank whose report is stale or missing counts the picks routed to it
recently, its queue and no fullness: with no load known anywhere the pick is the
prefix's.
Ties go to the higher score, then to the rank holding fewer routed entries,
then to the first candidate (engine name, then dp rank).

Pure rules, no I/O: :mod:`indexer.loads` gathers the reports and the picks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadRules:
    """The weights of the cost (``enabled`` false: the pick is the prefix's alone) and
    how load is gathered: engines' ``/metrics`` every ``scrape_interval`` seconds, a
    report counting for ``stale_after`` seconds, and a pick to a rank with no fresh
    report counting for ``pending_seconds``."""

    #: False: the pick is the best score alone, load ignored.
    enabled: bool = True
    #: Blocks of prefill each block queued on a rank is worth (bench item 16's runs on
    #: timed engines, docs/bench/routing.md): raise it to spread long misses sooner.
    per_block: float = 1.0
    #: Blocks of prefill one request queued on a rank is worth: raise it to spread
    #: bursts sooner (at the cost of the hits a burst sharing a prefix would have).
    per_request: float = 1.0
    #: How much more an uncached block costs on a full cache (where it evicts one).
    pressure: float = 0.5
    #: Seconds between scrapes of each engine's ``/metrics``. A scrape reads tens of
    #: kilobytes a page: at 4 a second per engine it delayed a loaded process's answers
    #: by hundreds of ms (bench item 16); picks since the last report count as pending.
    scrape_interval: float = 1.0
    #: Seconds a load report counts for; an older one counts for nothing.
    stale_after: float = 3.0
    #: Seconds a pick counts as pending on a rank without a fresh report.
    pending_seconds: float = 2.0

    def __post_init__(self) -> None:
        if min(self.per_block, self.per_request, self.pressure) < 0:
            raise ValueError("load: per_block, per_request and pressure must be at least 0")
        if not 0 < self.scrape_interval < self.stale_after or self.pending_seconds <= 0:
            raise ValueError(
                "load: need 0 < scrape_interval < stale_after and pending_seconds above 0, got"
                f" {self.scrape_interval}, {self.stale_after}, {self.pending_seconds}"
            )


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One rank's load as its engine reported it: requests running and waiting, the
    KV cache in use (0..1) and the cache's capacity in blocks (None: not said)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    capacity: int | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """What a pick of one rank costs beside its prefix: each uncached block counts
    ``miss_factor``, the requests ahead ``load_cost`` blocks, and each block queued
    there ``per_block``. Neutral (1, 0, 0): the prefix alone decides."""

    miss_factor: float = 1.0
    load_cost: float = 0.0
    per_block: float = 0.0
    requests_ahead: float = 0.0  # what load_cost is of: reported, plus pending
    pending: int = 0
    fullness: float = 0.0


#: The placement of a rank whose load counts for nothing.
NEUTRAL = Placement()


def fullness(report: EngineLoad | None, resident: int | None) -> float:
    """How full a rank's cache is (0..1): the larger of what the engine says is in use
    and what kvindex holds resident over the capacity the engine declared."""
    if report is None:
        return 0.0
    held = 0.0
    if report.capacity and resident is not None:
        held = resident / report.capacity
    return min(1.0, max(report.kv_usage, held, 0.0))


def placement(
    rules: LoadRules,
    report: EngineLoad | None,
    pending: int,
    resident: int | None = None,
    events: bool = True,
) -> Placement:
    """A rank's placement from its fresh ``report`` (None: stale or missing) and the
    ``pending`` picks routed to it that the report does not count; ``events`` false:
    its engine publishes none, so its routed blocks are no queue."""
    if not rules.enabled:
        return NEUTRAL
    ahead = float(pending)
    if report is not None:
        ahead += report.running + report.waiting
    full = fullness(report, resident)
    per_block = rules.per_block if events else 0.0
    load = rules.per_request * ahead
    return Placement(1.0 + rules.pressure * full, load, per_block, ahead, pending, full)


def queued_blocks(live: int, own: int) -> int:
    """The blocks queued on a rank holding ``live`` routed entries, ``own`` of them the
    prompt's own chain's."""
    return max(0, live - own)


def cost(score: float, num_blocks: int, where: Placement, queued: int) -> float:
    """What routing a prompt of ``num_blocks`` blocks scoring ``score`` on a rank with
    ``queued`` blocks queued costs."""
    uncached = max(0.0, num_blocks - score)
    return uncached * where.miss_factor + where.load_cost + where.per_block * queued
