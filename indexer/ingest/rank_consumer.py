"""One engine rank's live and replayed batches, applied in order, each seq once.

A :class:`RankConsumer` consumes one (engine, dp rank): a SUB socket for
live batches, a :class:`~indexer.ingest.replay_client.ReplayClient` to the
engine's replay ROUTER, and tasks: a live reader, a replay reader, a
connection monitor and the loop that applies. Who decides which ranks run is
not its business: the :class:`~indexer.ingest.subscriber.Subscriber` of
``kvindex serve`` runs every registered rank, an
:class:`~indexer.cluster.workers.Worker` of ``kvindex indexer`` the ranks it
holds a lease on. The ordering rules (gaps, replay, duplicates, restarts,
store losses) are the :class:`~indexer.core.sequencer.Sequencer`'s; this is
the shell that feeds it what happens and performs what it answers.

Readers split frames as fast as they come into an intake bounded in batches
and in bytes, so the newest received seq is known even while the store is
slow: lag is that minus the applied seq (and the same in batch ``ts``). When
the intake is full the readers stop reading, ZMQ's high-water marks fill and
the publisher drops batches; the drops surface as gaps and are replayed. A
frame over ``max_message_bytes`` never reaches memory: ZeroMQ drops the
connection when its header announces it, and the seq is a gap like any other.
Batches stay encoded until they are applied (a decoded one takes six times
the memory), only their ts is read on the way in.

A rank whose endpoint has no publisher costs nothing but ZeroMQ's reconnect
attempts (backed off to ``reconnect_max``): replay is asked only while the
SUB socket has a peer, the DEALER is opened only for a request, and probes
that go unanswered are backed off. After ``no_publisher_after`` seconds
without ever connecting, the rank says so once (a warning and
``RankStatus.never_connected``).

Store failures are retried with backoff and never skip a batch: a seq is
acknowledged (the watermark) only by the store applying it. The one store
answer that is not retried is :class:`~indexer.stores.base.Fenced`: another
owner has taken the rank, so the consumer stops applying at once and says so
(:attr:`RankConsumer.fenced`). When the store loses data it had acknowledged
(:class:`~indexer.stores.base.StoreLost`, or a loss the store noticed on its
own), the consumer continues from the store's watermark and asks replay for
the batches after it; the rank is degraded, with the reason in
``store_loss``, until every batch it had applied before is applied again, or
the engine restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol, TypeVar

import msgspec
import tenacity
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer import metrics
from indexer.core import sequencer as seq_rules
from indexer.core.events import EventBatch, RankId, WireError
from indexer.core.hybrid import GroupDeclaration
from indexer.core.sequencer import Mark, Rules, Sequencer
from indexer.engines.vllm.wire import batch_ts, decode_batch, decode_frames
from indexer.ingest.intake import END, HELD, LIVE, REPLAY, WAKE, Intake, Item
from indexer.ingest.replay_client import ReplayClient
from indexer.ingest.settings import Shared, SubscriberSettings
from indexer.ingest.sockets import YIELD_EVERY, close_sub, messages, open_sub
from indexer.periodic import until_done
from indexer.registry import EngineSpec, Gap, RankStatus
from indexer.stores.base import ApplyResult, Fenced, Loss, StoreLost, Watermark

log = logging.getLogger("kvindex.subscriber")

#: How often a rank that wants a replay slot looks for a free one.
_SLOT_POLL = 0.05

T = TypeVar("T")


def _declaration(spec: EngineSpec) -> GroupDeclaration | None:
    groups = spec.kv_groups
    if not groups:
        return None
    size = spec.block_size
    return GroupDeclaration(
        [(g.kind, g.sliding_window, g.block_size or size) for g in groups], size
    )


def _rules(settings: SubscriberSettings, has_replay: bool) -> Rules:
    return Rules(
        has_replay=has_replay,
        replay_timeout=settings.replay_timeout,
        replay_attempts=settings.replay_attempts,
        gap_clear_threshold=settings.gap_clear_threshold,
        probe_interval=settings.probe_interval,
        probe_backoff_max=settings.probe_backoff_max,
        max_pending=settings.max_pending,
        pending_bytes=settings.pending_bytes,
        max_missing=settings.max_missing,
    )


def _mark(watermark: Watermark | None) -> Mark | None:
    return None if watermark is None else Mark(watermark.seq, watermark.ts)


def _retried(error: BaseException) -> bool:
    """Store failures worth retrying: all but the answers that are news."""
    return not isinstance(error, (Fenced, StoreLost))


class RankStore(Protocol):
    """What a consumer needs of a store: a whole :class:`~indexer.stores.base.Store`,
    or a leaseholder's view of one (:class:`~indexer.stores.redis.OwnedRank`)."""

    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult: ...

    async def watermark(self, rank: RankId) -> Watermark | None: ...

    async def clear(
        self, rank: RankId, media: Collection[str], *, reset_seq: bool = False
    ) -> None: ...

    def last_loss(self) -> Loss | None: ...


