"""Noticing that Redis lost acknowledged writes, before answers built on them go wrong.

Redis can lose acknowledged writes: a flush, a restart without persistence,
a restart from an older RDB snapshot or an AOF missing its last second, a
failover to a replica that had not received them. Every process checks for
it (:class:`LossWatch`):

- The identity is a random id written once (``SET NX`` semantics) into
  every anchor (``P:meta`` and each bucket). An anchor without it, or with
  another one, lost its data or belongs to another store. One identity per
  anchor, not one key, because on a cluster each master loses data on its
  own: the sixteen buckets' hash tags spread them over every master, so a
  master that lost its data always lost some bucket's identity, whatever
  slots it serves.
- ``#w`` rises with every write to its anchor (scripts return it) and each
  process keeps the highest value it saw (its *floors*). An anchor whose
  counter is below it came back with older data. A process notices only the
  loss of its own writes this way, which is what matters to it: another
  process's writes are noticed by that process.
- Every write script checks both before writing (atomically, in its slot) and
  answers -3 instead (a batch applied in one call on a standalone server
  checks P:meta's alone: one server loses or rolls back every anchor
  together); the process also reads the anchors every ``identity_check``
  seconds, so a loss is noticed within about a second even when nothing is
  written, and every prefix match and ping compares ``P:meta``'s with what it
  knows (:meth:`LossWatch.vouch`), so no answer read from a lost ``P:meta``
  goes out before the loss is on record. The store's apply path also refuses
  a rank whose stored watermark is below the last one this process committed
  for it.

What a loss means for the ranks (:class:`~indexer.stores.base.Loss`):

- *wiped* (an anchor lost its identity, or on a cluster a bucket came back
  older, so counts across masters no longer agree): the process that finds it
  gives the store a new identity, and the metadata forgets every rank. Each
  rank starts again empty and its consumer rebuilds it from the engine's
  replay buffer. Ids allocated after that start above every surviving
  bucket's ``#top``, so leftovers of the old identity are never read as new
  (the sweeper deletes them). A process that finds another identity than
  its own adopts it.
- *rolled back* (only counters behind, on a standalone server or on the
  master holding ``P:meta`` alone): everything on a server is a prefix of
  its writes, so each rank's state is exactly that of its stored, older,
  watermark; its consumer re-applies the batches after it from replay.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple

import msgspec

from indexer.retrying import repeat
from indexer.stores.base import Loss, StoreLost
from indexer.stores.redis.client import RedisClient, cancel_task
from indexer.stores.redis.scripts import ESTABLISH_IDENTITY, MARK_BUCKET, SWAP_IDENTITY

log = logging.getLogger("kvindex.redis")

#: What a write script answers when its hash lost data.
LOST = -3
_WIPED = "a flush, a restart without persistence or a failover to an empty replica"
_ROLLED_BACK = (
    "the store came back with older data: a restart from an older snapshot or"
    " AOF, or a failover to a replica that missed writes"
)


class Anchor(msgspec.Struct, frozen=True):
    """What one anchor hash holds of the store's identity."""

    identity: str | None
    writes: int
    top: int

    @classmethod
    def parse(cls, reply: Sequence[bytes | None]) -> Anchor:
        identity, writes, top = reply
        return cls(identity and identity.decode(), int(writes or 0), int(top or 0))


class Seal(NamedTuple):
    """What a read of ``P:meta`` must find there: the identity this process knows (None:
    none yet) and at least the write count it saw there."""

    identity: bytes | None
    writes: int


