"""The Redis store: one index shared by many API replicas, surviving restarts.

Key layout under a prefix ``P`` (several indexes can share one Redis)::

    P:meta           hash: "r:<dp>:<engine>" -> RankMeta (msgpack): watermark, ids,
                     group kinds, chunk size; "#ids" -> last id allocated;
                     "a:<dp>:<engine>" -> "first:last", ids allocated, not yet taken;
                     "f:<dp>:<engine>" -> the rank's fence: its newest owner's token
    {P:meta}:engines hash in P:meta's slot: engine name -> EngineSpec (JSON),
                     "#version" -> change counter (:mod:`indexer.cluster.registry`)
    P:{tag}          bucket hash: "g<gid>" -> "epoch:seq:n", "u<rid>" -> unknown removals,
                     "f:<dp>:<engine>" -> the newest owner's token the bucket has seen
    P:{tag}:<hash>   block hash: "<tid>" -> count, one field per residency

P:meta and every bucket are the store's *anchors*: each holds ``#store``, the
store's identity, and ``#w``, its write counter; buckets also hold ``#top``,
the highest id their fields are named after (see "Losing data" below).

A block's key carries the hash tag of its bucket (``hash % BUCKETS``), so a
bucket and its blocks share one cluster slot. Ids come from one counter and
are never reused: ``rid`` names a rank, ``gid`` a generation of one medium of a
rank, ``tid`` a tier (medium, ownership, group) within a generation. Readers
take a rank's live tids from ``P:meta`` and ignore every other field.

Clearing a medium drops its generation from the rank's metadata: readers stop
seeing its fields at once (O(1)), new stores start a new generation, and the
sweeper deletes the dead fields later. An ``AllBlocksCleared`` inside a batch
does the same at the commit; the stores after it already go to the new
generation, whose ids are reserved (``pending``) before any block is written.

Exactly once: a script applies a bucket's share of a batch atomically and
records ``epoch:seq`` per generation in the bucket; a re-delivered batch
(crash part-way, or a second indexer racing) skips the buckets that already
ran it. The watermark then moves by compare-and-set of the rank's metadata,
which fails if anything changed it meanwhile. On a standalone server a batch
usually fits one script call, which checks and moves the watermark itself:
one round trip, applied atomically. ``epoch`` grows when the engine restarts
(``reset_seq``), so its new seqs from 0 are never mistaken for old ones.

Fencing, for indexer workers that hand ranks over (:mod:`indexer.cluster.workers`):
a new owner first :meth:`RedisStore.claim` s the rank, which increments its
fence token in ``P:meta`` (only while the engine is registered: the registry
shares the slot) and raises every bucket's copy of it. Writes made under a
token (``fence=``) are refused with :class:`~indexer.stores.base.Fenced`
where a newer one is recorded: the watermark compare-and-set expects the
token in ``P:meta``, each bucket script checks its bucket's copy. Every
check is within one slot. A stale owner can therefore still land at most the
buckets of the one batch it had in flight when the claim happened — the
batch right after the watermark the new owner starts from, which the new
owner's own copy then skips per bucket, as after a crash.

Losing data. Redis can lose acknowledged writes: a flush, a restart without
persistence, a restart from an older RDB snapshot or an AOF missing its last
second, a failover to a replica that had not received them. Answers built on
such a store are silently wrong, so every process checks for it:

- The identity is a random id written once (``SET NX`` semantics) into
  every anchor. An anchor without it, or with another one, lost its data or
  belongs to another store. One identity per anchor, not one key, because on
  a cluster each master loses data on its own: the sixteen buckets' hash
  tags spread them over every master, so a master that lost its data always
  lost some bucket's identity, whatever slots it serves.
- ``#w`` rises with every write to its anchor (scripts return it) and each
  process keeps the highest value it saw. An anchor whose counter is below
  it came back with older data. A process notices only the loss of its own
  writes this way, which is what matters to it: another process's writes
  are noticed by that process.
- Every write script checks both before writing (atomically, in its slot) and
  answers -3 instead (a batch applied in one call on a standalone server
  checks P:meta's alone: one server loses or rolls back every anchor
  together); the process also reads the anchors every
  ``identity_check`` seconds, so a loss is noticed within about a second even
  when nothing is written. The apply path also refuses a rank whose stored
  watermark is below the last one this process committed for it.

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
import contextlib
import hashlib
import logging
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

import msgspec
from redis import exceptions as rex
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from indexer.core.events import GPU, MEDIA, BlockHash, EventBatch, RankId
from indexer.core.hybrid import group_rules, hybrid_match, is_scored
from indexer.core.matching import PrefixMatch, chunk_end, leading_run, match_prefix
from indexer.core.residency import (
    ClearMedium,
    Op,
    RankResidency,
    Tier,
    TierOp,
    TierTable,
    plan_batch,
)
from indexer.periodic import repeat
from indexer.stores.base import (
    ApplyResult,
    Fenced,
    Loss,
    Residency,
    StoreLost,
    StoreUnavailable,
    Watermark,
)
from indexer.stores.redis.scripts import SCRIPTS

log = logging.getLogger("kvindex.redis")

#: Buckets per index: the unit of write atomicity and of cluster placement.
#: Part of the data format — an index written with one value cannot be read
#: with another.
BUCKETS = 16
#: Most block operations per script call on a standalone server (whole buckets
#: only), so that one huge batch does not block Redis for long.
OPS_PER_CALL = 4096
#: Blocks fetched by a prefix query's first round trip; later ones double.
FIRST_WINDOW = 128
#: Compare-and-set attempts before giving up on a contended rank.
MAX_ATTEMPTS = 16
#: What the apply script answers when a bucket holds a newer owner's token.
FENCED = -2
#: What a write script answers when its hash lost data (module doc, "Losing data").
LOST = -3
_UNAVAILABLE = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the index lives and how to talk to it.

    ``url``: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
    ``unix:///path.sock?db=0&password=...``. ``prefix``: of every key, so
    several indexes can share a Redis. ``cluster``: the URL names one node of
    a Redis Cluster. ``max_connections``: commands in flight at once (per
    node on a cluster); more wait. ``socket_timeout``/``connect_timeout`` in
    seconds. ``retries``: reconnect attempts per command, with exponential
    backoff, before :class:`StoreUnavailable` is raised (callers retry
    further): a pooled connection that Redis closed (a restart) is replaced
    on first use, so one restart costs no failed command. Timeouts are not
    retried: a hung Redis would only make every caller wait ``retries``
    times longer. ``health_check_interval``: seconds a pooled connection may
    sit idle before it is PINGed ahead of its next command.
    ``sweep_interval``: seconds between garbage sweeps run by a store that
    applies batches (None: never). ``identity_check``: seconds between a
    writing store's looks for lost data (module doc; None: only when a write
    finds it). The server must not evict keys (``maxmemory-policy
    noeviction``) and should persist (AOF) for the index to survive a Redis
    restart; without it, a restart is recovered only as far as the engines'
    replay buffers reach.
    """

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvindex"
    cluster: bool = False
    max_connections: int = 32
    socket_timeout: float = 5.0
    connect_timeout: float = 2.0
    retries: int = 2
    health_check_interval: float = 10.0
    sweep_interval: float | None = 300.0
    identity_check: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}*?[]\\"):
            raise ValueError(f"Redis key prefix: non-empty, none of {{}}*?[]\\ ({self.prefix!r})")
        check_redis_url(self.url)