class RankConsumer:
    """Sockets, tasks and in-order application for one (engine, dp rank).

    ``store`` is where its batches go: the process's store, or a view of it
    that writes under the rank's lease token (:class:`~indexer.stores.redis.OwnedRank`).
    """

    def __init__(self, spec: EngineSpec, dp_rank: int, store: RankStore, shared: Shared) -> None:
        self.rank = RankId(spec.name, dp_rank)
        self.status = RankStatus(dp_rank)
        self.metrics = metrics.RankMetrics(spec.name, dp_rank)
        self._spec = spec
        self._shared = shared
        self._settings = settings = shared.settings
        self._store = store
        #: the declared KV groups, told to the store with the first batch applied
        self._groups = _declaration(spec)
        self._groups_told = self._groups is None
        self._intake = Intake(settings.intake_limit, settings.intake_bytes)
        self._delivered = 0
        self._stopping = False
        self.failed = False  # the loop died of a bug: the subscriber is not ready
        self.fenced = False  # another owner took the rank: nothing more is applied
        self._has_replay = spec.replay_endpoint is not None
        self._seq: Sequencer[EventBatch] = Sequencer(
            self.status,
            _rules(settings, self._has_replay),
            self._decode,
            lambda first, last: Gap(first, last, time.time()),
            time.monotonic(),
        )
        self._replay = ReplayClient(
            shared.context,
            settings,
            spec.rank_endpoint(dp_rank, replay=True) or "",
            self._deliver,
            self._seq.holds,
            self._replay_activity,
            self._reject,
        )
        self._slot_held = False
        self._queued: tuple[int, float] | None = None  # seq and ts of the newest live frame read
        self._ever_connected = False
        self._publisher_check: asyncio.TimerHandle | None = None
        self._retry_wait = tenacity.wait_exponential(
            multiplier=min(0.05, settings.store_retry_max), max=settings.store_retry_max
        )

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start consuming (the watermark loads in the background)."""
        self._settings.bind.check(self._spec)  # again: a file may have appeared since
        self._open_sub()
        self._publisher_check = asyncio.get_running_loop().call_later(
            self._settings.no_publisher_after, self._check_publisher
        )
        name = f"{self.rank.engine}/{self.rank.dp_rank}"
        self._runner = asyncio.create_task(self._run(), name=f"sequencer {name}")

    def _open_sub(self) -> None:
        """The SUB socket, its connection monitor, and the tasks reading both."""
        spec = self._spec
        sub, monitor = open_sub(
            self._shared.context, self._settings, spec.topic, self._endpoint(), spec.bind
        )
        self._sub, self._monitor = sub, monitor
        name = f"{self.rank.engine}/{self.rank.dp_rank}"
        self._tasks = [
            asyncio.create_task(self._read_live(sub), name=f"live {name}"),
            asyncio.create_task(self._watch_connection(monitor), name=f"monitor {name}"),
        ]

    async def stop(self) -> None:
        """Finish the batch in hand (up to ``stop_grace``), then close everything
        and drop what is queued or held, so the memory is returned at once."""
        self._stopping = True
        self._publisher_check.cancel()
        for task in self._tasks:
            task.cancel()
        self._replay.stop_reading()
        self._wake()
        try:
            await asyncio.wait_for(self._runner, self._settings.stop_grace)
        except TimeoutError:
            log.warning("rank stop timed out", extra=self.ids())
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._perform_now(self._seq.stop())
        self._replay.close()
        close_sub(self._sub, self._monitor)
        self.status.connected = False
        self._intake.clear()

    def _wake(self) -> None:
        """Have the loop look at its state now (it may be waiting for a batch)."""
        self._intake.put_nowait((WAKE, 0, 0, b"", 0.0))

    def snapshot(self) -> RankStatus:
        """A copy of the status, with lag computed now (counting batches still queued)."""
        status, mark = self.status, self._seq.mark
        last_seq, received_ts = status.last_seq, self._seq.received_ts
        queued = self._queued
        if queued is not None and not self._intake.empty() and queued[0] > (last_seq or -1):
            last_seq, received_ts = queued
        lag, lag_seconds = 0, 0.0
        if last_seq is not None:
            lag = max(0, last_seq - (mark.seq if mark else -1))
            if mark is not None and received_ts is not None:
                lag_seconds = max(0.0, received_ts - mark.ts)
        return msgspec.structs.replace(
            status,
            lag_batches=lag,
            lag_seconds=lag_seconds,
            missing=list(status.missing),
            rejected=dict(status.rejected),
        )

    def ids(self, **extra: Any) -> dict[str, Any]:
        return {"engine": self.rank.engine, "dp_rank": self.rank.dp_rank, **extra}

    # --- readers ---------------------------------------------------------------

    async def _read_live(self, sub: zmq.asyncio.Socket) -> None:
        async for frames in messages(sub):
            try:
                _, seq, payload = decode_frames(frames)
                ts = batch_ts(payload)
            except WireError as e:
                # Live garbage may come from anyone on the topic: count it, ignore its seq.
                self._reject(e)
                continue
            self._queued = (seq, ts)
            await self._deliver((LIVE, 0, seq, payload, ts))

    def _replay_activity(self, now: float) -> None:
        self._seq.replay_activity = now

    async def _deliver(self, item: Item) -> None:
        """Queue for the loop (waiting while it is full), yielding now and then:
        a ready socket never makes a receive wait, so a flood would hog the loop."""
        await self._intake.put(item)
        self._delivered += 1
        if self._delivered % YIELD_EVERY == 0:
            await asyncio.sleep(0)

    def _reject(self, error: WireError) -> None:
        rejected = self.status.rejected
        rejected[error.reason] = rejected.get(error.reason, 0) + 1
        self.metrics.rejected(error.reason)
        if rejected[error.reason] == 1:
            log.warning("bad frame", extra=self.ids(reason=error.reason, detail=error.detail[:200]))

    def _decode(self, payload: bytes) -> EventBatch | None:
        """The batch, or None (counted) if the payload is none: its seq stays missing
        (replay may bring a good copy, or its attempts run out and the seq is given up)."""
        try:
            return decode_batch(payload, tokens=self._shared.reads_tokens(self.rank.engine))
        except WireError as e:
            self._reject(e)
            return None

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        peers = 0
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                peers = max(0, peers - 1)
            if (peers > 0) != self.status.connected:
                self.status.connected = peers > 0
                log.info("rank connected" if peers else "rank disconnected", extra=self.ids())
                if peers:
                    self._connected()
            if event == zmq.EVENT_DISCONNECTED and not self._spec.bind:
                self._replace_sub()
                return

    def _replace_sub(self) -> None:
        """A fresh SUB socket after a disconnection. ZeroMQ reconnects after a
        network error but gives up on a peer that broke the protocol (a frame
        over ``max_message_bytes``), which would leave the rank deaf for good;
        and a message cut short by the disconnection must not be continued by
        the next connection's frames (libzmq aborts the process on that)."""
        self._tasks[0].cancel()  # the reader: it never touches the old socket again
        close_sub(self._sub, self._monitor)
        try:
            self._open_sub()
        except OSError as e:  # zmq.ZMQError is an OSError
            self.failed = True  # nothing more can be received: the subscriber is not ready
            log.error("cannot reopen the SUB socket", extra=self.ids(error=str(e)))

    def _connected(self) -> None:
        """A publisher is there: ask it soon whether anything was missed while it was not."""
        if self.status.never_connected:
            log.info("publisher found", extra=self.ids(endpoint=self._endpoint()))
        self._ever_connected = True
        self.status.never_connected = False
        self._seq.connected()
        self._wake()

    def _check_publisher(self) -> None:
        """Say once, in words, that a rank has had no publisher since it started."""
        if self._ever_connected or self._stopping:
            return
        self.status.never_connected = True
        endpoint, waited = self._endpoint(), self._settings.no_publisher_after
        if self._spec.bind:
            problem = f"no engine connected to {endpoint} in {waited:g} s"
            fix = "point the engine's --kv-events-config endpoint at this address"
        else:
            problem = f"no publisher at {endpoint}: nothing answered in {waited:g} s"
            fix = (
                "check that the engine runs with --kv-events-config publishing on this"
                " host and port (or set bind: true if the engine connects to kvindex)"
            )
        log.warning(f"{problem}; {fix}", extra=self.ids(endpoint=endpoint))

    def _endpoint(self) -> str:
        return self._spec.rank_endpoint(self.rank.dp_rank) or ""

    # --- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            stored = await self._store_call(self._store.watermark, self.rank)
            await self._perform(self._seq.loaded(_mark(stored)))
            log.info("rank consuming", extra=self.ids(next_seq=self._seq.next))
            n = 0
            while not self._stopping:
                try:
                    await self._follow_store()
                    await self._tend_replay()
                    item = await self._intake.get(self._idle_timeout())
                    if item is not None:
                        await self._handle(*item)
                except StoreLost:
                    continue  # resynchronised next turn; the batch in hand comes back by replay
                n += 1
                if n % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except tenacity.RetryError:
            pass  # stopping while the store is failing
        except Fenced as e:
            self.fenced = True
            log.warning("rank fenced: another owner took it", extra=self.ids(error=str(e)))
        except Exception:
            self.failed = True
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
            elif type(action) is seq_rules.Clear:
                await self._store_call(
                    self._store.clear, self.rank, action.media, reset_seq=action.reset_seq
                )
            else:
                self._note(action)

    def _perform_now(self, actions: list[seq_rules.Action]) -> None:
        """Actions without store calls (the sequencer stopping)."""
        for action in actions:
            self._note(action)

    def _note(self, action: seq_rules.Action) -> None:
        """Perform an action that does not write to the store: logs, metrics, replay."""
        match action:
            case seq_rules.EndRequest(close=close):
                self._end_request(close)
            case seq_rules.Duplicate():
                self.metrics.duplicates.inc()
            case seq_rules.GapOpened(first=first, last=last):
                self.metrics.gap("detected")
                log.info("gap", extra=self.ids(first=first, last=last))
            case seq_rules.GapFilled(first=first, last=last):
                self.metrics.gap("filled")
                log.info("gap filled", extra=self.ids(first=first, last=last))
            case seq_rules.GaveUp(first=first, last=last, reason=why, cleared=clear, newly=newly):
                if newly:
                    self.metrics.gap("unfilled")
                log.warning(
                    "rank degraded", extra=self.ids(first=first, last=last, why=why, cleared=clear)
                )
            case seq_rules.Restarted(applied_seq=applied, seq=seq):
                self.metrics.restarts.inc()
                log.warning("engine restart", extra=self.ids(applied_seq=applied, seq=seq))
            case seq_rules.ReplayTimedOut():
                self._replay_timed_out(action)
            case seq_rules.StoreLossFound(lost=lost):
                log.warning("store lost batches", extra=self.ids(lost=lost))
            case seq_rules.RebuildSettled(last=last, exact=True):
                log.info("rank rebuilt after a store loss", extra=self.ids(last=last))
            case seq_rules.RebuildSettled(last=last):
                log.warning("rank not rebuilt after a store loss", extra=self.ids(last=last))

    def _replay_timed_out(self, timed_out: seq_rules.ReplayTimedOut) -> None:
        # Said once per silence: a replay endpoint that never answers is retried for ever.
        level = logging.INFO if timed_out.unanswered <= 1 else logging.DEBUG
        log.log(level, "replay timed out", extra=self.ids(start=timed_out.start))
        if timed_out.unavailable:
            endpoint = self._replay.endpoint
            log.warning(
                f"replay unavailable: no answer from {endpoint} in {self._settings.replay_attempts}"
                " requests; check the engine's --kv-events-config replay_endpoint",
                extra=self.ids(start=timed_out.start, endpoint=endpoint),
            )

    async def _apply(self, seq: int, batch: EventBatch, ts: float) -> None:
        applied = batch
        if self._groups is not None:
            self._check_groups(batch)
            if not self._groups_told:
                applied = self._groups.prepended(batch)
        result = await self._store_call(self._store.apply_batch, self.rank, seq, applied)
        self._seq.applied(seq, ts, result.applied)
        if not result.applied:  # the store had it already (another writer)
            self.metrics.duplicates.inc()
            return
        self._groups_told = True
        self.metrics.batches.inc()
        self.metrics.block_ops.inc(result.block_ops)
        self._shared.notify(self.rank, batch)

    def _check_groups(self, batch: EventBatch) -> None:
        """Count and log (once each) what events say against the declared KV groups."""
        for conflict in self._groups.conflicts(batch):
            self.status.kv_group_mismatches += 1
            self.metrics.kv_group_mismatches.inc()
            log.warning("kv group differs from its declaration", extra=self.ids(**conflict))

    # --- the store -------------------------------------------------------------------

    def notice_store_loss(self) -> None:
        """The store noticed a loss of data: resynchronise now, even if idle."""
        self._wake()

    def rebuilding(self, last: int, reason: str) -> None:
        """The rank's previous consumer here had applied up to ``last`` when the store
        lost data (a worker claiming it anew): degraded until that is applied again."""
        self._perform_now(self._seq.rebuilding(last, reason))

    async def _follow_store(self) -> None:
        """Resynchronise after a loss the store noticed and this rank has not seen yet."""
        loss = self._store.last_loss()
        if loss is not None and loss.number != self._seq.losses_seen:
            stored = await self._store_call(self._store.watermark, self.rank)
            await self._perform(
                self._seq.resync(loss.number, loss.reason, loss.wiped, _mark(stored))
            )
        self._perform_now(self._seq.settle_rebuild())

    def _store_error(self, error: BaseException) -> None:
        self.status.store_errors += 1
        self.metrics.store_errors.inc()

    async def _store_call(self, call: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
        """Call the store until it succeeds: a batch in hand is never dropped."""
        return await until_done(
            lambda: call(*args, **kw),
            retry_if=_retried,
            wait=self._retry_wait,
            what="rank consumer",
            extra=self.ids(),
            on_error=self._store_error,
            stopping=lambda: self._stopping,
        )
