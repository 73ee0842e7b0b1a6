"""What the Redis store answers: residencies, prefix matches, counts, from metadata and blocks.

A reader takes each rank's live tier ids from ``P:meta`` and reads only
their fields of the block hashes; whatever else a block holds (cleared
generations, forgotten ranks, not yet swept) it ignores. A prefix query
fetches the chain's blocks in windows, the first of :data:`FIRST_WINDOW`
blocks and each next one twice as long, and stops as soon as no later block
can change any rank's answer.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from indexer.core.events import GPU, MEDIA, BlockHash, RankId
from indexer.core.hybrid import group_rules, hybrid_match, is_scored
from indexer.core.matching import (
    NO_MATCH,
    PrefixMatch,
    chunk_end,
    leading_run,
    loadable,
    match_prefix,
)
from indexer.stores.base import Residency, StoreUnavailable
from indexer.stores.redis.client import RedisClient
from indexer.stores.redis.layout import (
    RankMeta,
    TierId,
    decode_meta,
    parse_metas,
    parse_rank_field,
    rank_field,
)
from indexer.stores.redis.losses import LossWatch

#: Blocks fetched by a prefix query's first round trip; later ones double.
FIRST_WINDOW = 128


class RedisReads:
    """The read half of :class:`~indexer.stores.redis.RedisStore`, and its metadata cache.

    ``_cache``: each rank's metadata as last read or written by this process's
    writer of the rank, with the value it was encoded as (what a compare-and-set
    expects); dropped on any failure, since a failed write may have changed it.
    Reads for operators (:meth:`block_counts`, :meth:`anomalies`) never fill it:
    one that started before a commit and returned after it would put back the
    older metadata, and the writer would take its own commit for lost data.
    """

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self.layout = client.layout
        self._cache: dict[RankId, tuple[bytes, RankMeta]] = {}
        #: what this process knows of the store's identity: prefix matches check it
        self._losses = LossWatch(client)

    async def _run(self, commands: Sequence[tuple]) -> list:
        try:
            return await self.client.execute(commands)
        except StoreUnavailable:
            self._cache.clear()
            raise

    async def _read_meta(self, rank: RankId) -> tuple[bytes, RankMeta | None]:
        """The rank's metadata as stored, cached for the writer (see the class doc)."""
        blob, meta = await self._peek_meta(rank)
        if meta is None:
            self._cache.pop(rank, None)
        else:
            self._cache[rank] = (blob, meta)
        return blob, meta

    async def _peek_meta(self, rank: RankId) -> tuple[bytes, RankMeta | None]:
        """The rank's metadata as stored, leaving the writer's cache alone."""
        (blob,) = await self._run([("HGET", self.layout.meta_key, rank_field(rank))])
        return (b"", None) if blob is None else (blob, decode_meta(blob))

    async def block_residency(self, block_hash: BlockHash) -> list[Residency]:
        reply, fields = await self._run(
            [("HGETALL", self.layout.meta_key), ("HGETALL", self.layout.block_key(block_hash))]
        )
        where = _tiers_by_id(parse_metas(reply))
        found = []
        for tid, count in fields.items():
            if tid in where:
                rank, t = where[tid]
                found.append(
                    Residency(*rank, t.medium, t.ownership, t.group, t.locality, int(count))
                )
        return found

    async def prefix_match(
        self, chain: Sequence[BlockHash], chunk_blocks: Mapping[str, int | None]
    ) -> dict[RankId, PrefixMatch]:
        keys = [self.layout.block_key(h) for h in chain]
        window = min(len(chain), FIRST_WINDOW)
        sealed = self._losses.seal()
        reply, *blocks = await self._run(
            [("HGETALL", self.layout.meta_key), *(("HGETALL", k) for k in keys[:window])]
        )
        await self._losses.vouch(sealed, reply.get(b"#store"), reply.get(b"#w"))
        metas = parse_metas(reply)
        matchers = {
            rank: _RankMatch(meta, chunk_blocks[rank.engine] or meta.chunk)
            for rank, meta in metas.items()
            if rank.engine in chunk_blocks
        }
        scored = {str(t.tid).encode(): found for m in matchers.values() for t, found in m.targets()}
        fetched, unsettled = 0, list(matchers.values())
        while True:
            for h, fields in zip(chain[fetched : fetched + window], blocks, strict=True):
                for tid in fields:
                    found = scored.get(tid)
                    if found is not None:
                        found.add(h)
            fetched += window
            unsettled = [m for m in unsettled if not m.settled(chain, fetched)]
            if fetched >= len(chain) or not unsettled:
                break
            window = min(2 * window, len(chain) - fetched)
            blocks = await self._run([("HGETALL", k) for k in keys[fetched : fetched + window]])
        found = ((rank, m.match(chain, fetched)) for rank, m in matchers.items())
        return {rank: match for rank, match in found if match != NO_MATCH}

    async def chain_residency(
        self, chain: Sequence[BlockHash], engines: Collection[str]
    ) -> dict[RankId, dict[tuple[str, int], set[BlockHash]]]:
        sealed = self._losses.seal()
        reply, *blocks = await self._run(
            [
                ("HGETALL", self.layout.meta_key),
                *(("HGETALL", self.layout.block_key(h)) for h in chain),
            ]
        )
        await self._losses.vouch(sealed, reply.get(b"#store"), reply.get(b"#w"))
        where = _tiers_by_id(parse_metas(reply), engines)
        found: dict[RankId, dict[tuple[str, int], set[BlockHash]]] = {}
        for h, fields in zip(chain, blocks, strict=True):
            for tid in fields:
                if tid in where:
                    rank, t = where[tid]
                    found.setdefault(rank, {}).setdefault((t.medium, t.group), set()).add(h)
        return found

    async def block_counts(self, rank: RankId) -> dict[str, int]:
        _, meta = await self._peek_meta(rank)
        gens = meta.gens if meta is not None else {}
        counts = dict.fromkeys(MEDIA, 0)
        if gens:
            fields = [f"g{gid}" for gid in gens.values()]
            replies = await self._run([("HMGET", key, *fields) for key in self.layout.bucket_keys])
            for values in replies:
                for medium, value in zip(gens, values, strict=True):
                    if value is not None:
                        counts[medium] += int(value.rsplit(b":", 1)[1])
        return counts

    async def anomalies(self, rank: RankId) -> dict[str, int]:
        _, meta = await self._peek_meta(rank)
        unknown = 0
        if meta is not None:
            field_ = f"u{meta.rid}"
            replies = await self._run([("HGET", key, field_) for key in self.layout.bucket_keys])
            unknown = sum(int(v) for v in replies if v is not None)
        return {"unknown_removals": unknown}

    async def ranks(self) -> list[RankId]:
        (names,) = await self._run([("HKEYS", self.layout.meta_key)])
        return sorted(r for r in map(parse_rank_field, names) if r is not None)

    async def ping(self) -> None:
        """Reach the store and read ``P:meta``'s anchor: a health check notices a loss too."""
        sealed = self._losses.seal()
        ((identity, writes),) = await self._run([("HMGET", self.layout.meta_key, "#store", "#w")])
        await self._losses.vouch(sealed, identity, writes)