def check_redis_url(url: str) -> None:
    """Raise ValueError for a URL redis-py would fail on late (another scheme) or
    read silently wrong (a db that is not a number is db 0 to it). The message
    shows no part of the URL that may hold a password."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        got = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(
            "Redis URL: expected redis://HOST:PORT/DB, rediss://... (TLS) or"
            f" unix:///PATH.sock, got {got}"
        )
    dbs = parse_qs(parts.query).get("db", [])
    if parts.scheme != "unix" and parts.path.strip("/"):
        dbs.append(unquote(parts.path.strip("/")))
    for db in dbs:
        if not db.isdigit():
            raise ValueError(f"Redis URL: db {db!r} is not a number (e.g. redis://HOST:6379/0)")


# --- rank metadata -------------------------------------------------------------


class _TierId(msgspec.Struct, array_like=True, frozen=True, gc=False):
    medium: str
    ownership: str | None
    group: int
    tid: int
    locality: str | None = None

    @property
    def tier(self) -> Tier:
        return Tier(self.medium, self.ownership, self.group)


class _Pending(msgspec.Struct, array_like=True, frozen=True):
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
    tiers: list[_TierId] = []
    kinds: dict[int, str | None] = {}
    chunk: int | None = None
    pending: _Pending | None = None

    def reserved(self, seq: int) -> dict[str, int]:
        p = self.pending
        return p.ids if p is not None and (p.epoch, p.seq) == (self.epoch, seq) else {}

    def live_ids(self) -> Iterator[int]:
        yield self.rid
        yield from self.gens.values()
        yield from (t.tid for t in self.tiers)
        if self.pending is not None:
            yield from self.pending.ids.values()


_encode = msgspec.msgpack.Encoder().encode
_new_op = tuple.__new__  # a TierOp without its Python-level __new__
_decode_meta = msgspec.msgpack.Decoder(RankMeta).decode


def _rank_field(rank: RankId) -> str:
    return f"r:{rank.dp_rank}:{rank.engine}"


def _held_field(rank: RankId) -> str:
    """Ids allocated for the rank that its metadata does not hold yet."""
    return f"a:{rank.dp_rank}:{rank.engine}"


def _fence_field(rank: RankId) -> str:
    """The rank's newest owner token, in ``P:meta`` and in every bucket."""
    return f"f:{rank.dp_rank}:{rank.engine}"


def _guard(rank: RankId, fence: int | None) -> dict[str, bytes]:
    """What a write under lease token ``fence`` expects of ``P:meta`` (nothing if unfenced)."""
    return {} if fence is None else {_fence_field(rank): str(fence).encode()}


def _parse_rank_field(name: bytes) -> RankId | None:
    if not name.startswith(b"r:"):
        return None
    dp, engine = name[2:].decode().split(":", 1)
    return RankId(engine, int(dp))


