"""Routed entries in Redis, so that every API replica sees every entry.

One sorted set per rank (member the block hash, score its deadline on the
server's clock), the set of ranks holding entries and a hash of counters,
all under one hash tag (:mod:`indexer.routed.scripts` says why). Each call is
one script: one round trip per query, and ``route`` atomic across replicas.
Expired entries are dropped, and counted, by whichever script next touches
their rank; a rank nobody touches for ``grace`` seconds past its last
deadline is expired by Redis itself, uncounted.

Confirmations come from the ranks' applied batches (:meth:`RedisRouted.observe`,
a subscriber observer): they are gathered and sent in the background, one
script per round, so the apply loop never waits on Redis for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from indexer.core.events import BlockHash, EventBatch, RankId
from indexer.core.matching import TierWeights
from indexer.core.routed import Candidate, confirmations
from indexer.errors import StoreUnavailable
from indexer.routed import scripts
from indexer.routed.base import COUNTS, Routing
from indexer.stores.redis import RedisClient, RedisConfig, Script

log = logging.getLogger("kvindex.routed")

#: Seconds past a rank's last deadline before Redis drops its sorted set on its own.
GRACE = 60.0


def _member(block_hash: BlockHash) -> bytes:
    """A hash as a set member: decimal for ints, ``#`` + the digest for bytes."""
    return b"#" + block_hash if type(block_hash) is bytes else b"%d" % block_hash


def _rank_name(rank: RankId) -> str:
    return f"{rank.engine}|{rank.dp_rank}"


def _rank_of(name: bytes) -> RankId:
    engine, _, dp_rank = name.decode().rpartition("|")
    return RankId(engine, int(dp_rank))


def _by_rank(flat: list) -> dict[RankId, int]:
    return {_rank_of(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}


class RedisRouted:
    """:class:`~indexer.routed.base.RoutedEntries` in Redis (``config``: the store's;
    ``client``: the store's gateway to share, which it then closes itself)."""

    def __init__(self, config: RedisConfig, client: RedisClient | None = None) -> None:
        tag = f"{{{config.prefix}:routed}}"
        self._keys = [f"{tag}:ranks", f"{tag}:counts"]
        self._head = [f"{tag}:z:", int(GRACE * 1000)]
        self._owns_client = client is None
        self._client = client or RedisClient(config)
        self._scripts = {
            name: Script(getattr(scripts, name))
            for name in ("RECORD", "LOOKUP", "ROUTE", "SETTLE", "FORGET", "COUNTS")
        }
        self._local: Counter[str] = Counter()
        self._pending: dict[RankId, tuple[bool, list[BlockHash]]] = {}
        self._flushing: asyncio.Task | None = None

    async def _call(self, name: str, args: list) -> list:
        """One script through the store's gateway (Redis failing: StoreUnavailable)."""
        command = self._client.script(self._scripts[name], self._keys, [*self._head, *args])
        (answer,) = await self._client.execute([command])
        return answer

    def _expired(self, answer: list) -> None:
        self._local["expired"] += int(answer[0])

    async def record(self, rank: RankId, chain: Sequence[BlockHash], ttl: float, bound: int) -> int:
        args = [_rank_name(rank), round(ttl * 1000, 3), bound, *map(_member, chain)]
        answer = await self._call("RECORD", args)
        self._expired(answer)
        self._local["recorded"] += int(answer[1])
        self._local["evicted"] += int(answer[2])
        return int(answer[1])

    async def lookup(
        self, chain: Sequence[BlockHash], starts: Mapping[RankId, int], engines: Collection[str]
    ) -> dict[RankId, int]:
        if not chain or not engines:
            return {}
        # A rank's start defaults to 0 in the script: only longer exact runs are sent.
        pairs = [x for r, start in starts.items() if start for x in (_rank_name(r), start)]
        args = [len(engines), *engines, len(pairs) // 2, *pairs, *map(_member, chain)]
        await self._observed()
        answer = await self._call("LOOKUP", args)
        self._expired(answer)
        return _by_rank(answer[1])

    async def route(
        self,
        chain: Sequence[BlockHash],
        candidates: Sequence[Candidate],
        weights: TierWeights,
        ttl: float,
    ) -> Routing:
        if not candidates:
            return None, {}, {}
        fields = [
            x
            for c in candidates
            for x in (
                _rank_name(RankId(c.engine, c.dp_rank)),
                c.match.gpu_blocks,
                c.match.prefix_blocks,
                repr(c.match.score(weights)),
                c.bound,
                repr(c.placement.miss_factor),
                repr(c.placement.load_cost),
                repr(c.placement.per_block),
            )
        ]
        args = [repr(weights.routed), round(ttl * 1000, 3), len(candidates), *fields]
        await self._observed()
        answer = await self._call("ROUTE", [*args, *map(_member, chain)])
        self._expired(answer)
        self._local["recorded"] += int(answer[2])
        self._local["evicted"] += int(answer[3])
        pick = int(answer[1])
        return (candidates[pick] if pick >= 0 else None), _by_rank(answer[4]), _by_rank(answer[5])

    async def _settle(self, settles: Mapping[RankId, tuple[bool, Sequence[BlockHash]]]) -> None:
        args: list = []
        for rank, (clear, hashes) in settles.items():
            args += [_rank_name(rank), int(clear), len(hashes), *map(_member, hashes)]
        answer = await self._call("SETTLE", args)
        self._expired(answer)
        self._local["confirmed"] += int(answer[1])
        self._local["cleared"] += int(answer[2])

    async def confirm(self, rank: RankId, hashes: Sequence[BlockHash]) -> None:
        await self._settle({rank: (False, hashes)})

    async def clear(self, rank: RankId) -> None:
        await self._settle({rank: (True, ())})

    async def forget(self, engine: str) -> None:
        answer = await self._call("FORGET", [engine])
        self._expired(answer)
        self._local["cleared"] += int(answer[1])

    def observe(self, rank: RankId, batch: EventBatch) -> None:
        stored, cleared = confirmations(batch)
        if not stored and not cleared:
            return
        was_cleared, hashes = self._pending.get(rank, (False, []))
        if cleared:
            was_cleared, hashes = True, []
        self._pending[rank] = (was_cleared, hashes + stored)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Send what observers gathered until nothing is left; a failure drops that
        round (those entries then end by their TTL)."""
        while self._pending:
            settles, self._pending = self._pending, {}
            try:
                await self._settle(settles)
            except StoreUnavailable as e:
                log.warning("routed confirmations dropped", extra={"error": str(e)})

    async def _observed(self) -> None:
        """Wait for the confirmations gathered so far: a query after an applied batch
        sees what it confirmed, as with the embedded implementation."""
        if self._flushing is not None and not self._flushing.done():
            await asyncio.shield(self._flushing)

    async def counts(self) -> dict[str, int]:
        await self._observed()
        answer = await self._call("COUNTS", [])
        self._expired(answer)
        flat = answer[2]
        stored = {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        return {**{name: stored.get(name, 0) for name in COUNTS}, "live": int(answer[1])}

    def local_counts(self) -> dict[str, int]:
        counts = {name: self._local[name] for name in COUNTS}
        ended = sum(counts[name] for name in ("confirmed", "expired", "evicted", "cleared"))
        counts["live"] = max(0, counts["recorded"] - ended)
        return counts

    async def close(self) -> None:
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        if self._owns_client:
            await self._client.close()
