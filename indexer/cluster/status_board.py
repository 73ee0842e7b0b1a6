"""Rank statuses through Redis: workers publish theirs, API replicas read them all.

An API replica runs no consumer, yet ``GET /engines/{name}``, ``/stats`` and
the ``degraded`` flag of ``/prefix-match`` need each rank's status
(connected, applied seq, gaps, lag). Every ``kvindex indexer`` worker writes
the statuses of the ranks it owns, as one msgpack value with a time to live,
to ``P:status:<worker>``; a dead worker's statuses expire with it, and its
ranks read as not connected (degraded) until their new owner publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec

from indexer.cluster.leases import live_workers
from indexer.cluster.rebuilds import Rebuild, Rebuilds
from indexer.core.events import RankId
from indexer.engine_registry import EngineSpec, RankStatus, Registry, blank_status
from indexer.retrying import repeat
from indexer.stores.base import Loss
from indexer.stores.redis.client import RedisClient

log = logging.getLogger("kvindex.status")


class Published(msgspec.Struct, array_like=True):
    """One owned rank's status, with the lease token it was consumed under."""

    engine: str
    token: int
    status: RankStatus


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[Published]).decode


def publishing(
    client: RedisClient, worker: str, statuses: Sequence[Published], ttl: float
) -> tuple:
    """The command replacing the worker's published statuses, which expire after ``ttl``
    seconds (to send in the worker's pipeline)."""
    value, key = _encode(list(statuses)), client.layout.status_key(worker)
    return ("SET", key, value, "PX", round(ttl * 1000))


class StatusBoard:
    """Every live worker's published statuses: the API's
    :class:`~indexer.engine_registry.ConsumerView` when it runs as its own process.

    :meth:`rank_status` answers from the last :meth:`refresh` (the API calls
    it synchronously); :meth:`follow` refreshes it in the background.
    ``stale_after``: seconds without a successful refresh after which the
    board says consumption is not known to run (``/readyz`` answers 503).
    """

    def __init__(self, client: RedisClient, registry: Registry, stale_after: float) -> None:
        self._client = client
        self._registry = registry
        self._stale_after = stale_after
        self._ranks: dict[tuple[str, int], Published] = {}
        self._workers = 0
        self._refreshed = float("-inf")
        self._forgotten = 0  # losses of data noticed: a refresh read before one is dropped
        self._loss: Loss | None = None  # the last one
        self._published: set[tuple[str, int]] = set()  # ranks a worker published since
        self._rebuilds = Rebuilds(client)
        self._rebuilding: dict[RankId, Rebuild] = {}  # left unfinished by their consumers

    async def refresh(self) -> None:
        forgotten = self._forgotten
        workers = await live_workers(self._client)
        status_key = self._client.layout.status_key
        reads = [("GET", status_key(worker)) for worker in workers]
        *blobs, rebuilds = await self._client.execute([*reads, self._rebuilds.reading()])
        rebuilding = Rebuilds.read(rebuilds)
        if forgotten != self._forgotten:
            return
        ranks: dict[tuple[str, int], Published] = {}
        for blob in filter(None, blobs):
            for entry in _decode(blob):
                key = (entry.engine, entry.status.dp_rank)
                if key not in ranks or ranks[key].token < entry.token:  # the newest owner's
                    ranks[key] = entry
        self._ranks, self._workers, self._refreshed = ranks, len(workers), time.monotonic()
        self._rebuilding = rebuilding
        self._published.update(ranks)

    def forget(self, loss: Loss) -> None:
        """The store lost data (a loss listener): statuses read before may be of workers
        that had not noticed yet, and are dropped. Until a worker publishes a rank
        again (workers publish only statuses read after they checked the store),
        the rank is flagged with the loss as its ``store_loss`` (``/readyz`` 503).
        """
        self._ranks, self._workers, self._loss = {}, 0, loss
        self._published.clear()
        self._forgotten += 1

    async def follow(self, interval: float) -> None:
        """Refresh every ``interval`` seconds, forever (run it as a task)."""
        await repeat(interval, self.refresh, "statuses")

    def rank_status(self, engine: str) -> list[RankStatus]:
        """One status per dp rank of a registered engine (raises UnknownEngine)."""
        spec = self._registry.get(engine)
        found = [self._ranks.get((engine, r)) for r in range(spec.dp_ranks)]
        return [self._blank(spec, r) if p is None else p.status for r, p in enumerate(found)]

    def _blank(self, spec: EngineSpec, dp_rank: int) -> RankStatus:
        """A rank no live worker publishes: not connected, and in doubt if no worker has
        published it since the last loss of data, or its rebuild after one is unfinished."""
        status, loss = blank_status(spec, dp_rank), self._loss
        rebuild = self._rebuilding.get(RankId(spec.name, dp_rank))
        if loss is not None and (spec.name, dp_rank) not in self._published and spec.events:
            status.degraded = True
            status.store_loss = f"{loss.reason}; no worker has consumed the rank since"
        elif rebuild is not None:
            status.degraded = True
            status.store_loss = f"{rebuild[1]}; batches up to {rebuild[0]} to apply again"
        return status

    def running(self) -> bool:
        """Whether some worker is alive, as of a refresh recent enough to trust."""
        return self._workers > 0 and time.monotonic() - self._refreshed < self._stale_after