def _parse_metas(meta_hash: Mapping[bytes, bytes]) -> dict[RankId, RankMeta]:
    """Every rank's metadata from the fields of ``P:meta``."""
    return {
        rank: _decode_meta(blob)
        for name, blob in meta_hash.items()
        if (rank := _parse_rank_field(name)) is not None
    }


# --- planning a batch ------------------------------------------------------------


@dataclass
class _Plan:
    """One batch resolved against a rank's metadata: what to write, what it leads to.

    ``writes``: ``(tid, gid, delta, hashes)`` in event order. ``missing``: ids
    the batch needs that are not reserved yet. ``members``: every tid of each
    generation, for counting distinct hashes across a medium's tiers.
    """

    meta: RankMeta
    writes: list[tuple[int, int, int, Sequence[BlockHash]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    members: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    block_ops: int = 0


def plan_writes(meta: RankMeta, ops: Iterable[Op], seq: int, ts: float) -> _Plan:
    """Resolve a batch's operations to ids and compute the rank's metadata after it.

    What a batch teaches (group kinds, chunk size, tier locality) comes from
    replaying its operations, without hashes, on the model's own
    :class:`RankResidency`. Ids are named by purpose so that a re-delivered
    batch finds the ids its first attempt reserved: a new generation by its
    medium and the medium's clears so far in the batch, a new tier by its
    generation's id or, if that is new too, the generation's purpose.
    """
    reserved = meta.reserved(seq)
    plan = _Plan(meta)
    generation = {medium: str(gid) for medium, gid in meta.gens.items()}

    def take(*purpose: object) -> tuple[int, str]:
        name = msgspec.json.encode(purpose).decode()
        if name not in reserved:
            plan.missing.append(name)
            return -len(plan.missing), name
        return reserved[name], name

    gens = dict(meta.gens)
    tids = {t.tier: t.tid for t in meta.tiers}
    for tier, tid in tids.items():
        plan.members[gens[tier.medium]].append(tid)
    scratch = RankResidency(
        tables={t.tier: TierTable(locality=t.locality) for t in meta.tiers},
        group_kinds=dict(meta.kinds),
        chunk_blocks=meta.chunk,
    )
    clears: Counter[str] = Counter()
    taught: list[Op] = []  # the operations without their hashes, replayed once at the end
    for op in ops:
        if type(op) is ClearMedium:
            taught.append(op)
            clears[op.medium] += 1
            gens.pop(op.medium, None)
            tids = {t: i for t, i in tids.items() if t.medium != op.medium}
            continue
        tier, delta, hashes = op[:3]
        taught.append(_new_op(TierOp, (tier, delta, (), *op[3:])))
        medium = tier.medium
        if medium not in gens:
            gens[medium], generation[medium] = take("gen", medium, clears[medium])
        tid = tids.get(tier)
        if tid is None:
            tid = tids[tier] = take("tier", *tier, generation[medium])[0]
            plan.members[gens[medium]].append(tid)
        plan.writes.append((tid, gens[medium], delta, hashes))
        plan.block_ops += len(hashes)
    scratch.apply(taught)
    plan.meta = RankMeta(
        meta.rid,
        meta.epoch,
        seq,
        ts,
        gens,
        [_TierId(*t, tids[t], table.locality) for t, table in scratch.tables.items()],
        scratch.group_kinds,
        scratch.chunk_blocks,
    )
    return plan


class _Anchor(msgspec.Struct, frozen=True):
    """What one anchor hash holds of the store's identity (module doc, "Losing data")."""

    identity: str | None
    writes: int
    top: int

    @classmethod
    def parse(cls, reply: Sequence[bytes | None]) -> _Anchor:
        identity, writes, top = reply
        return cls(identity and identity.decode(), int(writes or 0), int(top or 0))


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


#: ``h & _LOW == h % BUCKETS`` for every int, BUCKETS being a power of two.
_LOW = BUCKETS - 1
if BUCKETS & _LOW:
    raise ImportError("BUCKETS must be a power of two")


def bucket_of(block_hash: BlockHash) -> int:
    if type(block_hash) is int:
        return block_hash % BUCKETS
    return int.from_bytes(block_hash[-8:], "big") % BUCKETS


def _name(block_hash: BlockHash) -> str:
    """A block hash as the last part of its key: decimal, or ``x`` and hex for bytes."""
    return str(block_hash) if type(block_hash) is int else f"x{block_hash.hex()}"


class RedisStore:
    """Implements :class:`indexer.stores.Store` on Redis or Redis Cluster."""

    def __init__(self, config: RedisConfig, client: Redis | RedisCluster | None = None) -> None:
        self.config = config
        self._client = client if client is not None else _connect(config)
        self._where = _redacted(config.url)
        self._meta_key = f"{config.prefix}:meta"
        #: The engine registry's hash: in the metadata's slot, so a claim can check it.
        self.registry_key = f"{{{self._meta_key}}}:engines"
        self._bucket_keys = [f"{config.prefix}:{{{tag}}}" for tag in _TAGS]
        self._encoded_bucket_keys = [key.encode() for key in self._bucket_keys]  # spares redis-py
        self._block_prefixes = [f"{key}:" for key in self._bucket_keys]
        self._shas = {name: _sha(src) for name, src in SCRIPTS.items()}
        self._cache: dict[RankId, tuple[bytes, RankMeta]] = {}
        self._sweeper: asyncio.Task | None = None
        # What this process knows of the store's identity (module doc, "Losing data").
        self._anchor_keys = [self._meta_key, *self._bucket_keys]
        self._identity: str | None = None
        self._floors = [0] * len(self._anchor_keys)  # highest "#w" seen, per anchor
        self._committed: dict[RankId, int] = {}  # highest seq committed here, per rank
        self._loss: Loss | None = None
        self._loss_listeners: list[Callable[[Loss], None]] = []
        self._checking = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        # redis-py fails a command when its pool is exhausted: wait for a connection instead.
        self._connections = asyncio.Semaphore(config.max_connections)

    # --- keys -------------------------------------------------------------

    @property
    def meta_key(self) -> str:
        """``P:meta``: what scripts sharing its slot (the registry's) name with it."""
        return self._meta_key

    def block_key(self, block_hash: BlockHash) -> str:
        return f"{self._block_prefixes[bucket_of(block_hash)]}{_name(block_hash)}"

    # --- plumbing -----------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn "Redis is down or failing" into :class:`StoreUnavailable`."""
        try:
            yield
        except _UNAVAILABLE as e:
            self._cache.clear()
            raise StoreUnavailable(f"Redis at {self._where} unavailable: {e}") from e

    async def execute(self, commands: Sequence[tuple]) -> list:
        """Send commands in one pipeline; what the worker's leases and the registry use."""
        return await self._run(commands)

    async def _run(self, commands: Sequence[tuple]) -> list:
        """Send commands in one pipeline (one round trip per node); load scripts once."""
        for attempt in (1, 2):
            async with self._connections:  # loading scripts takes a connection too
                try:
                    return await self._send(commands)
                except rex.NoScriptError:
                    if attempt == 2:
                        raise
                    await self._load_scripts()
        raise AssertionError("unreachable")

    async def _send(self, commands: Sequence[tuple]) -> list:
        with self._guard():
            if len(commands) == 1:  # a pipeline costs more client time
                return [await self._client.execute_command(*commands[0])]
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def _load_scripts(self) -> None:
        with self._guard():
            for source in SCRIPTS.values():
                await self._client.script_load(source)

    def script(self, name: str, keys: Sequence[str], args: Sequence[object]) -> tuple:
        """The command that runs one of :data:`SCRIPTS` (for :meth:`execute`)."""
        return ("EVALSHA", self._shas[name], len(keys), *keys, *args)

    async def _cas(self, expect: Mapping[str, bytes], store: Mapping[str, bytes]) -> bool:
        since, identity = self.losses, self._identity or await self._known_identity()
        args = [identity, self._floors[0], len(expect)]
        for pairs in (expect, store):
            for name, value in pairs.items():
                args += (name, value)
        (ok,) = await self._run([self.script("compare_and_set", [self._meta_key], args)])
        if ok == LOST:
            raise await self._lost(since)
        self._floors[0] = max(self._floors[0], ok)
        return ok > 0

    async def _read_meta(self, rank: RankId) -> tuple[bytes, RankMeta | None]:
        (blob,) = await self._run([("HGET", self._meta_key, _rank_field(rank))])
        if blob is None:
            self._cache.pop(rank, None)
            return b"", None
        self._cache[rank] = (blob, meta := _decode_meta(blob))
        return blob, meta

    # --- writing ------------------------------------------------------------

    async def apply_batch(
        self, rank: RankId, seq: int, batch: EventBatch, *, fence: int | None = None
    ) -> ApplyResult:
        """:meth:`Store.apply_batch`; ``fence``: the writer's lease token, see the module doc.

        Raises :class:`StoreLost` when the store lost data the caller may have
        built on (the rank's stored watermark is below the last one committed
        here, or a script found an anchor that lost data).
        """
        ops = plan_batch(batch)
        name, guard = _rank_field(rank), _guard(rank, fence)
        since = self.losses
        for _ in range(MAX_ATTEMPTS):
            blob, meta = self._cache.get(rank) or await self._read_meta(rank)
            if self._lost_since(rank, meta, since):
                raise await self._lost(since)
            if meta is not None and meta.seq is not None and seq <= meta.seq:
                return ApplyResult(applied=False)
            plan = plan_writes(meta or RankMeta(rid=0), ops, seq, batch.ts)
            if plan.missing or meta is None:
                done = await self._reserve(rank, blob, meta, plan.missing, seq, guard)
            else:
                new_blob = _encode(plan.meta)
                commit = (name, blob, new_blob)
                done = await self._apply_and_commit(meta, plan, seq, commit, guard)
                if done:
                    self._cache[rank] = (new_blob, plan.meta)
                    self._committed[rank] = seq
                    self._start_sweeper()
                    return ApplyResult(applied=True, block_ops=plan.block_ops)
                self._cache.pop(rank, None)
            if not done:
                await self._check_fence(rank, fence)
        raise RuntimeError(f"{rank}: metadata kept changing under {MAX_ATTEMPTS} attempts")

    def _lost_since(self, rank: RankId, meta: RankMeta | None, since: int) -> bool:
        """Whether the rank's stored watermark is below what this process committed,
        or a loss was noticed since the caller started."""
        committed = self._committed.get(rank)
        if committed is None:
            return since != self.losses
        stored = -1 if meta is None or meta.seq is None else meta.seq
        return stored < committed or since != self.losses

    async def _check_fence(self, rank: RankId, fence: int | None) -> None:
        """After a failed compare-and-set: raise :class:`Fenced` if another owner claimed."""
        if fence is None:
            return
        (newest,) = await self._run([("HGET", self._meta_key, _fence_field(rank))])
        if int(newest or 0) != fence:
            self._cache.pop(rank, None)
            raise Fenced(f"{rank.engine}/{rank.dp_rank}: token {fence}, rank at {int(newest or 0)}")

    async def _reserve(
        self,
        rank: RankId,
        blob: bytes,
        meta: RankMeta | None,
        missing: list[str],
        seq: int,
        guard: Mapping[str, bytes],
    ) -> bool:
        """Allocate the ids a batch needs (and the rank's own id) before writing with them."""
        self._cache.pop(rank, None)
        count, name, held = len(missing) + (meta is None), _rank_field(rank), _held_field(rank)
        (last,) = await self._run([self.script("reserve_ids", [self._meta_key], (held, count))])
        ids = iter(range(last - count + 1, last + 1))
        if meta is None:
            meta = RankMeta(rid=next(ids))
        reserved = {**meta.reserved(seq), **dict(zip(missing, ids, strict=True))}
        updated = msgspec.structs.replace(meta, pending=_Pending(meta.epoch, seq, reserved))
        new_blob = _encode(updated)
        expect = {name: blob, held: f"{last - count + 1}:{last}".encode(), **guard}
        if await self._cas(expect, {name: new_blob, held: b""}):
            self._cache[rank] = (new_blob, updated)
            return True
        return False

    async def _apply_and_commit(
        self,
        meta: RankMeta,
        plan: _Plan,
        seq: int,
        commit: tuple[str, bytes, bytes],
        guard: Mapping[str, bytes],
    ) -> bool:
        """Apply the block operations, then move the watermark; False: metadata changed.

        Bucket by bucket, in as few script calls as allowed. When one call
        holds the whole batch (standalone server), it commits too: one round
        trip, and the batch is applied atomically. Otherwise the commit is a
        compare-and-set once every bucket is done.
        """
        name, old, new = commit
        if not plan.block_ops:
            return await self._cas({name: old, **guard}, {name: new})
        tiers: list[list] = []
        tier_index: dict[int, int] = {}
        # Per bucket, one flat list in event order: a marker (+t or -t: tier t, delta +1 or
        # -1) whenever the operation changes for that bucket, then hash names.
        sections: list[list] = [[] for _ in range(BUCKETS)]
        appends = [section.append for section in sections]
        last = [0] * BUCKETS
        markers = [0] * BUCKETS
        for tid, gid, delta, hashes in plan.writes:
            t = tier_index.get(tid)
            if t is None:
                siblings = [str(m) for m in plan.members[gid] if m != tid]
                tiers.append([str(tid), gid, *siblings])
                t = tier_index[tid] = len(tiers)
            marker = t if delta > 0 else -t
            try:  # block hashes are ints, except in rare deployments: one pass in C first
                buckets = [h & _LOW for h in hashes]
            except TypeError:
                buckets = list(map(bucket_of, hashes))
                names = map(_name, hashes)
            else:
                names = map(str, hashes)
            for b, n in zip(buckets, names, strict=True):
                if last[b] != marker:
                    last[b] = marker
                    markers[b] += 1
                    appends[b](marker)
                appends[b](n)
        sizes = {b: len(sec) - markers[b] for b, sec in enumerate(sections) if sec}
        mark, tiers_blob = f"{meta.epoch}:{seq}", _encode(tiers)
        fence = next(iter(guard.items()), ("", ""))
        calls = self._calls(sizes)
        one_step = len(calls) == 1 and not self.config.cluster
        since, identity = self.losses, self._identity or await self._known_identity()
        commands, anchors = [], []
        for group in calls:
            keys = [self._encoded_bucket_keys[b] for b in group]
            # One server holds every anchor and loses them together: P:meta's stands for all.
            anchors.append([-1] * len(group) + [0] if one_step else [1 + b for b in group])
            floors = _encode([self._floors[a] if a >= 0 else -1 for a in anchors[-1]])
            sections_blob = _encode([sections[b] for b in group])
            args = [mark, meta.rid, tiers_blob, sections_blob, identity, floors, *fence]
            if one_step:
                keys.append(self._meta_key)
                args += commit
            commands.append(self.script("apply_ops", keys, args))
        results = await self._run(commands)
        codes = [result[0] for result in results]
        if LOST in codes:
            raise await self._lost(since)
        for written, counters in zip(anchors, results, strict=True):
            for a, count in zip(written, counters[1:], strict=False):
                if a >= 0:
                    self._floors[a] = max(self._floors[a], count)
        if FENCED in codes:
            raise Fenced(f"{name}: a newer owner's token is in a bucket")
        if one_step:
            return codes[0] >= 0
        return await self._cas({name: old, **guard}, {name: new})

    def _calls(self, sizes: dict[int, int]) -> list[list[int]]:
        """Buckets per script call: one per call on a cluster (one slot each).

        ``sizes``: block operations per bucket that has any.
        """
        if self.config.cluster:
            return [[b] for b in sizes]
        calls: list[list[int]] = [[]]
        size = 0
        for b, ops in sizes.items():
            if calls[-1] and size + ops > OPS_PER_CALL:
                calls.append([])
                size = 0
            calls[-1].append(b)
            size += ops
        return calls

    async def watermark(self, rank: RankId) -> Watermark | None:
        """:meth:`Store.watermark`: also where this process accepts it as the rank's
        baseline, so a consumer resuming after a loss may write from there."""
        _, meta = await self._read_meta(rank)
        if meta is None or meta.seq is None:
            self._committed.pop(rank, None)
            return None
        self._committed[rank] = meta.seq
        return Watermark(meta.seq, meta.ts)

    async def clear(
        self,
        rank: RankId,
        media: Collection[str],
        *,
        reset_seq: bool = False,
        fence: int | None = None,
    ) -> None:
        def cleared(meta: RankMeta) -> RankMeta:
            changes: dict = {
                "gens": {m: g for m, g in meta.gens.items() if m not in media},
                "tiers": [t for t in meta.tiers if t.medium not in media],
            }
            if reset_seq:
                changes.update(seq=None, ts=None, epoch=meta.epoch + 1, pending=None)
            return msgspec.structs.replace(meta, **changes)

        await self._update(rank, cleared, fence)

    async def forget(self, rank: RankId) -> None:
        await self._update(rank, lambda meta: None)

    async def _update(self, rank: RankId, change, fence: int | None = None) -> None:
        """Compare-and-set a rank's metadata to ``change(meta)`` (None deletes it)."""
        name, guard = _rank_field(rank), _guard(rank, fence)
        for _ in range(MAX_ATTEMPTS):
            blob, meta = await self._read_meta(rank)
            if meta is None:
                return
            updated = change(meta)
            if updated is None:
                store = {name: b"", _held_field(rank): b""}
            else:
                store = {name: _encode(updated)}
            if await self._cas({name: blob, **guard}, store):
                if updated is None:
                    self._cache.pop(rank, None)
                else:
                    self._cache[rank] = (store[name], updated)
                if updated is None or updated.seq is None:
                    self._committed.pop(rank, None)
                return
            await self._check_fence(rank, fence)
        raise RuntimeError(f"{rank}: metadata kept changing under {MAX_ATTEMPTS} attempts")

    async def claim(self, rank: RankId, spec: bytes) -> int | None:
        """Become the rank's only writer: its next fence token, None if the engine is gone.

        ``spec``: the engine's registry entry as the claimant read it; the
        claim fails if the engine was deregistered or re-registered since.
        Writes under older tokens are refused from here on (module doc).
        """
        await self._known_identity()
        fence = _fence_field(rank)
        keys = [self.registry_key, self._meta_key]
        (token,) = await self._run([self.script("claim", keys, [rank.engine, spec, fence])])
        if not token:
            return None
        groups = (
            [[key] for key in self._bucket_keys] if self.config.cluster else [self._bucket_keys]
        )
        await self._run([self.script("raise_fence", keys, [fence, token]) for keys in groups])
        self._cache.pop(rank, None)
        return token

    # --- losing data (module doc) --------------------------------------------

    @property
    def losses(self) -> int:
        """How many losses of data this store has noticed since it was opened."""
        return self._loss.number if self._loss is not None else 0

    def last_loss(self) -> Loss | None:
        return self._loss

    def on_loss(self, listener: Callable[[Loss], None]) -> None:
        self._loss_listeners.append(listener)

    async def _known_identity(self) -> str:
        """The store's identity, looked up (or given) at first use; from then on the
        anchors are watched every ``identity_check`` seconds."""
        if self._identity is None:
            await self.check()
            if self._watch is None and self.config.identity_check:
                interval = self.config.identity_check
                watch = repeat(interval, self.check, "store identity check")
                self._watch = asyncio.get_running_loop().create_task(watch)
        assert self._identity is not None
        return self._identity

    async def _lost(self, since: int) -> StoreLost:
        """A write found lost data: the error to raise, once the loss is on record."""
        if self.losses == since:
            await self.check(suspect="a write found the store behind what it had written")
        return StoreLost(self._loss.reason if self._loss is not None else "the store lost data")

    async def check(self, suspect: str | None = None) -> None:
        """Compare the anchors with what this process knows of them; record a loss.

        ``suspect``: a write already found one; record it (as a roll-back, with
        that reason) even if the anchors now look whole.
        """
        async with self._checking:
            floors = list(self._floors)  # before the read: writes meanwhile only raise counters
            anchors = await self._read_anchors()
            known, found = self._identity, anchors[0].identity
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
                    self._record_loss(True, "another process found the store's data replaced")
            elif behind and self.config.cluster and behind != [0]:
                why = "a cluster node came back with older buckets"
                await self._replace_identity(found, anchors, why)
            elif behind or suspect:
                self._floors = [a.writes for a in anchors]
                self._record_loss(False, suspect or _ROLLED_BACK)
            else:
                seen = zip(self._floors, anchors, strict=True)
                self._floors = [max(floor, a.writes) for floor, a in seen]

    async def _read_anchors(self) -> list[_Anchor]:
        """P:meta's anchor, then the buckets'. Read the buckets first: identities go
        into P:meta before the buckets, so a bucket holding one P:meta lacks truly lost
        it (a cluster reads its masters one by one, not at one instant)."""
        fields = ("#store", "#w", "#top")
        buckets = await self._run([("HMGET", key, *fields) for key in self._bucket_keys])
        (meta,) = await self._run([("HMGET", self._meta_key, *fields)])
        return [_Anchor.parse(reply) for reply in (meta, *buckets)]

    async def _establish(self) -> str:
        """A fresh store's first identity (another process's, if it was first)."""
        args = [uuid.uuid4().hex]
        (identity,) = await self._run([self.script("establish_identity", [self._meta_key], args)])
        return identity.decode()

    async def _replace_identity(self, seen: str, anchors: Sequence[_Anchor], why: str) -> None:
        """Give the store a new identity: every rank starts again empty."""
        floor = max(a.top for a in anchors) + 1
        args = [seen, uuid.uuid4().hex, floor]
        (identity,) = await self._run([self.script("swap_identity", [self._meta_key], args)])
        await self._take_identity(identity.decode(), ())
        self._record_loss(True, f"{why}: {_WIPED}")

    async def _take_identity(self, identity: str, anchors: Sequence[_Anchor]) -> None:
        """Make ``identity`` this process's and every bucket's; start counting anew.

        ``anchors``: as just read (empty: read them again), to skip the buckets
        that hold it already.
        """
        keys = self._bucket_keys
        if anchors:
            keys = [k for k, a in zip(keys, anchors[1:], strict=True) if a.identity != identity]
        if keys or not anchors:
            await self._run([self.script("mark_bucket", [key], [identity]) for key in keys])
            anchors = await self._read_anchors()
        self._identity = identity
        self._floors = [a.writes for a in anchors]

    def _record_loss(self, wiped: bool, reason: str) -> None:
        self._loss = loss = Loss(self.losses + 1, wiped, reason)
        self._cache.clear()
        log.warning("store lost data", extra={"store": self._where, "wiped": wiped, "why": reason})
        for listener in self._loss_listeners:
            listener(loss)

    # --- reading ------------------------------------------------------------

    async def block_residency(self, block_hash: BlockHash) -> list[Residency]:
        reply, fields = await self._run(
            [("HGETALL", self._meta_key), ("HGETALL", self.block_key(block_hash))]
        )
        metas = _parse_metas(reply)
        where = {str(t.tid).encode(): (rank, t) for rank, meta in metas.items() for t in meta.tiers}
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
        keys = [self.block_key(h) for h in chain]
        window = min(len(chain), FIRST_WINDOW)
        reply, *blocks = await self._run(
            [("HGETALL", self._meta_key), *(("HGETALL", k) for k in keys[:window])]
        )
        metas = _parse_metas(reply)
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
        return {rank: m.match(chain, fetched) for rank, m in matchers.items()}

    async def block_counts(self, rank: RankId) -> dict[str, int]:
        _, meta = await self._read_meta(rank)
        gens = meta.gens if meta is not None else {}
        counts = dict.fromkeys(MEDIA, 0)
        if gens:
            fields = [f"g{gid}" for gid in gens.values()]
            replies = await self._run([("HMGET", key, *fields) for key in self._bucket_keys])
            for values in replies:
                for medium, value in zip(gens, values, strict=True):
                    if value is not None:
                        counts[medium] += int(value.rsplit(b":", 1)[1])
        return counts

    async def anomalies(self, rank: RankId) -> dict[str, int]:
        _, meta = await self._read_meta(rank)
        unknown = 0
        if meta is not None:
            field_ = f"u{meta.rid}"
            replies = await self._run([("HGET", key, field_) for key in self._bucket_keys])
            unknown = sum(int(v) for v in replies if v is not None)
        return {"unknown_removals": unknown}

    async def ranks(self) -> list[RankId]:
        (names,) = await self._run([("HKEYS", self._meta_key)])
        return sorted(r for r in map(_parse_rank_field, names) if r is not None)

    async def ping(self) -> None:
        await self._run([("PING",)])

    async def close(self) -> None:
        for task in (self._sweeper, self._watch):
            # Until it sticks: Python 3.11's wait_for (in redis-py's sends) can drop a cancel.
            while task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.05)
        await self._client.aclose()

    # --- garbage --------------------------------------------------------------

    async def sweep(self, scan_count: int = 500) -> int:
        """Delete fields no reader can see any more; returns how many.

        Dead: fields of cleared generations and forgotten ranks, and ids that
        were allocated but never taken (a crash between the two). Ids being
        allocated right now are recorded beside the counter, in the same hash,
        so one atomic read of it tells them apart.
        """
        (reply,) = await self._run([("HGETALL", self._meta_key)])
        top = int(reply.get(b"#ids", 0))
        live = {i for meta in _parse_metas(reply).values() for i in meta.live_ids()}
        for name, held in reply.items():
            if name.startswith(b"a:"):
                first, last = map(int, held.split(b":"))
                live.update(range(first, last + 1))

        def dead(name: bytes, skip: int = 0) -> bool:
            """Whether a field named after an id (after ``skip`` bytes) is of a dead id;
            other fields (fences, anchors) are never garbage."""
            digits = name[skip:]
            return digits.isdigit() and int(digits) <= top and int(digits) not in live

        removed = 0
        buckets = await self._run([("HGETALL", key) for key in self._bucket_keys])
        drops = [
            ("HDEL", key, *names)
            for key, fields in zip(self._bucket_keys, buckets, strict=True)
            if (names := [n for n in fields if dead(n, 1)])
        ]
        removed += sum(len(d) - 2 for d in drops)
        if drops:
            await self._run(drops)
        pattern = f"{self.config.prefix}:{{*}}:*"
        batch: list[bytes] = []
        with self._guard():
            async for key in self._client.scan_iter(match=pattern, count=scan_count):
                batch.append(key)
                if len(batch) >= scan_count:
                    removed += await self._sweep_blocks(batch, dead)
                    batch = []
        if batch:
            removed += await self._sweep_blocks(batch, dead)
        return removed

    async def _sweep_blocks(self, keys: list[bytes], dead) -> int:
        replies = await self._run([("HKEYS", k) for k in keys])
        drops = [
            ("HDEL", key, *names)
            for key, fields in zip(keys, replies, strict=True)
            if (names := [n for n in fields if dead(n)])
        ]
        if drops:
            await self._run(drops)
        return sum(len(d) - 2 for d in drops)

    def _start_sweeper(self) -> None:
        if self._sweeper is None and self.config.sweep_interval:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval)
            try:
                removed = await self.sweep()
            except StoreUnavailable as e:
                log.warning("sweep skipped", extra={"error": str(e)})
            except Exception:
                log.exception("sweep failed")
            else:
                log.info("swept", extra={"fields": removed})


