"""How many blocks one rank may hold per medium, and what happens past it.

No engine's cache holds more blocks than its capacity, so a rank whose
resident blocks pass it is sending something else (a bug, or an attacker
storing fresh hashes every step), and each one costs the store memory. A
rank consumer keeps an upper bound of its rank's blocks per medium without
asking the store: the store's exact count when last asked plus every hash
stored since (a store may add one block per hash, never more). Only when
that passes a medium's bound does it ask the store for the exact count, so
a rank near its bound costs one count per ``bound - exact`` hashes stored,
not one per batch. Past the bound, the medium is *refused*: its blocks are
cleared and its events dropped until the engine restarts; the rank is
degraded meanwhile (``over_capacity``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from indexer.core.events import GPU, MEDIA, BlockRemoved, EventBatch, normalise_medium
from indexer.engine_registry import EngineSpec, RankStatus
from indexer.metrics import RankMetrics

log = logging.getLogger("kvindex.subscriber")

#: The rejection counted for a batch over a bound, or losing events to a refusal.
OVER_CAPACITY = "over_capacity"

#: A GPU bound is this many times the engine's declared ``gpu_blocks``: a rank
#: may hold stale blocks beside its cache's (a given-up gap's missed removals),
#: and it leaves room to count exactly only once per ``gpu_blocks`` hashes stored.
GPU_SLACK = 2


def rank_bounds(spec: EngineSpec, max_blocks: int) -> dict[str, int]:
    """The blocks a rank of ``spec`` may hold per medium: twice its declared GPU
    capacity on GPU, else ``max_blocks`` (the subscriber's setting)."""
    bounds = dict.fromkeys(MEDIA, max_blocks)
    if spec.gpu_blocks is not None:
        bounds[GPU] = GPU_SLACK * spec.gpu_blocks
    return bounds


class Capacity:
    """One rank's blocks per medium against its bounds (:func:`rank_bounds`).

    ``status.over_capacity`` says which media are refused and why, and each
    batch that passes a bound or loses events to a refusal is counted in the
    rank's ``rejected`` (and ``metrics``) as :data:`OVER_CAPACITY`.
    """

    def __init__(
        self,
        bounds: Mapping[str, int],
        status: RankStatus,
        metrics: RankMetrics,
        ids: Callable[..., dict[str, Any]],
    ) -> None:
        self.bounds = dict(bounds)
        self._status, self._metrics, self._ids = status, metrics, ids
        # Unknown until the store is asked: the first batch stored asks it.
        self._most = {medium: bound + 1 for medium, bound in self.bounds.items()}
        self._refused: frozenset[str] = frozenset()

    def admit(self, batch: EventBatch) -> EventBatch:
        """The batch without the events of refused media."""
        if not self._refused:
            return batch
        kept = [e for e in batch.events if normalise_medium(e.medium) not in self._refused]
        if len(kept) < len(batch.events):
            self._rejected()
        return EventBatch(batch.ts, kept, batch.data_parallel_rank)

    def stored(self, batch: EventBatch) -> bool:
        """Count an applied batch's stores (a hash adds at most one block); whether
        the store must now be asked (some medium may be over its bound)."""
        most, bounds, refused, over = self._most, self.bounds, self._refused, False
        for event in batch.events:
            if event.block_hashes and type(event) is not BlockRemoved:
                medium = normalise_medium(event.medium)
                most[medium] += len(event.block_hashes)
                over = over or (most[medium] > bounds[medium] and medium not in refused)
        return over

    def counted(self, counts: Mapping[str, int]) -> list[str]:
        """Take the store's exact counts: the media newly over their bounds, refused
        from now on (their blocks are the caller's to clear)."""
        bounds = self.bounds
        over = [m for m, bound in bounds.items() if counts[m] > bound and m not in self._refused]
        self._most.update(counts)
        if over:
            self._refuse(over, counts)
        return over

    def _refuse(self, over: list[str], counts: Mapping[str, int]) -> None:
        self._most.update(dict.fromkeys(over, 0))  # about to be cleared
        self._refused |= frozenset(over)
        reason = ", ".join(f"{m} held {counts[m]} blocks, over {self.bounds[m]}" for m in over)
        status = self._status
        status.over_capacity = "; ".join(filter(None, [status.over_capacity, reason]))
        self._rejected()
        log.warning(
            "rank over capacity: cleared until the engine restarts",
            extra=self._ids(over_capacity=reason),
        )

    def restarted(self, cleared: Collection[str]) -> None:
        """The engine restarted and ``cleared`` were emptied: nothing is refused
        any more (a medium refused had been emptied, and stored nothing since)."""
        self._refused = frozenset()
        self._most.update(dict.fromkeys(cleared, 0))
        self._status.over_capacity = None

    def _rejected(self) -> None:
        rejected = self._status.rejected
        rejected[OVER_CAPACITY] = rejected.get(OVER_CAPACITY, 0) + 1
        self._metrics.rejected(OVER_CAPACITY)
