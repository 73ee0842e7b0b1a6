"""The Redis store: one index shared by many API replicas, surviving restarts.

This module is its fenced write path; the key layout is
:mod:`~indexer.stores.redis.layout`'s, reads are :mod:`~indexer.stores.redis.reads`,
noticing lost data :mod:`~indexer.stores.redis.losses`, garbage
:mod:`~indexer.stores.redis.sweeper`, and every command goes through the
one gateway, :mod:`~indexer.stores.redis.client`.

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
owner's own copy then skips per bucket, as after a crash. A claim holds
within one incarnation of the data: once this store notices a loss, writes
under the tokens claimed through it before are refused too (the fence tokens
may have gone with the data, and the next claims restart below them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import msgspec

from indexer.core.events import RankId
from indexer.core.residency import Op
from indexer.stores.base import ApplyResult, Fenced, Loss, StoreLost, Watermark
from indexer.stores.redis import plan as planning
from indexer.stores.redis.client import RedisClient
from indexer.stores.redis.coalescer import Coalescer
from indexer.stores.redis.config import RedisConfig
from indexer.stores.redis.layout import (
    Pending,
    RankMeta,
    encode,
    fence_field,
    held_field,
    rank_field,
)
from indexer.stores.redis.losses import LOST
from indexer.stores.redis.plan import Plan, bucket_writes, plan_writes
from indexer.stores.redis.reads import RedisReads
from indexer.stores.redis.scripts import (
    APPLY_OPS,
    CLAIM,
    COMPARE_AND_SET,
    RAISE_FENCE,
    RESERVE_IDS,
)
from indexer.stores.redis.sweeper import Sweeper, sweep

#: Compare-and-set attempts before giving up on a contended rank.
MAX_ATTEMPTS = 16
#: What the apply script answers when a bucket holds a newer owner's token.
FENCED = -2


def _guard(rank: RankId, fence: int | None) -> dict[str, bytes]:
    """What a write under claim token ``fence`` expects of ``P:meta`` (nothing if unfenced)."""
    return {} if fence is None else {fence_field(rank): str(fence).encode()}


class RedisStore(RedisReads):
    """Implements :class:`indexer.stores.Store` on Redis or Redis Cluster.

    ``client``: the gateway to write through (default: one of its own, from
    ``config``); the cluster layer of the same process shares it.
    """

    def __init__(self, config: RedisConfig, client: RedisClient | None = None) -> None:
        super().__init__(client if client is not None else RedisClient(config))
        self.config = config
        self._committed: dict[RankId, int] = {}  # highest seq committed here, per rank
        self._claims: dict[RankId, tuple[int, int]] = {}  # token claimed here, losses then
        self._losses.listen(lambda loss: self._cache.clear())
        self._sweeper = Sweeper(self.client, config.sweep_interval)
        # APPLY_OPS calls without a commit (they may run twice); _run is looked up per
        # call, so a wrapper put on it later (fault injection in tests) sees them too
        self._bucket_calls = Coalescer(lambda commands: self._run(commands))

    # --- writing ------------------------------------------------------------

    async def apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], *, fence: int | None = None
    ) -> ApplyResult:
        """:meth:`Store.apply`; ``fence``: the writer's claim token, see the module doc.

        Raises :class:`StoreLost` when the store lost data the caller may have
        built on (the rank's stored watermark is below the last one committed
        here, or a script found an anchor that lost data); a fenced writer gets
        :class:`Fenced` instead, as for any write under a token claimed before a
        loss this store noticed.
        """
        with self._voided(rank, fence):
            return await self._apply(rank, seq, ts, ops, fence)

    async def _apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], fence: int | None
    ) -> ApplyResult:
        name, guard = rank_field(rank), _guard(rank, fence)
        since = self.losses
        for _ in range(MAX_ATTEMPTS):
            blob, meta = self._cache.get(rank) or await self._read_meta(rank)
            if self._lost_since(rank, meta, since):
                raise await self._losses.lost(since)
            if meta is not None and meta.seq is not None and seq <= meta.seq:
                return ApplyResult(applied=False)
            plan = plan_writes(meta or RankMeta(rid=0), ops, seq, ts)
            if plan.missing or meta is None:
                done = await self._reserve(rank, blob, meta, plan.missing, seq, guard)
            else:
                new_blob = encode(plan.meta)
                commit = (name, blob, new_blob)
                done = await self._apply_and_commit(meta, plan, seq, commit, guard)
                if done:
                    self._cache[rank] = (new_blob, plan.meta)
                    self._committed[rank] = seq
                    self._sweeper.start()
                    return ApplyResult(applied=True, block_ops=plan.block_ops)
                self._cache.pop(rank, None)
            if not done:
                await self._check_fence(rank, fence)
        raise RuntimeError(f"{rank}: metadata kept changing under {MAX_ATTEMPTS} attempts")

    @contextlib.contextmanager
    def _voided(self, rank: RankId, fence: int | None) -> Iterator[None]:
        """A fenced write: refused (:class:`Fenced`) if its token was claimed here before
        a loss this store noticed since, or if the write finds a loss."""
        if fence is None:
            yield
            return
        claimed = self._claims.get(rank)
        if claimed is not None and claimed[0] == fence and claimed[1] != self.losses:
            raise Fenced(f"the store lost data since token {fence} was claimed")
        try:
            yield
        except StoreLost as e:
            raise Fenced(f"the store lost data since token {fence} was claimed: {e}") from e

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
        (newest,) = await self._run([("HGET", self.layout.meta_key, fence_field(rank))])
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
        count, name, held = len(missing) + (meta is None), rank_field(rank), held_field(rank)
        reserve = self.client.script(RESERVE_IDS, [self.layout.meta_key], (held, count))
        (last,) = await self._run([reserve])
        ids = iter(range(last - count + 1, last + 1))
        if meta is None:
            meta = RankMeta(rid=next(ids))
        reserved = {**meta.reserved(seq), **dict(zip(missing, ids, strict=True))}
        updated = msgspec.structs.replace(meta, pending=Pending(meta.epoch, seq, reserved))
        new_blob = encode(updated)
        expect = {name: blob, held: f"{last - count + 1}:{last}".encode(), **guard}
        if await self._cas(expect, {name: new_blob, held: b""}):
            self._cache[rank] = (new_blob, updated)
            return True
        return False

    async def _apply_and_commit(
        self,
        meta: RankMeta,
        plan: Plan,
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
        writes = bucket_writes(plan)
        mark, tiers_blob = f"{meta.epoch}:{seq}", encode(writes.tiers)
        fence = next(iter(guard.items()), ("", ""))
        calls = planning.script_calls(writes.sizes, self.config.cluster)
        one_step = len(calls) == 1 and not self.config.cluster
        losses = self._losses
        since, identity = self.losses, losses.identity or await losses.known_identity()
        commands, anchors = [], []
        for group in calls:
            keys = [self.layout.encoded_bucket_keys[b] for b in group]
            # One server holds every anchor and loses them together: P:meta's stands for all.
            anchors.append([-1] * len(group) + [0] if one_step else [1 + b for b in group])
            floors = encode([losses.floors[a] if a >= 0 else -1 for a in anchors[-1]])
            sections_blob = encode([writes.sections[b] for b in group])
            args = [mark, meta.rid, tiers_blob, sections_blob, identity, floors, *fence]
            if one_step:
                keys.append(self.layout.meta_key)
                args += commit
            commands.append(self.client.script(APPLY_OPS, keys, args))
        run = self._run if one_step else self._bucket_calls.execute
        sizes = [sum(writes.sizes[b] for b in group) for group in calls]
        results = []
        for trip in planning.round_trips(sizes):
            results += await run(commands[trip.start : trip.stop])
        codes = [result[0] for result in results]
        if LOST in codes:
            raise await losses.lost(since)
        for written, counters in zip(anchors, results, strict=True):
            for a, count in zip(written, counters[1:], strict=False):
                if a >= 0:
                    losses.saw(a, count)
        if FENCED in codes:
            raise Fenced(f"{name}: a newer owner's token is in a bucket")
        if one_step:
            return codes[0] >= 0
        return await self._cas({name: old, **guard}, {name: new})

    async def _cas(self, expect: Mapping[str, bytes], store: Mapping[str, bytes]) -> bool:
        losses = self._losses
        since, identity = self.losses, losses.identity or await losses.known_identity()
        args = [identity, losses.floors[0], len(expect)]
        for pairs in (expect, store):
            for name, value in pairs.items():
                args += (name, value)
        (ok,) = await self._run([self.client.script(COMPARE_AND_SET, [self.layout.meta_key], args)])
        if ok == LOST:
            raise await losses.lost(since)
        losses.saw(0, ok)
        return ok > 0

    async def watermark(self, rank: RankId) -> Watermark | None:
        """:meth:`Store.watermark`: also where this process accepts it as the rank's
        baseline, so a consumer resuming after a loss may write from there. Every
        consumer reads it first: the store's identity is known, and watched, from
        then on, even while no batch is written."""
        await self._losses.known_identity()
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

        with self._voided(rank, fence):
            await self._update(rank, cleared, fence)

    async def forget(self, rank: RankId) -> None:
        await self._update(rank, lambda meta: None)

    async def _update(
        self,
        rank: RankId,
        change: Callable[[RankMeta], RankMeta | None],
        fence: int | None = None,
    ) -> None:
        """Compare-and-set a rank's metadata to ``change(meta)`` (None deletes it)."""
        name, guard = rank_field(rank), _guard(rank, fence)
        for _ in range(MAX_ATTEMPTS):
            blob, meta = await self._read_meta(rank)
            if meta is None:
                return
            updated = change(meta)
            if updated is None:
                store = {name: b"", held_field(rank): b""}
            else:
                store = {name: encode(updated)}
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

    async def claim(self, rank: RankId, owner: bytes) -> int | None:
        """:meth:`Store.claim`: the rank's next fence token, None if the engine is gone.

        ``owner``: the engine's registry entry as the claimant read it; the
        claim fails if the engine was deregistered or re-registered since.
        Writes under older tokens are refused from here on (module doc).
        """
        await self._losses.known_identity()
        since, fence, layout = self.losses, fence_field(rank), self.layout
        keys = [layout.registry_key, layout.meta_key]
        (token,) = await self._run([self.client.script(CLAIM, keys, [rank.engine, owner, fence])])
        if not token:
            return None
        buckets = layout.bucket_keys
        groups = [[key] for key in buckets] if self.config.cluster else [buckets]
        await self._run([self.client.script(RAISE_FENCE, g, [fence, token]) for g in groups])
        self._cache.pop(rank, None)
        self._claims[rank] = (token, since)
        return token

    # --- losing data (indexer.stores.redis.losses) ------------------------------

    @property
    def losses(self) -> int:
        """How many losses of data this store has noticed since it was opened."""
        return self._losses.count

    def last_loss(self) -> Loss | None:
        return self._losses.loss

    def on_loss(self, listener: Callable[[Loss], None]) -> None:
        self._losses.listen(listener)

    def watch(self) -> None:
        """Look for lost data every ``identity_check`` seconds from now on, for a process
        that reads but may never write (an API replica): its prefix matches then
        know what ``P:meta`` must hold (:meth:`~indexer.stores.redis.losses.LossWatch.vouch`)."""
        self._losses.watch()

    async def check(self, suspect: str | None = None) -> None:
        """Look for lost data now (:meth:`~indexer.stores.redis.losses.LossWatch.check`)."""
        await self._losses.check(suspect)

    # --- garbage, closing ---------------------------------------------------------

    async def sweep(self, scan_count: int = 500) -> int:
        """Delete fields no reader can see any more; returns how many
        (:func:`~indexer.stores.redis.sweeper.sweep`)."""
        return await sweep(self.client, scan_count)

    async def close(self) -> None:
        await self._sweeper.close()
        await self._losses.close()
        await self.client.close()