def _tiers_by_id(
    metas: Mapping[RankId, RankMeta], engines: Collection[str] | None = None
) -> dict[bytes, tuple[RankId, TierId]]:
    """Each live tier of the ranks (of ``engines``, if given) by its field in a block hash."""
    return {
        str(t.tid).encode(): (rank, t)
        for rank, meta in metas.items()
        if engines is None or rank.engine in engines
        for t in meta.tiers
    }


class _RankMatch:
    """What a prefix query has learned about one rank so far.

    A rank of a full-attention model collects the fetched hashes of its
    scored tiers per medium; a hybrid model's rank (:func:`group_rules`)
    per medium and group, for vLLM's hybrid rule.
    """

    def __init__(self, meta: RankMeta, chunk_blocks: int | None) -> None:
        self.meta = meta
        self.chunk_blocks = chunk_blocks
        self.rules = group_rules(meta.kinds)
        self.found: dict[str, set[BlockHash]] = {m: set() for m in MEDIA}
        self.by_group: dict[tuple[str, int], set[BlockHash]] = {}

    def targets(self) -> Iterator[tuple[TierId, set[BlockHash]]]:
        """Each tier the match reads, with the set its fetched hashes go to."""
        if not self.rules:
            kinds = self.meta.kinds
            for t in self.meta.tiers:
                if is_scored(kinds.get(t.group)):
                    yield t, self.found[t.medium]
            return
        groups = {rule.group_idx for rule in self.rules}
        for t in self.meta.tiers:
            if t.group in groups:
                yield t, self.by_group.setdefault((t.medium, t.group), set())

    def _group_sets(self, medium: str, group_idx: int) -> list[set[BlockHash]]:
        found = self.by_group.get((medium, group_idx))
        return [found] if found is not None else []

    def full_match(self, chain: Sequence[BlockHash], fetched: int) -> PrefixMatch:
        """The match by full-attention groups alone, given the first ``fetched`` blocks
        (blocks after them count as missing)."""
        cb = self.chunk_blocks
        found = self.found
        if self.rules:  # a hybrid rank's scored groups, together
            fulls = [rule.group_idx for rule in self.rules if rule.window is None]
            found = {
                m: set().union(*(held for g in fulls for held in self._group_sets(m, g)))
                for m in MEDIA
            }
        gpu = leading_run(chain[:fetched], [found[GPU]])

        def chunk_in(medium: str, j: int) -> bool:
            return (j + 1) * cb <= fetched and chunk_end(chain, cb, j) in found[medium]

        return match_prefix(len(chain), gpu, cb, chunk_in)

    def match(self, chain: Sequence[BlockHash], fetched: int) -> PrefixMatch:
        """The answer given the first ``fetched`` blocks."""
        found, size = self.full_match(chain, fetched), self.chunk_blocks
        if self.rules:
            found = hybrid_match(chain[:fetched], found, size, self.rules, self._group_sets)
        return loadable(found, size)

    def settled(self, chain: Sequence[BlockHash], fetched: int) -> bool:
        """Whether no block after the first ``fetched`` can change the answer.

        A hybrid answer never reaches past the full-attention one, and grows
        only with it; a rank without a full-attention group reads the chain whole.
        """
        if self.rules and all(rule.window is not None for rule in self.rules):
            return False
        m = self.full_match(chain, fetched)
        if m.gpu_blocks >= fetched:
            return False
        if not self.chunk_blocks:
            return True
        edge = fetched // self.chunk_blocks * self.chunk_blocks
        return max(m.cpu_blocks, m.storage_blocks, m.prefix_blocks) < edge
