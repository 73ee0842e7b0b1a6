"""Every key and field name of a Redis index, and the codecs of what they hold.

Key layout under a prefix ``P`` (several indexes can share one Redis)::

    P:meta           hash: "r:<dp>:<engine>" -> RankMeta (msgpack): watermark, ids,
                     group kinds, chunk size; "#ids" -> last id allocated;
                     "a:<dp>:<engine>" -> "first:last", ids allocated, not yet taken;
                     "f:<dp>:<engine>" -> the rank's fence: its newest owner's token
    {P:meta}:engines hash in P:meta's slot: engine name -> EngineSpec (JSON),
                     "#version" -> change counter (the cluster layer's engine registry)
    P:{tag}          bucket hash: "g<gid>" -> "epoch:seq:n", "u<rid>" -> unknown removals,
                     "f:<dp>:<engine>" -> the newest owner's token the bucket has seen
    P:{tag}:<hash>   block hash: "<tid>" -> count, one field per residency
    P:lease:<dp>:<engine>, P:workers, P:owners, P:status:<worker>
                     the cluster layer's leases, live workers, ownership log, statuses

P:meta and every bucket are the store's *anchors*: each holds ``#store``, the
store's identity, and ``#w``, its write counter; buckets also hold ``#top``,
the highest id their fields are named after.

A block's key carries the hash tag of its bucket (``hash % BUCKETS``), so a
bucket and its blocks share one cluster slot. Ids come from one counter and
are never reused: ``rid`` names a rank, ``gid`` a generation of one medium of a
rank, ``tid`` a tier (medium, ownership, group) within a generation. Readers
take a rank's live tids from ``P:meta`` and ignore every other field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from indexer.core.events import BlockHash, RankId
from indexer.core.residency import Tier

#: Buckets per index: the unit of write atomicity and of cluster placement.
#: Part of the data format — an index written with one value cannot be read
#: with another.
BUCKETS = 16

#: ``h & LOW == h % BUCKETS`` for every int, BUCKETS being a power of two.
LOW = BUCKETS - 1
if BUCKETS & LOW:
    raise ImportError("BUCKETS must be a power of two")


def _bucket_tags(buckets: int) -> list[str]:
    """One hash tag per bucket, its slot in the bucket's share of the slot range.

    Masters own contiguous slot ranges, so this spreads buckets evenly over them.
    """
    width, tags = REDIS_CLUSTER_HASH_SLOTS // buckets, []
    for b in range(buckets):
        n = 0
        while key_slot(f"{b}.{n}".encode()) // width != b:
            n += 1
        tags.append(f"{b}.{n}")
    return tags


_TAGS = _bucket_tags(BUCKETS)


def bucket_of(block_hash: BlockHash) -> int:
    if type(block_hash) is int:
        return block_hash % BUCKETS
    return int.from_bytes(block_hash[-8:], "big") % BUCKETS


def block_name(block_hash: BlockHash) -> str:
    """A block hash as the last part of its key: decimal, or ``x`` and hex for bytes."""
    return str(block_hash) if type(block_hash) is int else f"x{block_hash.hex()}"


class Layout:
    """The key names of one index (one prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.meta_key = f"{prefix}:meta"
        #: The engine registry's hash: in the metadata's slot, so a claim can check it.
        self.registry_key = f"{{{self.meta_key}}}:engines"
        self.bucket_keys = [f"{prefix}:{{{tag}}}" for tag in _TAGS]
        self.encoded_bucket_keys = [key.encode() for key in self.bucket_keys]  # spares redis-py
        self._block_prefixes = [f"{key}:" for key in self.bucket_keys]
        #: P:meta, then the buckets: what holds the store's identity and write counters
        self.anchor_keys = [self.meta_key, *self.bucket_keys]
        #: what matches every block key (for SCAN)
        self.block_pattern = f"{prefix}:{{*}}:*"
        self.workers_key = f"{prefix}:workers"
        self.owners_key = f"{prefix}:owners"

    def block_key(self, block_hash: BlockHash) -> str:
        return f"{self._block_prefixes[bucket_of(block_hash)]}{block_name(block_hash)}"

    def lease_key(self, rank: RankId) -> str:
        return f"{self.prefix}:lease:{rank.dp_rank}:{rank.engine}"

    def status_key(self, worker: str) -> str:
        return f"{self.prefix}:status:{worker}"


# --- fields of P:meta and of the buckets ---------------------------------------------


def rank_field(rank: RankId) -> str:
    return f"r:{rank.dp_rank}:{rank.engine}"


def held_field(rank: RankId) -> str:
    """Ids allocated for the rank that its metadata does not hold yet."""
    return f"a:{rank.dp_rank}:{rank.engine}"


def fence_field(rank: RankId) -> str:
    """The rank's newest owner token, in ``P:meta`` and in every bucket."""
    return f"f:{rank.dp_rank}:{rank.engine}"


def parse_rank_field(name: bytes) -> RankId | None:
    if not name.startswith(b"r:"):
        return None
    dp, engine = name[2:].decode().split(":", 1)
    return RankId(engine, int(dp))


# --- rank metadata ---------------------------------------------------------------------


class TierId(msgspec.Struct, array_like=True, frozen=True, gc=False):
    medium: str
    ownership: str | None
    group: int
    tid: int
    locality: str | None = None

    @property
    def tier(self) -> Tier:
        return Tier(self.medium, self.ownership, self.group)


class Pending(msgspec.Struct, array_like=True, frozen=True):
    """Ids reserved for the batch ``(epoch, seq)``, by what they are for."""

    epoch: int
    seq: int
    ids: dict[str, int]


class RankMeta(msgspec.Struct, array_like=True, frozen=True):
    """Everything about one rank except its counts: one field of ``P:meta``."""

    rid: int
    epoch: int = 0
    seq: int | None = None
    ts: float | None = None
    gens: dict[str, int] = {}
    tiers: list[TierId] = []
    kinds: dict[int, str | None] = {}
    chunk: int | None = None
    pending: Pending | None = None

    def reserved(self, seq: int) -> dict[str, int]:
        p = self.pending
        return p.ids if p is not None and (p.epoch, p.seq) == (self.epoch, seq) else {}

    def live_ids(self) -> Iterator[int]:
        yield self.rid
        yield from self.gens.values()
        yield from (t.tid for t in self.tiers)
        if self.pending is not None:
            yield from self.pending.ids.values()


encode = msgspec.msgpack.Encoder().encode
decode_meta = msgspec.msgpack.Decoder(RankMeta).decode


def parse_metas(meta_hash: Mapping[bytes, bytes]) -> dict[RankId, RankMeta]:
    """Every rank's metadata from the fields of ``P:meta``."""
    return {
        rank: decode_meta(blob)
        for name, blob in meta_hash.items()
        if (rank := parse_rank_field(name)) is not None
    }
