"""``kvindex indexer`` workers: the fleet's ranks shared out among processes through Redis.

A :class:`Worker` consumes the ranks it holds a lease on (:mod:`indexer.cluster.leases`).
Three loops, so that slow work never delays a renewal:

- every ``lease_ttl / 4`` seconds it beats its heartbeat and renews its leases;
- every ``lease_ttl / 4`` seconds it re-reads the engine registry and
  rebalances: it aims at ``ceil(ranks / live workers)`` ranks, gives extra
  ones back after stopping them (the next owner need not wait for an
  expiry), and takes unowned or expired ones;
- every 50 ms it stops the ranks whose lease it could not renew for
  ``lease_ttl / 2`` (Redis unreachable, the process stalled) or a renewal
  said are someone else's: by then no one else can hold the lease yet, so
  it has stopped before another worker starts.

Hand-over, in order: the old owner stops applying (it finishes the batch in
hand), then its lease goes, by release or by expiry; the new owner takes the
lease, claims the rank (:meth:`~indexer.stores.base.Store.claim`: a
new fence token, so any write the old owner still has in flight is refused),
and resumes from the Redis watermark with a replay from the engine. Nothing
is lost and nothing is counted twice; the store's exactly-once marks make
the one batch that can overlap a no-op. Fencing covers what timing cannot
(a stall longer than half a lease).

Every change of ownership goes to the ``P:owners`` stream: ``claimed`` (with
the token and the watermark it resumes from), then one of ``released``
(rebalancing or shutdown), ``lost``, ``fenced``, ``unregistered``,
``failed`` or ``store_lost``, with the last applied seq.

When Redis loses data (:mod:`indexer.stores.redis.losses`), the
leases, the fence tokens and the registry may have gone with it. A worker
then stops every rank it owns (its writes are refused from the moment its
store notices) and claims them again like any free rank, which the engine
registry, re-seeded by every process that knew it
(:meth:`~indexer.cluster.redis_registry.RedisRegistry.refresh`), makes possible. The
new consumers resume from the store's watermarks through replay.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass

import msgspec

from indexer.cluster.leases import Leases, record
from indexer.cluster.rebuilds import Rebuilds
from indexer.cluster.redis_registry import RedisRegistry
from indexer.cluster.status_board import Published, publishing
from indexer.core.events import RankId
from indexer.engine_registry import EngineSpec, RankStatus
from indexer.ingest.rank_consumer import RankConsumer
from indexer.ingest.settings import Seconds
from indexer.ingest.subscriber import RankPool
from indexer.retrying import repeat
from indexer.stores.redis import RedisStore
from indexer.stores.redis.client import cancel_task

log = logging.getLogger("kvindex.worker")

#: How often a worker checks that each rank's lease is still recent enough.
_WATCH = 0.05


class WorkerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How workers share ranks: the ``indexer`` section of the config file."""

    #: Seconds a rank's lease outlives its last renewal. A dead worker's ranks wait
    #: this long for a new owner; renewals every quarter of it; a worker that could not
    #: renew for half of it stops the rank. Lower it only on quiet machines.
    lease_ttl: Seconds = 6.0
    #: Seconds between publications of rank statuses (what API replicas show), and
    #: between API replicas' reads of them.
    status_interval: Seconds = 1.0
    #: Seconds between API replicas' looks at the engine registry (workers look at
    #: every lease round).
    registry_poll: Seconds = 0.5