_WIPED = "a flush, a restart without persistence or a failover to an empty replica"
_ROLLED_BACK = (
    "the store came back with older data: a restart from an older snapshot or"
    " AOF, or a failover to a replica that missed writes"
)


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

    def targets(self) -> Iterator[tuple[_TierId, set[BlockHash]]]:
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
        full = self.full_match(chain, fetched)
        if not self.rules:
            return full
        return hybrid_match(chain[:fetched], full, self.chunk_blocks, self.rules, self._group_sets)

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


def _redacted(url: str) -> str:
    """The URL without credentials, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def _connect(config: RedisConfig) -> Redis | RedisCluster:
    """The client: the asyncio flavour of redis-py's Retry (the synchronous one never
    awaits the command, so it retries nothing), on dropped connections only."""
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    options = {
        "max_connections": config.max_connections + 1,  # + the sweeper's SCAN
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "retry": Retry(backoff, config.retries, supported_errors=(rex.ConnectionError,)),
        "health_check_interval": config.health_check_interval,
    }
    if config.cluster:
        return RedisCluster.from_url(config.url, **options)
    return Redis.from_url(config.url, **options)


class OwnedRank:
    """A rank's store as its leaseholder writes it: every write under the lease's token.

    What a worker gives the rank's consumer instead of the store itself, so
    that the consumer stops (:class:`~indexer.stores.base.Fenced`) the moment
    a newer owner has claimed the rank.

    A claim holds within one incarnation of the store's data: once the store
    notices a loss (``losses`` moved on since the claim), every write raises
    Fenced too, and the worker claims the rank anew, so that no two owners can
    both write after fence tokens were lost with the data.
    """

    def __init__(self, store: RedisStore, token: int, losses: int | None = None) -> None:
        self.store = store
        self.token = token
        #: the store's losses when the claim was made (default: now)
        self.losses = store.losses if losses is None else losses

    def _check_incarnation(self) -> None:
        if self.store.losses != self.losses:
            raise Fenced(f"the store lost data since token {self.token} was claimed")

    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult:
        self._check_incarnation()
        try:
            return await self.store.apply_batch(rank, seq, batch, fence=self.token)
        except StoreLost as e:
            raise Fenced(f"the store lost data since token {self.token} was claimed: {e}") from e

    async def watermark(self, rank: RankId) -> Watermark | None:
        return await self.store.watermark(rank)

    async def clear(self, rank: RankId, media: Collection[str], *, reset_seq: bool = False) -> None:
        self._check_incarnation()
        await self.store.clear(rank, media, reset_seq=reset_seq, fence=self.token)

    def last_loss(self) -> Loss | None:
        """None: an owner does not resynchronise after a loss, it is fenced (above)."""
        return None
