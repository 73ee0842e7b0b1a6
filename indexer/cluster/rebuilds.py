"""Rebuilds after a store loss, kept in Redis so that they outlive their consumer.

A rank claimed anew after Redis lost data is rebuilt from the engine's replay
buffer, and reported ``degraded`` until it has applied again every batch its
earlier consumer had reached (:meth:`~indexer.ingest.rank_consumer.RankConsumer.rebuilding`).
Until then the store holds an older state of the rank. Should the rank change
owner midway (a lease lost on a loaded worker, a rebalance), the next consumer
resumes from the store's watermark and would answer that older state unflagged:
what it must reach lives only in the consumer that was stopped.

So each worker keeps the rebuilds of the ranks it owns in the hash
``{P:meta}:rebuilds`` (rank field -> ``[last, reason]``, msgpack), written when a
rebuild begins and at every status publication (a rebuild that ended is
deleted), and a worker claiming a rank reads it: a target beyond the store's
watermark is rebuilt on. API replicas read it too: a rank that no worker
consumes while its rebuild is pending is in doubt (``/readyz`` 503). Should Redis
lose the hash, that is a new loss, which the workers rebuild after from what
their own consumers reached.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from indexer.core.events import RankId
from indexer.stores.redis.client import RedisClient
from indexer.stores.redis.layout import parse_rank_field, rank_field

#: A rebuild under way: the newest batch to apply again, and the loss it follows.
Rebuild = tuple[int, str]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(tuple[int, str]).decode


class Rebuilds:
    """The rebuilds under way, by rank, in Redis."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._key = f"{{{client.layout.meta_key}}}:rebuilds"

    async def pending(self, rank: RankId) -> Rebuild | None:
        """The rebuild an earlier consumer of ``rank`` left unfinished, if any."""
        (raw,) = await self._client.execute([("HGET", self._key, rank_field(rank))])
        return None if raw is None else _decode(raw)

    def reading(self) -> tuple:
        """The command reading every rebuild, to send in a caller's pipeline (its answer
        goes to :meth:`read`)."""
        return ("HGETALL", self._key)

    @staticmethod
    def read(fields: Mapping[bytes, bytes]) -> dict[RankId, Rebuild]:
        """Every rebuild under way or left unfinished, by rank, from :meth:`reading`'s answer."""
        found = ((parse_rank_field(name), raw) for name, raw in fields.items())
        return {rank: _decode(raw) for rank, raw in found if rank is not None}

    def keeping(self, ranks: Mapping[RankId, Rebuild | None]) -> list[tuple]:
        """The commands recording each rank's rebuild (None: it has none, any recorded one
        is deleted), to send in a caller's pipeline."""
        under_way = {rank_field(r): _encode(b) for r, b in ranks.items() if b is not None}
        ended = [rank_field(r) for r, b in ranks.items() if b is None]
        commands: list[tuple] = []
        if under_way:
            commands.append(("HSET", self._key, *(x for kv in under_way.items() for x in kv)))
        if ended:
            commands.append(("HDEL", self._key, *ended))
        return commands

    async def keep(self, ranks: Mapping[RankId, Rebuild | None]) -> None:
        """Record each rank's rebuild now (:meth:`keeping`)."""
        if commands := self.keeping(ranks):
            await self._client.execute(commands)
