"""Leases on engine ranks, the set of live indexer workers, and the ownership log, in Redis.

Each (engine, dp rank) is consumed by at most one ``kvindex indexer`` worker:
the holder of ``P:lease:<dp>:<engine>``, taken with ``SET NX PX`` and kept
by compare-and-``PEXPIRE``. The value names the holder and the acquisition,
so a worker never renews or deletes a lease that expired and went to someone
else. A lease alone does not make a writer safe (a paused worker may still
believe it holds one): the fence token its holder then claims in the store
does (:meth:`~indexer.stores.base.Store.claim`).

Live workers are the sorted set ``P:workers``, scored by heartbeat expiry in
Redis's own clock. Every ownership change is appended to the stream
``P:owners`` (capped), for operators and for the tests that check that no
two workers ever applied the same rank at once. All of it goes through the
Redis gateway (:class:`~indexer.stores.redis.RedisClient`), never the store.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from indexer.cluster.scripts import HEARTBEAT, RELEASE_LEASE, RENEW_LEASE
from indexer.core.events import RankId
from indexer.stores.redis.client import RedisClient

#: Entries the ownership stream keeps (approximately).
OWNERS_KEPT = 100_000


class Leases:
    """The leases one worker holds, and its heartbeat."""

    def __init__(self, client: RedisClient, worker: str, ttl: float) -> None:
        self.worker = worker
        self._client = client
        self._ttl_ms = max(1, round(ttl * 1000))
        self._values: dict[RankId, str] = {}
        self._acquisitions = itertools.count(1)

    def key(self, rank: RankId) -> str:
        return self._client.layout.lease_key(rank)

    async def heartbeat(self) -> list[str]:
        """Say this worker is alive for another ttl; returns every live worker's id."""
        return await live_workers(self._client, self.worker, self._ttl_ms)

    async def leave(self) -> None:
        await self._client.execute([("ZREM", self._client.layout.workers_key, self.worker)])

    async def acquire(self, ranks: Sequence[RankId]) -> list[RankId]:
        """Try to take each rank's lease; returns those now held."""
        values = [f"{self.worker}#{next(self._acquisitions)}" for _ in ranks]
        replies = await self._client.execute(
            [
                ("SET", self.key(rank), value, "NX", "PX", self._ttl_ms)
                for rank, value in zip(ranks, values, strict=True)
            ]
        )
        taken = [(r, v) for r, v, ok in zip(ranks, values, replies, strict=True) if ok]
        self._values.update(taken)
        return [rank for rank, _ in taken]

    async def renew(self) -> tuple[list[RankId], list[RankId]]:
        """Restart the ttl of every lease held: ``(renewed, lost)``; lost ones are forgotten."""
        held = list(self._values.items())
        script = self._client.script
        replies = await self._client.execute(
            [script(RENEW_LEASE, [self.key(r)], [v, self._ttl_ms]) for r, v in held]
        )
        renewed, lost = [], []
        for (rank, _), ok in zip(held, replies, strict=True):
            (renewed if ok else lost).append(rank)
        for rank in lost:
            self._values.pop(rank, None)
        return renewed, lost

    def forget(self, rank: RankId) -> None:
        """Stop renewing a lease without telling Redis (it is being given up, or lost)."""
        self._values.pop(rank, None)

    async def release(self, rank: RankId) -> None:
        """Give a lease back now, so the next owner need not wait for it to expire."""
        value = self._values.pop(rank, None)
        if value is not None:
            await self._client.execute(
                [self._client.script(RELEASE_LEASE, [self.key(rank)], [value])]
            )

    async def free(self, ranks: Iterable[RankId]) -> list[RankId]:
        """The ranks nobody holds a lease on."""
        ranks = list(ranks)
        replies = await self._client.execute([("EXISTS", self.key(rank)) for rank in ranks])
        return [rank for rank, taken in zip(ranks, replies, strict=True) if not taken]


async def live_workers(client: RedisClient, worker: str = "", ttl_ms: int = 0) -> list[str]:
    """Ids of the workers whose heartbeat has not expired (``worker``: beat for it too)."""
    beat = client.script(HEARTBEAT, [client.layout.workers_key], [worker, ttl_ms])
    (ids,) = await client.execute([beat])
    return [i.decode() for i in ids]


async def record(client: RedisClient, event: str, rank: RankId, **fields: object) -> None:
    """Append one ownership change to ``P:owners`` (values as text)."""
    pairs = [("event", event), ("engine", rank.engine), ("dp_rank", rank.dp_rank), *fields.items()]
    flat = [str(x) for pair in pairs for x in pair if pair[1] is not None]
    owners = client.layout.owners_key
    await client.execute([("XADD", owners, "MAXLEN", "~", OWNERS_KEPT, "*", *flat)])
