"""One engine rank's live and replayed batches, applied in order, each seq once.

A :class:`RankConsumer` consumes one (engine, dp rank): a
:class:`~indexer.ingest.live_feed.LiveFeed` (SUB socket, reader, monitor), a
:class:`~indexer.ingest.replay_client.ReplayClient` to the engine's replay
ROUTER, a :class:`~indexer.ingest.snapshots.SnapshotFetch` where the engine
answers snapshots, and the loop that applies. The ordering rules (gaps,
replay, snapshots, duplicates, restarts, store losses) are the
:class:`~indexer.core.sequencer.Sequencer`'s: this shell feeds it what
happens and performs what it answers. Which ranks run is decided elsewhere:
``kvindex serve``'s :class:`~indexer.ingest.subscriber.Subscriber` runs every
registered rank, a :class:`~indexer.cluster.workers.Worker` those it leases.

Readers split frames into an intake bounded in batches and bytes, so the newest
received seq is known even while the store is slow (lag is that minus the
applied seq). A full intake stops the readers, ZMQ's high-water marks fill, the
publisher drops batches and the drops are replayed as gaps. A frame over
``max_message_bytes`` never reaches memory. Batches stay encoded until applied
(decoded, one takes six times the memory).

Store failures are retried with backoff and never skip a batch: a seq is
acknowledged (the watermark) only by the store applying it. Not retried:
:class:`~indexer.stores.base.Fenced` (another owner took the rank: nothing
more is applied, :attr:`RankConsumer.fenced`) and
:class:`~indexer.stores.base.StoreLost` (the sequencer resumes from the
store's watermark); a loss the store notices flags every rank at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import tenacity

from indexer import metrics
from indexer.core import sequencer as seq_rules
from indexer.core.events import GPU, MEDIA, EventBatch, RankId, WireError
from indexer.core.routed import GPU_CLEARED
from indexer.core.sequencer import Mark, Sequencer
from indexer.engine_registry import EngineSpec, Gap, RankStatus, blank_status
from indexer.ingest.capacity import Capacity, rank_bounds
from indexer.ingest.declared_groups import DeclaredGroups
from indexer.ingest.intake import END, HELD, LIVE, REPLAY, WAKE, Intake, Item
from indexer.ingest.live_feed import LiveFeed
from indexer.ingest.loss_watch import LossWatch
from indexer.ingest.replay_client import ReplayClient
from indexer.ingest.report import Report, status_now
from indexer.ingest.settings import Shared
from indexer.ingest.snapshots import Outcome, SnapshotFetch
from indexer.retrying import until_done
from indexer.stores.base import Fenced, Store, StoreLost, Watermark, apply_events, apply_snapshot

log = logging.getLogger("kvindex.subscriber")

#: How often a rank that wants a replay slot looks for a free one.
_SLOT_POLL = 0.05


def _mark(watermark: Watermark | None) -> Mark | None:
    return None if watermark is None else Mark(watermark.seq, watermark.ts)


def _retried(error: BaseException) -> bool:
    """Store failures worth retrying: all but the answers that are news."""
    return not isinstance(error, (Fenced, StoreLost))


class RankConsumer:
    """Sockets, tasks and in-order application for one (engine, dp rank).

    ``store`` is where its batches go; ``fence``: the claim token a worker's
    consumer writes under (None: the rank's only writer).
    """

    def __init__(
        self,
        spec: EngineSpec,
        dp_rank: int,
        store: Store,
        shared: Shared,
        fence: int | None = None,
    ) -> None:
        self.rank = RankId(spec.name, dp_rank)
        self.status = blank_status(spec, dp_rank)
        self.metrics = metrics.RankMetrics(spec.name, dp_rank)
        self._spec = spec
        self._shared = shared
        self._settings = settings = shared.settings
        self._store, self._fence = store, fence
        #: the declared KV groups, told to the store with the first batch applied
        self._groups = DeclaredGroups.of(spec, self.status, self.metrics, self.ids)
        self._intake = Intake(settings.intake_limit, settings.intake_bytes)
        self._stopping = False
        self._failed = False  # the loop died of a bug
        self.fenced = False  # another owner took the rank: nothing more is applied
        self._has_replay = spec.replay_endpoint is not None
        replay = spec.rank_endpoint(dp_rank, replay=True) or ""
        self._report = Report(self.status, self.metrics, self.ids, replay, settings.replay_attempts)
        bounds = rank_bounds(spec, settings.max_blocks)
        snapshots = spec.rank_snapshot_endpoint(dp_rank)
        self._snapshots = snapshots and SnapshotFetch(
            shared, snapshots, self._wake, bounds, self._report.rejected
        )
        self._seq: Sequencer[EventBatch] = Sequencer(
            self.status,
            settings.rules(self._has_replay, snapshots is not None),
            self._decode,
            lambda first, last: Gap(first, last, time.time()),
            time.monotonic(),
        )
        self._decode_batch = spec.engine_adapter.decode
        self._replay = ReplayClient(
            shared.context,
            settings,
            spec.engine_adapter,
            replay,
            self._deliver,
            self._seq.holds,
            self._replay_activity,
            self._report.rejected,
        )
        self._live = LiveFeed(
            shared.context,
            settings,
            spec,
            self.status,
            self._deliver,
            self._report.rejected,
            self._connected,
            self.ids,
        )
        self._capacity = Capacity(bounds, self.status, self.metrics, self.ids)
        self._slot_held = False
        self._losses = LossWatch(store, self._seq)
        #: Call the store until it succeeds: a batch in hand is never dropped.
        self._store_call = functools.partial(
            until_done,
            retry_if=_retried,
            wait=tenacity.wait_exponential(
                multiplier=min(0.05, settings.store_retry_max), max=settings.store_retry_max
            ),
            what="rank consumer",
            extra=self.ids(),
            on_error=self._store_error,
            stopping=lambda: self._stopping,
            sleep=self._losses.pause,
        )

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start consuming (the watermark loads in the background)."""
        self._settings.bind.check(self._spec)  # again: a file may have appeared since
        self._live.start()
        name = f"{self.rank.engine}/{self.rank.dp_rank}"
        self._runner = asyncio.create_task(self._run(), name=f"sequencer {name}")

    async def stop(self) -> None:
        """Finish the batch in hand (up to ``stop_grace``), then close everything
        and drop what is queued or held, so the memory is returned at once."""
        self._stopping = True
        self._live.stop_reading()
        self._replay.stop_reading()
        self._wake()
        try:
            await asyncio.wait_for(self._runner, self._settings.stop_grace)
        except TimeoutError:
            log.warning("rank stop timed out", extra=self.ids())
        await self._live.close()
        if self._snapshots:
            self._snapshots.cancel()
        self._perform_now(self._seq.stop())
        self._replay.close()
        self._intake.clear()

    @property
    def failed(self) -> bool:
        """Nothing more will be applied (a bug, a socket not reopened): not ready."""
        return self._failed or self._live.failed

    def _connected(self) -> None:
        """A publisher is there: ask it soon what was missed, on a new DEALER (one kept
        from before an engine restart has no peer: the probe would time out)."""
        if self._seq.request is None:
            self._replay.close()
        self._seq.connected()
        self._wake()

    def _wake(self) -> None:
        """Have the loop look at its state now (it may be waiting for a batch)."""
        self._intake.put_nowait((WAKE, 0, 0, b"", 0.0))

    def _queued(self) -> tuple[int, float] | None:
        """The seq and ts of the newest batch read that the sequencer has not taken yet."""
        return self._live.queued if not self._intake.empty() else None

    def status_now(self) -> RankStatus:
        """A copy of the status, lag computed now (counting queued batches), losses in doubt."""
        return status_now(self.status, self._seq, self._queued(), self._losses.in_doubt())

    def reached(self) -> int:
        """The newest seq this rank applied, received or is rebuilding up to (-1: none):
        what it, or a consumer claiming it anew, must apply after a store loss to be exact."""
        return self._seq.reached(queued[0] if (queued := self._queued()) else None)

    def ids(self, **extra: Any) -> dict[str, Any]:
        return {"engine": self.rank.engine, "dp_rank": self.rank.dp_rank, **extra}

    # --- readers ---------------------------------------------------------------

    def _replay_activity(self, now: float) -> None:
        self._seq.replay_activity = now

    async def _deliver(self, item: Item) -> None:
        """Queue for the loop (waiting while it is full), yielding when the turn's
        ingest budget is spent: a ready socket never makes a receive wait, so a
        flood would hog the loop, and reading shares the budget with applying."""
        await self._intake.put(item)
        await self._shared.slices.pause_if_spent()

    def _decode(self, payload: bytes) -> EventBatch | None:
        """The batch, or None (counted) if the payload is none: its seq stays missing
        (replay may bring a good copy, or its attempts run out and the seq is given up)."""
        try:
            return self._decode_batch(payload, tokens=self._shared.reads_tokens(self.rank.engine))
        except WireError as e:
            self._report.rejected(e)
            return None

    def _decode_held(self, payload: bytes) -> EventBatch:
        """A held batch, decoded when its turn comes. It decoded when it was held;
        if the observers want token ids only since, it decodes without them."""
        try:
            return self._decode_batch(payload, tokens=self._shared.reads_tokens(self.rank.engine))
        except WireError:
            return self._decode_batch(payload, tokens=False)

    # --- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            stored = await self._store_call(self._store.watermark, self.rank)
            await self._perform(self._seq.loaded(_mark(stored)))
            log.info("rank consuming", extra=self.ids(next_seq=self._seq.next))
            pause = self._shared.slices.pause_if_spent
            while not self._stopping:
                try:
                    await self._follow_store()
                    await self._tend_replay()
                    await self._tend_snapshot()
                    item = await self._intake.get(self._idle_timeout())
                    if item is not None:
                        await self._handle(*item)
                except StoreLost:
                    continue  # resynchronised next turn; the batch in hand comes back by replay
                await pause()
        except tenacity.RetryError:
            pass  # stopping while the store is failing
        except Fenced as e:
            self.fenced = True
            log.warning("rank fenced: another owner took it", extra=self.ids(error=str(e)))
        except Exception:
            self._failed = True
            log.exception("rank consumer failed", extra=self.ids())

    def _idle_timeout(self) -> float | None:
        return self._seq.idle_timeout(time.monotonic(), self.status.connected, _SLOT_POLL)

    async def _handle(
        self, kind: int, generation: int, seq: int, payload: bytes, ts: float
    ) -> None:
        sequencer = self._seq
        if kind == LIVE:
            await self._perform(sequencer.live(seq, ts, payload, time.monotonic()))
        elif kind == WAKE or generation != self._replay.generation:
            return  # a wake-up, or the answer to an abandoned request
        elif kind == REPLAY:
            await self._perform(sequencer.replay_batch(seq, ts, payload, time.monotonic()))
        elif kind == HELD:
            await self._perform(sequencer.replay_held(seq, time.monotonic()))
        elif kind == END:
            await self._perform(sequencer.replay_end())
        else:
            sequencer.replay_garbage(time.monotonic())

    # --- replay requests -------------------------------------------------------------

    async def _tend_replay(self) -> None:
        """Time out, or send, a replay request when one is due (and a slot is free)."""
        if not self._has_replay:
            return
        now, sequencer = time.monotonic(), self._seq
        if sequencer.request is not None:
            if now >= sequencer.replay_deadline():
                await self._perform(sequencer.replay_timed_out())
            return
        ask = sequencer.replay_due(now, self.status.connected)
        slots = self._shared.replay_slots
        if ask is None or slots.locked():
            return
        await slots.acquire()
        try:
            self._replay.open()
        except BaseException:
            slots.release()
            raise
        self._slot_held = True
        sequencer.replay_sent(ask, now)
        if not ask.probe:
            self.metrics.replays.inc()
        await self._replay.ask(ask.start)

    # --- snapshots -----------------------------------------------------------------------

    async def _tend_snapshot(self) -> None:
        """Ask for a snapshot when the sequencer wants one; apply the one that came."""
        fetch = self._snapshots
        if fetch and fetch.done:
            await self._restore(fetch.take())
        elif fetch and self._seq.snapshot_due(time.monotonic()) and await fetch.start():
            self._seq.snapshot_sent()

    async def _restore(self, outcome: Outcome) -> None:
        """Apply the engine's snapshot as the rank's whole state, or go on without it."""
        if isinstance(outcome, str):
            await self._perform(self._seq.snapshot_failed(time.monotonic(), outcome))
            return
        if not self._seq.restoring:  # the engine restarted meanwhile: its stream is whole
            return
        try:
            await self._store_call(apply_snapshot, self._store, self.rank, outcome, self._fence)
        except StoreLost as e:  # resynchronised next turn, then asked again at once
            await self._perform(self._seq.snapshot_failed(time.monotonic(), str(e), 0.0))
            raise
        self._shared.notify(self.rank, GPU_CLEARED)  # observers: its GPU was replaced
        self._capacity.restarted(MEDIA)
        await self._perform(self._seq.restored(outcome.seq, outcome.ts))
        await self._bound_capacity()

    def _end_request(self, close: bool) -> None:
        if self._slot_held:
            self._slot_held = False
            self._shared.replay_slots.release()
        if close:
            self._replay.close()  # so a late answer never arrives

    # --- performing the sequencer's actions -----------------------------------------------

    async def _perform(self, actions: list[seq_rules.Action]) -> None:
        for action in actions:
            if type(action) is seq_rules.Apply:
                await self._apply(action.seq, action.batch, action.ts)
            elif type(action) is seq_rules.ApplyHeld:
                await self._apply(action.seq, self._decode_held(action.payload), action.ts)
            elif type(action) is seq_rules.Clear:
                await self._store_call(
                    self._store.clear,
                    self.rank,
                    action.media,
                    reset_seq=action.reset_seq,
                    fence=self._fence,
                )
                if GPU in action.media:  # observers (routed entries) hear of it as a clear
                    self._shared.notify(self.rank, GPU_CLEARED)
                if action.reset_seq:  # the engine restarted
                    self._capacity.restarted(action.media)
            else:
                self._note(action)

    def _perform_now(self, actions: list[seq_rules.Action]) -> None:
        """Actions without store calls (the sequencer stopping)."""
        for action in actions:
            self._note(action)

    def _note(self, action: seq_rules.Action) -> None:
        """Perform an action that does not write to the store: replay, logs, metrics."""
        if type(action) is seq_rules.EndRequest:
            self._end_request(action.close)
        else:
            self._report(action)

    async def _apply(self, seq: int, batch: EventBatch, ts: float) -> None:
        batch = self._capacity.admit(batch)
        applied = batch if self._groups is None else self._groups.to_apply(batch)
        started = time.perf_counter()
        result = await self._store_call(
            apply_events,
            self._store,
            self.rank,
            seq,
            applied,
            self._fence,
            hold_gpu=self._spec.reuse_reports == "capped",
        )
        metrics.APPLY_SECONDS.observe(time.perf_counter() - started)
        self._seq.applied(seq, ts, result.applied)
        if not result.applied:  # the store had it already (another writer)
            self.metrics.duplicates.inc()
            return
        if self._groups is not None:
            self._groups.told = True
        self.metrics.batches.inc()
        self.metrics.block_ops.inc(result.block_ops)
        self._shared.notify(self.rank, batch)
        if self._capacity.stored(batch):  # some medium may be over its bound: count exactly
            await self._bound_capacity()

    async def _bound_capacity(self) -> None:
        """Count the rank's blocks in the store; clear what is over its bound."""
        counts = await self._store_call(self._store.block_counts, self.rank)
        if over := self._capacity.counted(counts):
            await self._perform([seq_rules.Clear(tuple(over))])

    # --- the store -------------------------------------------------------------------

    def notice_store_loss(self) -> None:
        """The store noticed a loss of data: resynchronise now, even if idle or backing off."""
        self._losses.heard()
        self._wake()

    @property
    def rebuild(self) -> tuple[int, str] | None:
        """The rebuild after a store loss under way (the seq to reach, the loss), or None."""
        return self._seq.rebuild_after_loss

    def rebuilding(self, last: int, reason: str) -> None:
        """An earlier consumer had reached ``last`` when the store lost data (a worker
        claiming the rank anew): degraded until that is applied again."""
        self._perform_now(self._seq.rebuilding(last, reason))

    async def _follow_store(self) -> None:
        """Resynchronise after a loss the store noticed and this rank has not seen yet
        (not under a claim: the loss voids it, and the worker claims the rank anew)."""
        loss = self._store.last_loss() if self._fence is None else None
        if loss is not None and loss.number != self._seq.losses_seen:
            mark = _mark(await self._store_call(self._store.watermark, self.rank))
            resync = self._seq.resync(loss.number, loss.reason, loss.wiped, mark, self.reached())
            await self._perform(resync)
        self._perform_now(self._seq.settle_rebuild())

    def _store_error(self, error: BaseException) -> None:
        self.status.store_errors += 1
        self.metrics.store_errors.inc()
