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
- ``queued_blocks``: the prefill work queued ahead of the prompt there, in blocks:
  the uncached blocks this process routed to the rank with its last picks, as many
  of them as the engine reports waiting plus the ones routed since that report (the
  engine cannot count them yet). The engine says how many requests wait, the picks
  how much each must compute: a queue of two long misses weighs more than one of
  ten cache hits, which a count of requests cannot tell;
- ``requests_ahead``: the requests the engine reports running and waiting, plus
  the pending ones: each stretches every step the prompt's prefill shares with it.

The cheapest rank wins; a rank holding a popular prefix wins until the work queued
there is worth more than the prefill of the prompt elsewhere, which is when a second
copy pays. A rank whose report is stale or missing counts only the picks routed to it
recently and no fullness: with no load known anywhere the pick is the prefix's.
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
    #: Blocks of prefill each block queued ahead on a rank is worth (bench item 16's runs
    #: on timed engines, docs/bench/routing.md): raise it to spread long misses sooner.
    per_block: float = 0.25
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
    ``miss_factor``, and the work ahead ``load_cost`` blocks. Neutral (1, 0): the
    prefix alone decides."""

    miss_factor: float = 1.0
    load_cost: float = 0.0
    requests_ahead: float = 0.0  # what load_cost is of: reported, plus pending,
    queued_blocks: float = 0.0  # and the prefill blocks of those waiting
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
    queued: float = 0.0,
) -> Placement:
    """A rank's placement from its fresh ``report`` (None: stale or missing), the
    ``pending`` picks routed to it that the report does not count, and the ``queued``
    prefill blocks of the requests waiting there (:func:`waiting_picks` says how many)."""
    if not rules.enabled:
        return NEUTRAL
    ahead = float(pending)
    if report is not None:
        ahead += report.running + report.waiting
    full = fullness(report, resident)
    load = rules.per_request * ahead + rules.per_block * queued
    return Placement(1.0 + rules.pressure * full, load, ahead, queued, pending, full)


def waiting_picks(report: EngineLoad | None, pending: int) -> int:
    """How many of a rank's last picks are still waiting for their prefill: the ones the
    engine reports waiting, and the pending ones."""
    return pending + (0 if report is None else round(report.waiting))


def cost(score: float, num_blocks: int, where: Placement) -> float:
    """What routing a prompt of ``num_blocks`` blocks scoring ``score`` on a rank costs."""
    return max(0.0, num_blocks - score) * where.miss_factor + where.load_cost
