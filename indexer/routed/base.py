"""What every implementation of routed entries answers (the rules are
:mod:`indexer.core.routed`'s)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from indexer.core.events import BlockHash, EventBatch, RankId
from indexer.core.matching import TierWeights
from indexer.core.routed import Candidate

#: Counters of routed entries: the core's outcomes, ``cleared`` (a GPU clear, a
#: restart or a removal ended them) and ``live`` (held now).
COUNTS = ("recorded", "confirmed", "expired", "evicted", "cleared", "live")

#: What a route answers: the pick (None: no candidate), then, as each candidate was
#: weighed (before the pick's record), its ``routed_blocks`` where routed entries
#: extended its exact GPU run, and its queued blocks where it had any.
Routing = tuple[Candidate | None, dict[RankId, int], dict[RankId, int]]


class RoutedEntries(Protocol):
    async def record(self, rank: RankId, chain: Sequence[BlockHash], ttl: float, bound: int) -> int:
        """Route ``chain`` to ``rank`` for ``ttl`` seconds (keeping at most ``bound``
        entries there); the number of entries that are new."""

    async def lookup(
        self, chain: Sequence[BlockHash], starts: Mapping[RankId, int], engines: Collection[str]
    ) -> dict[RankId, int]:
        """``routed_blocks`` of every rank of ``engines`` whose routed entries extend
        its exact GPU run (``starts``, 0 for a rank not in it) along ``chain``."""

    async def route(
        self,
        chain: Sequence[BlockHash],
        candidates: Sequence[Candidate],
        weights: TierWeights,
        ttl: float,
    ) -> Routing:
        """Pick the best candidate (:func:`indexer.core.routed.best`), each weighing its
        rank's other live entries as its queue (:func:`indexer.core.load.queued_blocks`),
        and record the chain beyond its exact GPU run for it, in one atomic step."""

    async def confirm(self, rank: RankId, hashes: Sequence[BlockHash]) -> None:
        """End the rank's entries for blocks its events stored on GPU."""

    async def clear(self, rank: RankId) -> None:
        """End every entry of the rank (its GPU was cleared, or it restarted)."""

    async def forget(self, engine: str) -> None:
        """End every entry of every rank of the engine (it was removed)."""

    def observe(self, rank: RankId, batch: EventBatch) -> None:
        """A subscriber observer: confirm and clear by an applied batch (cheap, never
        blocks; a Redis implementation sends what it gathers in the background)."""

    async def counts(self) -> dict[str, int]:
        """:data:`COUNTS` over every rank (in Redis: every process's)."""

    def local_counts(self) -> dict[str, int]:
        """:data:`COUNTS` but ``live`` as this process saw them happen (``/metrics``)."""

    async def close(self) -> None: ...