def default_worker_id() -> str:
    """Host, pid and a random suffix: unique even across restarts in one container."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class _Owned:
    """A rank this worker consumes: under which token, from which registry entry."""

    consumer: RankConsumer
    token: int
    entry: bytes
    valid_until: float  # monotonic: stop by then unless a renewal succeeds
    losses: int  # the store's losses of data when it was claimed


class Worker:
    """The ranks one ``kvindex indexer`` process owns, consumed into the Redis store.

    Implements the status side of :class:`~indexer.engine_registry.ConsumerView`
    (``running``) and the metrics' status source through its :class:`RankPool`.
    Its consumers write to ``store`` under their claim's token; its leases,
    records and statuses go through the store's Redis gateway (``store.client``).
    """

    def __init__(
        self,
        store: RedisStore,
        registry: RedisRegistry,
        pool: RankPool,
        settings: WorkerSettings,
        worker_id: str | None = None,
    ) -> None:
        self.id = worker_id or default_worker_id()
        self._store = store
        self._registry = registry
        self._pool = pool
        self._settings = settings
        self._ttl = settings.lease_ttl
        self._redis = store.client
        self._leases = Leases(self._redis, self.id, self._ttl)
        self._rebuilds = Rebuilds(self._redis)
        self._owned: dict[RankId, _Owned] = {}
        self._tasks: list[asyncio.Task] = []
        self._dropping: set[asyncio.Task] = set()
        self._live = 0  # live workers, as of the last heartbeat
        #: ranks consumed here before: the newest seq reached (applied or received), and the
        #: store's losses when that consumer was claimed (a loss since means it may have to
        #: be applied again)
        self._retired: dict[RankId, tuple[int, int]] = {}
        self._balances = 0

    async def start(self) -> None:
        self._pool.open()
        every = self._ttl / 4
        self._tasks = [
            asyncio.create_task(repeat(every, self._renew, "lease renewal")),
            asyncio.create_task(repeat(every, self._balance, "rebalancing")),
            asyncio.create_task(repeat(_WATCH, self._expire, "lease watch")),
            asyncio.create_task(
                repeat(self._settings.status_interval, self._publish, "status publication")
            ),
        ]
        log.info("worker started", extra={"worker": self.id, "lease_ttl": self._ttl})

    async def stop(self) -> None:
        """Stop every rank and give its lease back, so the others take over at once."""
        await asyncio.gather(*map(cancel_task, self._tasks))  # each sends through redis-py
        await asyncio.gather(*self._tasks, *self._dropping, return_exceptions=True)
        await asyncio.gather(*(self._drop(rank, "released") for rank in list(self._owned)))
        try:
            await self._leases.leave()
        except Exception as e:
            log.warning("could not leave the worker set", extra={"error": repr(e)})
        await self._pool.close()
        log.info("worker stopped", extra={"worker": self.id})

    def running(self) -> bool:
        return self._pool.running() and all(not t.done() for t in self._tasks)

    # --- leases -------------------------------------------------------------------------

    async def _renew(self) -> None:
        sent = time.monotonic()
        self._live = len(await self._leases.heartbeat())
        renewed, lost = await self._leases.renew()
        for rank in renewed:
            if rank in self._owned:
                self._owned[rank].valid_until = sent + self._ttl / 2
        for rank in lost:  # someone else's now: the watch stops it at once
            if rank in self._owned:
                self._owned[rank].valid_until = float("-inf")

    async def _expire(self) -> None:
        """Stop the ranks whose lease is not known to be ours any more (in the background,
        so that one slow stop does not delay the next)."""
        now = time.monotonic()
        for rank in [r for r, owned in self._owned.items() if owned.valid_until < now]:
            self._leases.forget(rank)
            task = asyncio.create_task(self._retire(rank, self._owned.pop(rank), "lost"))
            self._dropping.add(task)
            task.add_done_callback(self._dropping.discard)

    # --- balance ------------------------------------------------------------------------

    async def _balance(self) -> None:
        await self._registry.refresh()
        wanted = {
            RankId(name, dp_rank): (spec, entry)
            for name, (spec, entry) in self._registry.entries().items()
            if spec.events  # an engine without events has nothing to consume
            for dp_rank in range(spec.dp_ranks)
        }
        await asyncio.gather(*(self._drop(r, why) for r, why in self._unwanted(wanted).items()))
        self._balances += 1
        if self._balances == 1 or not self._live:
            return  # announce first, take a share once the others can see this worker
        target = math.ceil(len(wanted) / self._live)
        extra = random.sample(sorted(self._owned), max(0, len(self._owned) - target))
        await asyncio.gather(*(self._drop(rank, "released") for rank in extra))
        if len(self._owned) < target:
            await self._take(wanted, target - len(self._owned))

    def _unwanted(self, wanted: dict[RankId, tuple[EngineSpec, bytes]]) -> dict[RankId, str]:
        """Ranks to stop whatever the balance: deregistered, fenced or failed."""
        unwanted = {}
        for rank, owned in self._owned.items():
            if rank not in wanted or wanted[rank][1] != owned.entry:
                unwanted[rank] = "unregistered"
            elif owned.losses != self._store.losses:
                unwanted[rank] = "store_lost"  # claimed anew: tokens may have gone with the data
            elif owned.consumer.fenced:
                unwanted[rank] = "fenced"
            elif owned.consumer.failed:
                unwanted[rank] = "failed"
        return unwanted

    async def _take(self, wanted: dict[RankId, tuple[EngineSpec, bytes]], count: int) -> None:
        """Acquire up to ``count`` free ranks, claim them and start consuming."""
        free = await self._leases.free(r for r in wanted if r not in self._owned)
        random.shuffle(free)
        sent = time.monotonic()
        for rank in await self._leases.acquire(free[:count]):
            spec, entry = wanted[rank]
            losses = self._store.losses
            token = await self._store.claim(rank, entry)
            if token is None:  # deregistered or changed since the registry was read
                await self._leases.release(rank)
                continue
            mark = await self._store.watermark(rank)
            seq = None if mark is None else mark.seq
            stored = -1 if seq is None else seq
            carried = await self._rebuilds.pending(rank)
            await record(self._redis, "claimed", rank, worker=self.id, token=token, seq=seq)
            try:
                consumer = self._pool.start(spec, rank.dp_rank, self._store, fence=token)
            except Exception as e:
                log.warning("cannot consume rank", extra={"engine": rank.engine, "error": repr(e)})
                await record(self._redis, "failed", rank, worker=self.id, token=token, seq=seq)
                await self._leases.release(rank)
                continue
            self._follow_loss(rank, consumer, losses)
            if carried is not None and carried[0] > max(consumer.reached(), stored):
                consumer.rebuilding(*carried)  # an earlier consumer's, unfinished
            self._owned[rank] = _Owned(consumer, token, entry, sent + self._ttl / 2, losses)
            if consumer.rebuild is not None:  # before its lease can be lost again
                await self._rebuilds.keep({rank: consumer.rebuild})
            log.info("rank claimed", extra={**consumer.ids(), "token": token, "from_seq": seq})

    async def _drop(self, rank: RankId, why: str) -> None:
        owned = self._owned.pop(rank, None)
        if owned is not None:  # else dropped meanwhile by another loop
            await self._retire(rank, owned, why)

    async def _retire(self, rank: RankId, owned: _Owned, why: str) -> None:
        """Stop consuming a rank, record it, then give its lease back unless it is lost.

        Recorded before the release, so that the next owner's claim always
        comes after this in the ownership stream.
        """
        if why == "fenced":
            self._leases.forget(rank)
        reached = owned.consumer.reached()  # before stopping: what it had queued counts too
        await self._pool.stop(rank)
        self._remember(rank, None if reached < 0 else reached, owned.losses)
        seq = owned.consumer.status.applied_seq
        log.info("rank dropped", extra={**owned.consumer.ids(), "why": why, "applied_seq": seq})
        try:
            await record(self._redis, why, rank, worker=self.id, token=owned.token, seq=seq)
            await self._leases.release(rank)
        except Exception as e:  # Redis is down: the lease expires by itself
            log.warning("could not record a dropped rank", extra={"error": repr(e)})

    def _remember(self, rank: RankId, seq: int | None, losses: int) -> None:
        """Keep what a dropped consumer had reached (the furthest of this worker's
        consumers of the rank since the earliest claim not yet followed up)."""
        prior = self._retired.get(rank)
        if prior is not None:
            seq, losses = max(prior[0], -1 if seq is None else seq), prior[1]
        if seq is not None:
            self._retired[rank] = (seq, losses)

    def _follow_loss(self, rank: RankId, consumer: RankConsumer, losses: int) -> None:
        """A rank claimed anew after the store lost data that an earlier consumer here
        had applied: degraded until that is applied again (the store may be behind it).

        ``losses``: the store's when the claim began. A loss noticed since voids
        the claim (the rank is dropped and claimed again): what was applied is
        then kept for the next claim to follow up, or that consumer would start
        from the empty store unflagged.
        """
        retired, loss = self._retired.get(rank), self._store.last_loss()
        if retired is not None and loss is not None and retired[1] != loss.number:
            if losses == loss.number:
                del self._retired[rank]
            consumer.rebuilding(retired[0], loss.reason)

    # --- statuses ---------------------------------------------------------------------

    async def _publish(self) -> None:
        """Publish the statuses of the ranks owned here, read after the store's anchor:
        never a rank's unflagged status over data the store lost unnoticed."""
        await self._store.ping()
        owned = list(self._owned.items())
        entries = [Published(rank.engine, o.token, self._status(o)) for rank, o in owned]
        ttl = max(3 * self._settings.status_interval, self._ttl)
        rebuilds = self._rebuilds.keeping({rank: o.consumer.rebuild for rank, o in owned})
        await self._redis.execute([publishing(self._redis, self.id, entries, ttl), *rebuilds])

    def _status(self, owned: _Owned) -> RankStatus:
        """A rank's status as published; flagged if claimed before the store's last loss
        (the claim is void, whatever its consumer applied: the rank is claimed anew)."""
        status = msgspec.structs.replace(owned.consumer.status_now(), owner=self.id)
        loss = self._store.last_loss()
        if loss is not None and owned.losses != loss.number and status.store_loss is None:
            status.degraded, status.store_loss = True, f"{loss.reason}; being claimed anew"
        return status
