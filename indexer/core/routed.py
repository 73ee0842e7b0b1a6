"""Routed entries: the blocks a router has just sent to a rank, before its events say so.

Between a routing decision and the engine's ``BlockStored`` events lie tens to
hundreds of milliseconds (scheduling, prefill, the publisher's batching). A
burst sharing a new prefix would scatter in that window, because the exact
index still says nobody holds it; a routed entry says "these blocks are about
to be on that rank's GPU" for a bounded time. For an engine that publishes no
events at all, routed entries are the only signal there is.

Pure rules, no I/O, shared by every implementation (embedded and Redis):

- An entry lives ``ttl`` seconds (a default, and bounds a request's own
  ``ttl_ms`` must fall within) and ends earlier when events confirm it (the
  block is stored on that rank's GPU), when the rank's GPU is cleared, the
  engine restarts or is removed.
- A rank holds at most ``bound`` entries; past it the entries whose deadline
  comes first go (with one TTL for all, the least recently routed ones). The
  blocks of one chain are given deadlines a microsecond apart, later blocks
  earlier, so a chain over the bound loses its tail, never the prefix that
  makes the tail worth anything.
- Routed entries never touch the exact counts: they extend a rank's exact GPU
  run (``routed_blocks``) and are scored with their own weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

from indexer.core.events import GPU, AllBlocksCleared, BlockHash, BlockRemoved, EventBatch
from indexer.core.load import NEUTRAL, Placement, cost
from indexer.core.matching import PrefixMatch, TierWeights

#: Counter names of routed entries: how each one was born or ended.
OUTCOMES = ("recorded", "confirmed", "expired", "evicted")


@dataclass(frozen=True, slots=True)
class RoutedRules:
    """TTL of routed entries (ms: default and the bounds a request's ``ttl_ms`` must
    fall within) and entries kept per rank of an engine that publishes events (an
    event-less engine is bounded by its declared ``gpu_blocks`` instead).

    An entry stands in for events that come within a second; only an event-less
    engine's entries outlive that, as long as its cache keeps a prompt. Ten minutes
    at most by default, so one mistaken (or hostile) record steers answers for no
    longer than that."""

    #: An entry's TTL when the request gives none: long enough for the engine's events.
    default_ttl_ms: int = 10_000
    #: The shortest TTL a request may give.
    min_ttl_ms: int = 10
    #: The longest TTL a request may give: how long one mistaken record may steer
    #: answers. Raise it for event-less engines whose cache keeps prompts longer.
    max_ttl_ms: int = 600_000
    #: Entries kept per rank; past it the entries whose deadline comes first go.
    max_per_rank: int = 100_000

    def __post_init__(self) -> None:
        if not 1 <= self.min_ttl_ms <= self.default_ttl_ms <= self.max_ttl_ms:
            raise ValueError(
                "routed TTLs: need 1 <= min_ttl_ms <= default_ttl_ms <= max_ttl_ms, got"
                f" {self.min_ttl_ms}, {self.default_ttl_ms}, {self.max_ttl_ms}"
            )
        if self.max_per_rank < 1:
            raise ValueError(f"routed max_per_rank: at least 1, got {self.max_per_rank}")

    def ttl(self, ttl_ms: int | None) -> float:
        """Seconds an entry lives; ValueError naming ``ttl_ms`` outside the bounds."""
        if ttl_ms is None:
            return self.default_ttl_ms / 1000
        if not self.min_ttl_ms <= ttl_ms <= self.max_ttl_ms:
            raise ValueError(
                f"ttl_ms {ttl_ms} is outside the configured bounds"
                f" {self.min_ttl_ms}..{self.max_ttl_ms}"
            )
        return ttl_ms / 1000

    def bound(self, gpu_blocks: int | None) -> int:
        """Entries one rank may hold: its declared GPU capacity, else ``max_per_rank``."""
        return self.max_per_rank if gpu_blocks is None else gpu_blocks


#: Seconds by which each block of a recorded chain ends before the one ahead of it.
TAIL_STEP = 1e-6


def deadlines(now: float, ttl: float, blocks: int) -> list[float]:
    """When the entries of a chain of ``blocks`` blocks, recorded at ``now``, end."""
    end = now + ttl
    return [end - position * TAIL_STEP for position in range(blocks)]


def routed_run(chain: Sequence[BlockHash], start: int, live: Callable[[BlockHash], bool]) -> int:
    """How far routed entries extend a rank's exact GPU run of ``start`` blocks: the
    end of the run of ``chain[start:]`` that is routed to it.

    The exact run is what events confirmed, so routed entries of those blocks may
    already have ended; the blocks after it are counted only while each is routed.
    Every rank holding entries is walked per query, so the walk runs in C: stretches
    of doubling length are checked whole (``all`` over ``map``), and the first that
    is not is walked block by block.
    """
    n, end, step = len(chain), start, 8
    while end < n and all(map(live, islice(chain, end, end + step))):
        end, step = min(n, end + step), step * 2
    if end < n:
        end += len(list(takewhile(live, islice(chain, end, end + step))))
    return end


def score(match: PrefixMatch, routed_blocks: int, weights: TierWeights) -> float:
    """The exact tier weights of the prefix blocks, plus ``weights.routed`` for each
    routed block beyond them."""
    return match.score(weights) + max(0, routed_blocks - match.prefix_blocks) * weights.routed


@dataclass(frozen=True, slots=True)
class Candidate:
    """A rank a ``route: "best"`` query may pick: its exact answer, its entry bound and
    what its load adds to the cost (:mod:`indexer.core.load`)."""

    engine: str
    dp_rank: int
    match: PrefixMatch
    bound: int
    placement: Placement = NEUTRAL


def best(scored: Iterable[tuple[Candidate, float, int, int]], num_blocks: int) -> Candidate | None:
    """The rank to route a chain of ``num_blocks`` to among ``(candidate, score,
    live_entries, queued)`` (``queued``: :func:`indexer.core.load.queued_blocks`): the
    lowest :func:`indexer.core.load.cost` (to 6 decimals), then the best score, then the
    rank holding the fewest live routed entries (the least loaded by recent routing),
    then the first one given (the API gives them by engine name, then dp rank). With
    neutral placements the lowest cost is the best score."""
    ranked = min(
        (
            (round(cost(s, num_blocks, c.placement, queued), 6), -round(s, 6), live, i, c)
            for i, (c, s, live, queued) in enumerate(scored)
        ),
        key=lambda r: r[:4],
        default=None,
    )
    return None if ranked is None else ranked[4]


def confirmations(batch: EventBatch) -> tuple[list[BlockHash], bool]:
    """What an applied batch says about a rank's routed entries: the hashes it
    stored on GPU (confirmed), and whether it cleared the GPU (every entry ends).

    A store is any event neither a removal nor a clear: adapters decode stores into
    lighter structs of their own (the hashes and tier alone), which count the same.
    """
    stored: list[BlockHash] = []
    cleared = False
    for event in batch.events:
        kind = type(event)
        if kind is AllBlocksCleared:
            cleared, stored = True, []
        elif kind is not BlockRemoved and (event.medium is None or event.medium.upper() == GPU):
            stored.extend(event.block_hashes)
    return stored, cleared


#: The batch the ingest layer reports when it drops a rank's GPU counts itself (a
#: restart, an unfilled gap): to routed entries it is an ``AllBlocksCleared``.
GPU_CLEARED = EventBatch(0.0, [AllBlocksCleared()])