class LossWatch:
    """What this process knows of the store's identity, and the losses it noticed.

    ``floors``: per anchor (``P:meta``, then each bucket), the highest ``#w``
    seen; write scripts are given them and :meth:`saw` raises them.
    """

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._layout = client.layout
        self.identity: str | None = None
        self.floors = [0] * len(self._layout.anchor_keys)
        self.loss: Loss | None = None
        self._listeners: list[Callable[[Loss], None]] = []
        self._checking = asyncio.Lock()
        self._watch: asyncio.Task | None = None

    @property
    def count(self) -> int:
        """How many losses of data have been noticed since the store was opened."""
        return self.loss.number if self.loss is not None else 0

    def listen(self, listener: Callable[[Loss], None]) -> None:
        self._listeners.append(listener)

    def saw(self, anchor: int, writes: int) -> None:
        """A write script answered anchor ``anchor``'s ``#w``."""
        self.floors[anchor] = max(self.floors[anchor], writes)

    def seal(self) -> Seal:
        """What ``P:meta`` must hold for a read sent now (see :meth:`vouch`)."""
        identity = self.identity
        return Seal(None if identity is None else identity.encode(), self.floors[0])

    async def vouch(self, sealed: Seal, identity: bytes | None, writes: bytes | None) -> None:
        """A read sent under ``sealed`` found ``identity`` and ``writes`` in ``P:meta``'s
        ``#store`` and ``#w``: when that anchor lost data, record the loss before the
        read is answered.

        So an answer built on a store that was just wiped or rolled back goes
        out with its ranks flagged, not in the second before the periodic check
        or a write would notice. Only ``P:meta`` is vouched for: a cluster
        master that lost buckets alone is found by :meth:`check`.
        """
        if sealed.identity is None:
            return  # nothing known yet to compare with
        if identity != sealed.identity or int(writes or 0) < sealed.writes:
            await self.check()

    async def known_identity(self) -> str:
        """The store's identity, looked up (or given) at first use; from then on the
        anchors are watched (:meth:`watch`)."""
        if self.identity is None:
            await self.check()
            self.watch()
        assert self.identity is not None
        return self.identity

    def watch(self) -> None:
        """Check the anchors every ``identity_check`` seconds from now on (the first check
        learns the identity; an unreachable store is retried), once per process."""
        interval = self._client.config.identity_check
        if self._watch is None and interval:
            watch = repeat(interval, self.check, "store identity check")
            self._watch = asyncio.get_running_loop().create_task(watch)

    async def lost(self, since: int) -> StoreLost:
        """A write found lost data: the error to raise, once the loss is on record."""
        if self.count == since:
            await self.check(suspect="a write found the store behind what it had written")
        return StoreLost(self.loss.reason if self.loss is not None else "the store lost data")

    async def check(self, suspect: str | None = None) -> None:
        """Compare the anchors with what this process knows of them; record a loss.

        ``suspect``: a write already found one; record it (as a roll-back, with
        that reason) even if the anchors now look whole.
        """
        async with self._checking:
            floors = list(self.floors)  # before the read: writes meanwhile only raise counters
            anchors = await self._read_anchors()
            known, found = self.identity, anchors[0].identity
            whole = all(a.identity == found for a in anchors[1:])
            behind = [i for i, a in enumerate(anchors) if a.writes < floors[i]]
            if found is None and known is None and all(a.identity is None for a in anchors):
                await self._take_identity(await self._establish(), anchors)
            elif found is None or (found == known and not whole):
                what = "P:meta" if found is None else "a bucket"
                why = f"{what} lost the store's identity"
                await self._replace_identity(found or "", anchors, why)
            elif found != known:
                await self._take_identity(found, anchors)
                if known is not None:
                    self._record(True, "another process found the store's data replaced")
            elif behind and self._client.config.cluster and behind != [0]:
                why = "a cluster node came back with older buckets"
                await self._replace_identity(found, anchors, why)
            elif behind or suspect:
                self.floors = [a.writes for a in anchors]
                self._record(False, suspect or _ROLLED_BACK)
            else:
                seen = zip(self.floors, anchors, strict=True)
                self.floors = [max(floor, a.writes) for floor, a in seen]

    async def _read_anchors(self) -> list[Anchor]:
        """P:meta's anchor, then the buckets'. Read the buckets first: identities go
        into P:meta before the buckets, so a bucket holding one P:meta lacks truly lost
        it (a cluster reads its masters one by one, not at one instant)."""
        fields = ("#store", "#w", "#top")
        execute, layout = self._client.execute, self._layout
        buckets = await execute([("HMGET", key, *fields) for key in layout.bucket_keys])
        (meta,) = await execute([("HMGET", layout.meta_key, *fields)])
        return [Anchor.parse(reply) for reply in (meta, *buckets)]

    async def _establish(self) -> str:
        """A fresh store's first identity (another process's, if it was first)."""
        script = self._client.script(ESTABLISH_IDENTITY, [self._layout.meta_key], [_new_id()])
        (identity,) = await self._client.execute([script])
        return identity.decode()

    async def _replace_identity(self, seen: str, anchors: Sequence[Anchor], why: str) -> None:
        """Give the store a new identity: every rank starts again empty."""
        floor = max(a.top for a in anchors) + 1
        args = [seen, _new_id(), floor]
        script = self._client.script(SWAP_IDENTITY, [self._layout.meta_key], args)
        (identity,) = await self._client.execute([script])
        await self._take_identity(identity.decode(), ())
        self._record(True, f"{why}: {_WIPED}")

    async def _take_identity(self, identity: str, anchors: Sequence[Anchor]) -> None:
        """Make ``identity`` this process's and every bucket's; start counting anew.

        ``anchors``: as just read (empty: read them again), to skip the buckets
        that hold it already.
        """
        keys = self._layout.bucket_keys
        if anchors:
            keys = [k for k, a in zip(keys, anchors[1:], strict=True) if a.identity != identity]
        if keys or not anchors:
            script = self._client.script
            await self._client.execute([script(MARK_BUCKET, [key], [identity]) for key in keys])
            anchors = await self._read_anchors()
        self.identity = identity
        self.floors = [a.writes for a in anchors]

    def _record(self, wiped: bool, reason: str) -> None:
        self.loss = loss = Loss(self.count + 1, wiped, reason)
        where = self._client.where
        log.warning("store lost data", extra={"store": where, "wiped": wiped, "why": reason})
        for listener in self._listeners:
            listener(loss)

    async def close(self) -> None:
        await cancel_task(self._watch)


def _new_id() -> str:
    return uuid.uuid4().hex
