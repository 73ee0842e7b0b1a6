"""One engine rank's live and replayed batches, applied in order, each seq once.

A :class:`RankConsumer` consumes one (engine, dp rank): a SUB socket for
live batches, a DEALER to the engine's replay ROUTER, and tasks:
a live reader, a replay reader, a connection monitor and the sequencer that
applies. Who decides which ranks run is not its business: the
:class:`~indexer.ingest.subscriber.Subscriber` of ``kvindex serve`` runs every
registered rank, an :class:`~indexer.cluster.workers.Worker` of ``kvindex indexer``
the ranks it holds a lease on.

Readers split frames as fast as they come into an intake bounded in batches
and in bytes, so the newest received seq is known even while the store is
slow: lag is that minus the applied seq (and the same in batch ``ts``). When
the intake is full the readers stop reading, ZMQ's high-water marks fill and
the publisher drops batches; the drops surface as gaps and are replayed. A
frame over ``max_message_bytes`` never reaches memory: ZeroMQ drops the
connection when its header announces it, and the seq is a gap like any other.
Batches stay encoded until they are applied (a decoded one takes six times
the memory), only their ts is read on the way in; a batch changes what the
consumer believes (the newest seq and ts, an engine restart) only once its
whole payload decodes, so garbage is counted and has no other effect.

A rank whose endpoint has no publisher costs nothing but ZeroMQ's reconnect
attempts (backed off to ``reconnect_max``): replay is asked only while the
SUB socket has a peer, the DEALER is opened only for a request, and probes
that go unanswered are backed off. After ``no_publisher_after`` seconds
without ever connecting, the rank says so once (a warning and
``RankStatus.never_connected``).

The sequencer applies strictly in seq order, each seq once:

- a seq above the next expected one is held back and the missing range is
  asked from replay; replayed and live copies of a seq are applied once;
- a replay that starts later than asked (buffer exhausted), skips seqs
  (permanent holes), never answers (bounded timeouts and attempts) or cannot
  be asked (no replay endpoint) leaves the rank degraded with the missing
  range; a range longer than ``gap_clear_threshold`` also drops its GPU/CPU
  counts, which can no longer be trusted;
- a seq at or below one already seen with a newer batch ``ts`` is a new
  engine incarnation: GPU/CPU counts and the watermark are
  dropped and consumption restarts from the new seq. Replay is asked from
  the last applied seq itself, so an answer that lacks it, or carries it with
  another ts, reveals a restart the live stream alone cannot show (the engine
  restarted while the indexer was down, or while the rank was idle).

Store failures are retried with backoff and never skip a batch: a seq is
acknowledged (the watermark) only by the store applying it. The one store
answer that is not retried is :class:`~indexer.stores.base.Fenced`: another
owner has taken the rank, so the consumer stops applying at once and says so
(:attr:`RankConsumer.fenced`).

When the store loses data it had acknowledged (a Redis restarted empty or
from an older snapshot: :class:`~indexer.stores.base.StoreLost`, or a loss
the store noticed on its own), the consumer continues from the store's
watermark and asks replay for the batches after it; the rank is degraded,
with the reason in ``store_loss``, until every batch it had applied before
is applied again, or the engine restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import logging
import resource
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer import metrics
from indexer.core.events import CPU, GPU, EventBatch, RankId, WireError
from indexer.core.hybrid import GroupDeclaration
from indexer.engines.vllm.wire import SEQ_BYTES, batch_ts, decode_batch, decode_frames, split_replay
from indexer.registry import BindPolicy, EngineSpec, Gap, RankStatus
from indexer.stores.base import ApplyResult, Fenced, Loss, StoreLost, Watermark

log = logging.getLogger("kvindex.subscriber")


def _declaration(spec: EngineSpec) -> GroupDeclaration | None:
    groups = spec.kv_groups
    if not groups:
        return None
    size = spec.block_size
    return GroupDeclaration(
        [(g.kind, g.sliding_window, g.block_size or size) for g in groups], size
    )


#: Called after each applied batch; must be cheap, it runs in the apply loop.
Observer = Callable[[RankId, EventBatch], None]

_Seconds = Annotated[float, msgspec.Meta(gt=0)]
_Count = Annotated[int, msgspec.Meta(ge=1)]


class SubscriberSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ranks are consumed: the ``subscriber`` section of the config file.

    - ``replay_timeout``: seconds without a replay frame before a request is
      abandoned (and retried).
    - ``replay_attempts``: requests in a row that fill nothing before a gap
      is declared unfilled.
    - ``max_concurrent_replays``: replay requests in flight across all ranks,
      so a fleet restarting at once does not stampede its engines.
    - ``gap_clear_threshold``: an unfilled range of more batches than this
      also drops the rank's GPU/CPU counts.
    - ``probe_interval``: idle seconds after which a rank asks replay whether
      it missed anything (a lost last batch, a restart while idle); 0: never.
    - ``probe_backoff_max``: a probe that goes unanswered doubles the wait
      before the next one (``probe_interval``, twice that, ...), up to this.
    - ``intake_limit``, ``intake_bytes``: received batches, and their bytes,
      held before the readers pause.
    - ``max_pending``, ``pending_bytes``: batches, and their bytes, held out
      of order behind a gap; beyond either the gap is declared unfilled.
    - ``max_message_bytes``: the largest frame accepted (ZeroMQ's
      ``MAXMSGSIZE``: a peer announcing a larger one is disconnected before
      it is read). vLLM publishes one batch per engine step; the largest
      real one is a long prefill: 128k tokens are 8,192 blocks of 16, whose
      ``BlockStored`` carries 8,192 hashes (32-byte digests: ~280 KB) and
      131,072 token ids (up to 5 bytes each: ~660 KB), about 1 MB per KV
      cache group, and as much again for the CPU offload's copy and the
      evictions it causes: a few MB, ~10 MB for a hybrid model with several
      groups. 64 MiB leaves room for six times that.
    - ``sub_hwm``, ``replay_hwm``: ZMQ receive high-water marks (messages)
      of each SUB and replay DEALER socket; with ``max_message_bytes`` they
      bound what ZeroMQ itself queues while the readers pause.
    - ``reconnect_max``: ZeroMQ retries a connection that fails after 0.1 s,
      doubling the wait up to this many seconds.
    - ``no_publisher_after``: seconds without any peer before a rank that
      has never connected is reported (one warning, ``never_connected``).
    - ``store_retry_max``: cap of the store retry backoff, seconds.
    - ``stop_grace``: seconds to finish the batch in hand at shutdown.
    - ``max_missing``: unfilled ranges kept per rank for operators.
    - ``bind``: where engines with ``bind: true`` may make kvindex listen
      (:class:`~indexer.registry.BindPolicy`; default: loopback tcp only).
    """

    replay_timeout: _Seconds = 2.0
    replay_attempts: _Count = 3
    max_concurrent_replays: _Count = 8
    gap_clear_threshold: _Count = 1000
    probe_interval: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    probe_backoff_max: _Seconds = 60.0
    intake_limit: _Count = 10_000
    intake_bytes: _Count = 128 << 20
    max_pending: _Count = 20_000
    pending_bytes: _Count = 128 << 20
    max_message_bytes: _Count = 64 << 20
    sub_hwm: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    replay_hwm: _Count = 100
    reconnect_max: _Seconds = 10.0
    no_publisher_after: _Seconds = 10.0
    store_retry_max: _Seconds = 5.0
    stop_grace: _Seconds = 5.0
    max_missing: _Count = 100
    bind: BindPolicy = BindPolicy()


# Intake items: (kind, replay generation, seq, payload, batch ts).
# _HELD: a replayed seq already held or applied, not even looked at.
# _BAD: a replayed frame that was no batch (it still counts as answered).
_LIVE, _REPLAY, _HELD, _END, _WAKE, _BAD = range(6)
_Item = tuple[int, int, int, bytes, float]
#: Readers and the sequencer yield to the event loop this often, so a flood
#: of batches never starves the API sharing the loop.
_YIELD_EVERY = 64
#: How often a rank that wants a replay slot looks for a free one.
_SLOT_POLL = 0.05

T = TypeVar("T")


class _Stopped(Exception):
    """The consumer is shutting down while the store is failing."""


class SocketLimit(OSError):
    """No more sockets can be opened: the message names the limit that was reached."""


@contextlib.contextmanager
def _socket_limit(context: zmq.Context) -> Iterator[None]:
    """Turn ZeroMQ's "Too many open files" into an error naming both limits."""
    try:
        yield
    except zmq.ZMQError as e:
        if e.errno != errno.EMFILE:
            raise
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise SocketLimit(
            errno.EMFILE,
            f"no more sockets: ZeroMQ allows {context.get(zmq.MAX_SOCKETS)} per process"
            f" and open files are limited to {soft} (hard limit {hard}); each rank takes"
            " 3 sockets and 4 files (one more of each while replaying): raise the hard"
            " limit (ulimit -n, LimitNOFILE=, docker --ulimit nofile=) or spread the"
            " engines over kvindex indexer workers",
        ) from None


class _Intake:
    """Received items for the sequencer, bounded in count and in payload bytes.

    A reader waits while either bound is reached, so its socket stops being
    read (ZeroMQ's high-water mark then bounds what queues behind it). One
    item always fits in an empty intake: ``max_message_bytes`` bounds it.
    Wake-ups are put without waiting: they carry no payload.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._items: deque[_Item] = deque()
        self._bytes = 0
        self._max_items, self._max_bytes = max_items, max_bytes
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def full(self) -> bool:
        return len(self._items) >= self._max_items or self._bytes >= self._max_bytes

    def empty(self) -> bool:
        return not self._items

    async def put(self, item: _Item) -> None:
        while self.full():
            self._room.clear()
            await self._room.wait()
        self.put_nowait(item)

    def put_nowait(self, item: _Item) -> None:
        self._items.append(item)
        self._bytes += len(item[3])
        self._ready.set()

    def get_nowait(self) -> _Item | None:
        if not self._items:
            return None
        item = self._items.popleft()
        self._bytes -= len(item[3])
        if not self.full():
            self._room.set()
        return item

    async def get(self, timeout: float | None) -> _Item | None:
        """The next item, or None after ``timeout`` seconds (None: no timeout)."""
        item = self.get_nowait()
        if item is not None or timeout == 0:
            return item
        self._ready.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self.get_nowait()

    def clear(self) -> None:
        """Drop everything queued (the consumer stopped: free the payloads now)."""
        self._items.clear()
        self._bytes = 0
        self._room.set()


async def _messages(sock: zmq.asyncio.Socket) -> AsyncIterator[list[bytes]]:
    """Every message of a socket: an awaited poll, then a non-blocking drain of
    what is queued (an awaited receive costs four times a non-blocking one)."""
    drain = zmq.Socket.shadow(sock.underlying).recv_multipart
    while True:
        await sock.poll(flags=zmq.POLLIN)
        for _ in range(_YIELD_EVERY):
            try:
                yield drain(zmq.NOBLOCK)
            except zmq.Again:
                break


@dataclass(slots=True)
class _Request:
    """One replay request in flight."""

    start: int  # first seq asked for
    want: int  # the next seq to apply when it was asked
    sent_at: float
    probe: bool
    received: int = 0
    first_new: int | None = None  # first answered seq >= want


class RankStore(Protocol):
    """What a consumer needs of a store: a whole :class:`~indexer.stores.base.Store`,
    or a leaseholder's view of one (:class:`~indexer.stores.redis.OwnedRank`)."""

    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult: ...

    async def watermark(self, rank: RankId) -> Watermark | None: ...

    async def clear(
        self, rank: RankId, media: Collection[str], *, reset_seq: bool = False
    ) -> None: ...

    def last_loss(self) -> Loss | None: ...


@dataclass(slots=True)
class _Rebuild:
    """A rank re-applying batches its store lost: degraded until ``_next`` passes ``last``."""

    last: int  # the last batch applied before the loss
    reason: str
    restarts: int  # the rank's counts when the loss was found: a restart since, or a
    gaps_unfilled: int  # gap given up since, settles it
    clean: bool  # whether the rank is exact once rebuilt (it lost everything, or was exact)


@dataclass(slots=True)
class Shared:
    """What every rank consumer of one process uses."""

    settings: SubscriberSettings
    context: zmq.asyncio.Context
    replay_slots: asyncio.Semaphore
    notify: Observer
    #: Whether an observer reads an engine's token ids (else batches are decoded without them).
    reads_tokens: Callable[[str], bool]


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
        self._settings = shared.settings
        self._store = store
        #: the declared KV groups, told to the store with the first batch applied
        self._groups = _declaration(spec)
        self._groups_told = self._groups is None
        self._intake = _Intake(shared.settings.intake_limit, shared.settings.intake_bytes)
        self._delivered = 0
        self._stopping = False
        self.failed = False  # the sequencer died of a bug: the subscriber is not ready
        self.fenced = False  # another owner took the rank: nothing more is applied
        self._losses_seen = 0  # the store's last loss this rank resynchronised after
        self._rebuild: _Rebuild | None = None
        # Sequencer state.
        self._mark: Watermark | None = None  # last applied batch
        self._seen: Watermark | None = None  # highest seq and highest ts received, this incarnation
        self._next = 0  # the seq to apply next
        self._pending: dict[int, tuple[bytes, float]] = {}  # held until ``_next`` reaches them
        self._pending_bytes = 0
        self._heap: list[int] = []  # the held seqs, lowest first
        self._gap: Gap | None = None  # the missing range being repaired
        self._gap_missed = False  # some of it was given up
        # Replay state.
        self._dealer: zmq.asyncio.Socket | None = None
        self._dealer_task: asyncio.Task | None = None
        self._generation = 0  # answers of an abandoned DEALER are ignored
        self._request: _Request | None = None
        self._replay_wanted = False
        self._attempts = 0
        self._unanswered = 0  # replay requests in a row that got no frame at all
        self._replay_activity = 0.0
        self._last_received = self._last_probe = time.monotonic()
        self._received_ts: float | None = None  # ts of the newest received batch
        self._queued: tuple[int, float] | None = None  # seq and ts of the newest live frame read
        self._ever_connected = False
        self._publisher_check: asyncio.TimerHandle | None = None

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
        sub = self._socket(zmq.SUB, self._settings.sub_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self._spec.topic.encode())
        try:
            with _socket_limit(self._shared.context):
                monitor = sub.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                )
        except BaseException:
            sub.close(linger=0)
            raise
        try:
            with _socket_limit(self._shared.context):
                (sub.bind if self._spec.bind else sub.connect)(self._endpoint())
        except BaseException:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            raise
        self._sub, self._monitor = sub, monitor
        name = f"{self.rank.engine}/{self.rank.dp_rank}"
        self._tasks = [
            asyncio.create_task(self._read_live(sub), name=f"live {name}"),
            asyncio.create_task(self._watch_connection(monitor), name=f"monitor {name}"),
        ]

    def _close_sub(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)

    async def stop(self) -> None:
        """Finish the batch in hand (up to ``stop_grace``), then close everything
        and drop what is queued or held, so the memory is returned at once."""
        self._stopping = True
        self._publisher_check.cancel()
        for task in self._tasks:
            task.cancel()
        if self._dealer_task is not None:
            self._dealer_task.cancel()
        self._wake()
        try:
            await asyncio.wait_for(self._runner, self._settings.stop_grace)
        except TimeoutError:
            log.warning("rank stop timed out", extra=self.ids())
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._request is not None:
            self._end_request()
        self._close_dealer()
        self._close_sub()
        self.status.connected = False
        self._intake.clear()
        self._forget_pending()

    def _socket(self, kind: int, hwm: int) -> zmq.asyncio.Socket:
        """A socket with the limits every consumer socket has."""
        with _socket_limit(self._shared.context):
            sock = self._shared.context.socket(kind)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._settings.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, round(self._settings.reconnect_max * 1000))
        return sock

    def _wake(self) -> None:
        """Have the sequencer look at its state now (it may be waiting for a batch)."""
        self._intake.put_nowait((_WAKE, 0, 0, b"", 0.0))

    def snapshot(self) -> RankStatus:
        """A copy of the status, with lag computed now (counting batches still queued)."""
        status, mark = self.status, self._mark
        last_seq, received_ts = status.last_seq, self._received_ts
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
        async for frames in _messages(sub):
            try:
                _, seq, payload = decode_frames(frames)
                ts = batch_ts(payload)
            except WireError as e:
                # Live garbage may come from anyone on the topic: count it, ignore its seq.
                self._reject(e)
                continue
            self._queued = (seq, ts)
            await self._deliver((_LIVE, 0, seq, payload, ts))

    async def _read_replay(self, dealer: zmq.asyncio.Socket, generation: int) -> None:
        async for frames in _messages(dealer):
            self._replay_activity = time.monotonic()
            try:
                seq, payload = split_replay(frames)
                if seq is None:
                    await self._deliver((_END, generation, 0, b"", 0.0))
                    continue
                if self._holds(seq, generation):
                    await self._deliver((_HELD, generation, seq, b"", 0.0))
                    continue
                ts = batch_ts(payload)
            except WireError as e:
                self._reject(e)  # the seq stays missing: replay attempts run out on it
                await self._deliver((_BAD, generation, 0, b"", 0.0))
                continue
            await self._deliver((_REPLAY, generation, seq, payload, ts))

    def _holds(self, seq: int, generation: int) -> bool:
        """Whether a replayed seq (not the anchor) is already held or applied.

        A replay after a gap re-sends everything since, most of it already
        received live: skipping its decoding is what lets a rank that fell
        behind catch up. It stays held until the sequencer sees it, unless the
        engine restarts, which abandons this replay generation.
        """
        request = self._request
        return (
            request is not None
            and generation == self._generation
            and seq > request.start
            and (seq < self._next or seq in self._pending)
        )

    async def _deliver(self, item: _Item) -> None:
        """Queue for the sequencer (waiting while it is full), yielding now and then:
        a ready socket never makes a receive wait, so a flood would hog the loop."""
        await self._intake.put(item)
        self._delivered += 1
        if self._delivered % _YIELD_EVERY == 0:
            await asyncio.sleep(0)

    def _received(self, seq: int, ts: float, live: bool) -> None:
        """A batch that decodes was received: the newest seq and ts may move."""
        status = self.status
        if live or status.last_seq is None or seq > status.last_seq:
            status.last_seq = seq
            self._received_ts = ts
        if status.last_event_ts is None or ts > status.last_event_ts:
            status.last_event_ts = ts
        self._last_received = time.monotonic()
        seen = self._seen
        if seen is None:
            self._seen = Watermark(seq, ts)
        elif seq > seen.seq or ts > seen.ts:
            self._seen = Watermark(max(seq, seen.seq), max(ts, seen.ts))

    def _check_groups(self, batch: EventBatch) -> None:
        """Count and log (once each) what events say against the declared KV groups."""
        for conflict in self._groups.conflicts(batch):
            self.status.kv_group_mismatches += 1
            self.metrics.kv_group_mismatches.inc()
            log.warning("kv group differs from its declaration", extra=self.ids(**conflict))

    def _reject(self, error: WireError) -> None:
        rejected = self.status.rejected
        rejected[error.reason] = rejected.get(error.reason, 0) + 1
        self.metrics.rejected(error.reason)
        if rejected[error.reason] == 1:
            log.warning("bad frame", extra=self.ids(reason=error.reason, detail=error.detail[:200]))

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
        self._close_sub()
        try:
            self._open_sub()
        except (OSError, zmq.ZMQError) as e:
            self.failed = True  # nothing more can be received: the subscriber is not ready
            log.error("cannot reopen the SUB socket", extra=self.ids(error=str(e)))

    def _connected(self) -> None:
        """A publisher is there: ask it soon whether anything was missed while it was not."""
        if self.status.never_connected:
            log.info("publisher found", extra=self.ids(endpoint=self._endpoint()))
        self._ever_connected = True
        self.status.never_connected = False
        self._unanswered = 0
        self._last_probe = self._last_received = float("-inf")  # a probe is due now
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

    # --- the sequencer -----------------------------------------------------------

    async def _run(self) -> None:
        try:
            self._mark = self._seen = await self._store_call(self._store.watermark, self.rank)
            self._next = self._mark.seq + 1 if self._mark else 0
            self.status.applied_seq = self._mark.seq if self._mark else None
            log.info("rank consuming", extra=self.ids(next_seq=self._next))
            self._replay_wanted = self._has_replay  # catch up from the watermark
            n = 0
            while not self._stopping:
                try:
                    await self._follow_store()
                    await self._tend_replay()
                    item = await self._take()
                    if item is not None:
                        await self._handle(*item)
                except StoreLost:
                    continue  # resynchronised next turn; the batch in hand comes back by replay
                n += 1
                if n % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except _Stopped:
            pass
        except Fenced as e:
            self.fenced = True
            log.warning("rank fenced: another owner took it", extra=self.ids(error=str(e)))
        except Exception:
            self.failed = True
            log.exception("rank consumer failed", extra=self.ids())

    async def _take(self) -> _Item | None:
        return await self._intake.get(self._idle_timeout())

    @property
    def _has_replay(self) -> bool:
        return self._spec.replay_endpoint is not None

    def _idle_timeout(self) -> float | None:
        """Seconds until the replay machinery has something to do; None: nothing
        (no publisher connected: replay is asked again when one connects)."""
        now = time.monotonic()
        if self._request is not None:
            return max(0.0, self._replay_deadline() - now)
        if not (self._has_replay and self.status.connected):
            return None
        if self._replay_wanted:
            return _SLOT_POLL
        if self._settings.probe_interval:
            return max(0.0, self._probe_due() - now)
        return None

    async def _handle(
        self, kind: int, generation: int, seq: int, payload: bytes, ts: float
    ) -> None:
        if kind == _LIVE:
            await self._offer(seq, payload, ts, live=True)
            return
        request = self._request
        if request is None or generation != self._generation:
            return  # a wake-up, or the answer to an abandoned request
        self._unanswered = 0
        if kind == _END:
            await self._replay_finished()
            return
        request.received += 1  # garbage too: an answer with frames is no empty buffer
        self._replay_activity = time.monotonic()  # progress, even if the reader waits on us
        if kind == _BAD:
            return
        if request.first_new is None and seq >= request.want:
            request.first_new = seq
        if kind == _HELD:
            self._duplicate()
        elif seq >= request.want or self._is_restart(seq, ts):
            # (an anchor offered is another incarnation's)
            await self._offer(seq, payload, ts, live=False)

    async def _offer(self, seq: int, payload: bytes, ts: float, live: bool) -> None:
        """Take one received batch into the ordered stream.

        Only a batch that decodes counts: a garbage payload behind a valid ts
        must not pass for an engine restart, nor move the newest seen seq.
        A batch applied at once is decoded once; one held behind a gap is
        decoded to check it, then kept encoded.
        """
        batch = None
        if self._is_restart(seq, ts):
            if (batch := self._decode(payload)) is None:
                return
            await self._restart(seq)
        if seq < self._next or seq in self._pending:
            self._duplicate()
            return
        if batch is None and (batch := self._decode(payload)) is None:
            return
        self._received(seq, ts, live)
        if seq == self._next and not self._heap:
            await self._apply(seq, batch, ts)
            return
        del batch
        self._pending[seq] = (payload, ts)
        self._pending_bytes += len(payload)
        heapq.heappush(self._heap, seq)
        settings = self._settings
        if (
            len(self._pending) > settings.max_pending
            or self._pending_bytes > settings.pending_bytes
        ) and self._heap[0] > self._next:
            await self._give_up(self._next, self._heap[0] - 1, "too many batches held")
        await self._drain()
        await self._watch_gap()

    def _duplicate(self) -> None:
        self.status.duplicates += 1
        self.metrics.duplicates.inc()

    def _is_restart(self, seq: int, ts: float) -> bool:
        """A seq already seen, from a newer batch: the engine numbers from 0 again.

        Newer than every batch seen, not just than that seq's, so an engine
        clock stepping back cannot pass for a restart; the last applied seq
        itself (a replay's first answer) is compared with its own ts.
        """
        mark, seen = self._mark, self._seen
        return (mark is not None and seq == mark.seq and ts > mark.ts) or (
            seen is not None and seq <= seen.seq and ts > seen.ts
        )

    def _decode(self, payload: bytes) -> EventBatch | None:
        """The batch, or None (counted) if the payload is none: its seq stays missing
        (replay may bring a good copy, or its attempts run out and the seq is given up)."""
        try:
            return decode_batch(payload, tokens=self._shared.reads_tokens(self.rank.engine))
        except WireError as e:
            self._reject(e)
            return None

    async def _apply(self, seq: int, batch: EventBatch, ts: float) -> None:
        applied = batch
        if self._groups is not None:
            self._check_groups(batch)
            if not self._groups_told:
                applied = self._groups.prepended(batch)
        result = await self._store_call(self._store.apply_batch, self.rank, seq, applied)
        self._mark = Watermark(seq, ts)
        self._next = seq + 1
        self.status.applied_seq = seq
        if not result.applied:  # the store had it already (another writer)
            self._duplicate()
            return
        self._groups_told = True
        self.metrics.batches.inc()
        self.metrics.block_ops.inc(result.block_ops)
        self._shared.notify(self.rank, batch)

    async def _drain(self) -> None:
        """Apply held batches while they continue the stream."""
        heap, pending = self._heap, self._pending
        while heap and heap[0] <= self._next:
            seq = heapq.heappop(heap)
            payload, ts = pending.pop(seq)
            self._pending_bytes -= len(payload)
            if seq == self._next and (batch := self._decode(payload)) is not None:
                await self._apply(seq, batch, ts)
        self._close_gap()

    def _forget_pending(self) -> None:
        self._pending.clear()
        self._heap.clear()
        self._pending_bytes = 0

    def _hole(self) -> tuple[int, int] | None:
        """The missing range before the lowest held batch, if any."""
        if self._heap and self._heap[0] > self._next:
            return self._next, self._heap[0] - 1
        return None

    async def _watch_gap(self) -> None:
        """Start repairing a hole, unless a repair or a replay is already under way."""
        while (hole := self._hole()) and self._gap is None and self._request is None:
            self._open_gap(*hole)
            if self._has_replay:
                self._replay_wanted = True
                return
            await self._give_up(*hole, "no replay endpoint")
            await self._drain()

    def _open_gap(self, first: int, last: int) -> None:
        self._gap = Gap(first, last, time.time())
        self._gap_missed = False
        self.status.gaps += 1
        self.metrics.gap("detected")
        log.info("gap", extra=self.ids(first=first, last=last))

    def _close_gap(self) -> None:
        gap = self._gap
        if gap is None or self._next <= gap.last:
            return
        self._gap = None
        if not self._gap_missed:
            gap.filled = True
            self.status.gaps_filled += 1
            self.metrics.gap("filled")
            log.info("gap filled", extra=self.ids(first=gap.first, last=gap.last))

    async def _give_up(self, first: int, last: int, why: str) -> None:
        """Declare ``first..last`` lost: degrade the rank and move past it."""
        if self._gap is None:
            self._open_gap(first, last)
        self._gap.last = max(self._gap.last, last)
        status = self.status
        if not self._gap_missed:
            self._gap_missed = True
            status.gaps_unfilled += 1
            self.metrics.gap("unfilled")
        status.missing.append(Gap(first, last, time.time()))
        del status.missing[: -self._settings.max_missing]
        status.degraded = True
        clear = last - first + 1 > self._settings.gap_clear_threshold
        log.warning("rank degraded", extra=self.ids(first=first, last=last, why=why, cleared=clear))
        if clear:
            await self._store_call(self._store.clear, self.rank, (GPU, CPU))
        self._next = last + 1
        self._attempts = 0
        self._close_gap()

    async def _restart(self, seq: int | None) -> None:
        """The engine restarted: forget its GPU/CPU counts and its numbering."""
        status = self.status
        status.restarts += 1
        self.metrics.restarts.inc()
        log.warning("engine restart", extra=self.ids(applied_seq=status.applied_seq, seq=seq))
        if self._request is not None:
            self._end_request()
            self._close_dealer()  # so a late answer to the abandoned request never arrives
        await self._store_call(self._store.clear, self.rank, (GPU, CPU), reset_seq=True)
        self._mark = self._seen = None
        self._next = 0
        self._forget_pending()
        self._gap = None
        self._attempts = 0
        status.applied_seq = None
        status.degraded = False
        status.store_loss = None  # the new incarnation's stream is whole
        status.missing = []
        self._replay_wanted = self._has_replay

    # --- the store losing data ---------------------------------------------------

    def notice_store_loss(self) -> None:
        """The store noticed a loss of data: resynchronise now, even if idle."""
        self._wake()

    async def _follow_store(self) -> None:
        """Resynchronise after a loss the store noticed and this rank has not seen yet."""
        loss = self._store.last_loss()
        if loss is not None and loss.number != self._losses_seen:
            await self._resync(loss)
        if self._rebuild is not None:
            self._check_rebuilt(self._rebuild)

    async def _resync(self, loss: Loss) -> None:
        """Continue from the store's watermark, asking replay for the batches after it.

        A rank whose stored watermark is its own lost nothing. Otherwise it is
        degraded, with the reason in its status, until the batches it had
        applied are applied again (:meth:`_check_rebuilt`).
        """
        self._losses_seen = loss.number
        stored = await self._store_call(self._store.watermark, self.rank)
        had, status = self._mark, self.status
        if stored == had:
            return
        if self._request is not None:
            self._end_request()
            self._close_dealer()  # so a late answer to the abandoned request never arrives
        self._mark = stored
        self._next = stored.seq + 1 if stored else 0
        self._forget_pending()
        self._gap, self._attempts = None, 0
        status.applied_seq = stored.seq if stored else None
        self._replay_wanted = self._has_replay
        if had is None or had.seq < self._next:
            return  # the store is ahead (another writer): nothing of ours was lost
        lost = f"batches {self._next}..{had.seq}"
        self._begin_rebuild(had.seq, loss.reason, lost, loss.wiped or not status.degraded)

    def rebuilding(self, last: int, reason: str) -> None:
        """The rank's previous consumer here had applied up to ``last`` when the store
        lost data (a worker claiming it anew): degraded until that is applied again."""
        self._begin_rebuild(last, reason, f"batches up to {last}", clean=True)

    def _begin_rebuild(self, last: int, reason: str, lost: str, clean: bool) -> None:
        status = self.status
        self._rebuild = _Rebuild(last, reason, status.restarts, status.gaps_unfilled, clean)
        status.degraded = True
        status.store_loss = f"{reason}; {lost} lost, being applied again from replay"
        log.warning("store lost batches", extra=self.ids(lost=lost))

    def _check_rebuilt(self, rebuild: _Rebuild) -> None:
        """End a rebuild once it is settled: exact again, or degraded for good.

        Exact when every lost batch was applied again with no gap given up
        meanwhile, or when the engine restarted (its new stream is whole);
        a rank that was already degraded stays so unless it lost everything
        and replay brought it all back.
        """
        status = self.status
        if status.restarts != rebuild.restarts:
            exact = True
        elif self._next > rebuild.last:
            exact = status.gaps_unfilled == rebuild.gaps_unfilled
        else:
            return
        self._rebuild = None
        if exact:
            status.store_loss = None
            status.degraded = status.degraded and not rebuild.clean
            log.info("rank rebuilt after a store loss", extra=self.ids(last=rebuild.last))
            return
        missing = status.missing[-1] if status.missing else None
        lost = f" (batches {missing.first}..{missing.last} missing)" if missing else ""
        status.store_loss = f"{rebuild.reason}; replay could not apply every lost batch{lost}"
        log.warning("rank not rebuilt after a store loss", extra=self.ids(last=rebuild.last))

    async def _store_call(self, call: Callable[..., Awaitable[T]], *args: Any, **kw: Any) -> T:
        """Call the store until it succeeds: a batch in hand is never dropped."""
        delay, failing = min(0.05, self._settings.store_retry_max), False
        while True:
            try:
                result = await call(*args, **kw)
            except (Fenced, StoreLost):
                raise
            except Exception as e:
                self.status.store_errors += 1
                self.metrics.store_errors.inc()
                if not failing:
                    failing = True
                    log.warning("store failing, retrying", extra=self.ids(error=repr(e)[:200]))
                if self._stopping:
                    raise _Stopped from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._settings.store_retry_max)
                continue
            if failing:
                log.info("store back", extra=self.ids())
            return result

    # --- replay ------------------------------------------------------------------

    def _open_dealer(self) -> zmq.asyncio.Socket:
        """The DEALER of the next request: opened only when one is sent, and kept
        while the engine answers. A whole replay buffer may arrive at once: the
        reader stops reading when the intake is full, and ``replay_hwm`` bounds
        what ZeroMQ queues meanwhile (the ROUTER drops the rest: the missing
        seqs are asked again)."""
        if self._dealer is None:
            self._generation += 1
            dealer = self._socket(zmq.DEALER, self._settings.replay_hwm)
            # One connection per request: a broken one times the request out, and
            # a reconnection could continue a message it cut short (see _replace_sub).
            dealer.setsockopt(zmq.RECONNECT_IVL, -1)
            with _socket_limit(self._shared.context):
                dealer.connect(self._spec.rank_endpoint(self.rank.dp_rank, replay=True))
            self._dealer = dealer
            self._dealer_task = asyncio.create_task(self._read_replay(dealer, self._generation))
        return self._dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer_task.cancel()
            self._dealer.close(linger=0)
            self._dealer = self._dealer_task = None

    def _replay_deadline(self) -> float:
        request = self._request
        return max(request.sent_at, self._replay_activity) + self._settings.replay_timeout

    def _probe_due(self) -> float:
        """When the next probe is due: ``probe_interval`` after the last batch or
        probe, doubled for each probe in a row that got no answer, up to
        ``probe_backoff_max``."""
        settings = self._settings
        wait = min(
            settings.probe_interval * 2 ** min(self._unanswered, 32), settings.probe_backoff_max
        )
        return max(self._last_received, self._last_probe) + wait

    async def _tend_replay(self) -> None:
        """Time out, or send, a replay request when one is due (and a publisher is there)."""
        if not self._has_replay:
            return
        now = time.monotonic()
        if self._request is not None:
            if now >= self._replay_deadline():
                await self._replay_timed_out()
            return
        if not self.status.connected:
            return
        probe = not self._replay_wanted
        if probe and not (self._settings.probe_interval and now >= self._probe_due()):
            return
        slots = self._shared.replay_slots
        if slots.locked():
            return
        await slots.acquire()
        mark = self._mark
        # Ask from the last applied seq itself: its answer proves the same incarnation.
        start = mark.seq if mark is not None and mark.seq == self._next - 1 else self._next
        try:
            dealer = self._open_dealer()
        except BaseException:
            slots.release()
            raise
        self._request = _Request(start, self._next, now, probe)
        self._replay_wanted = False
        self._last_probe = now  # any request asks what a probe would
        if not probe:
            self.status.replays += 1
            self.metrics.replays.inc()
        # A kept DEALER whose engine restarted has no peer (it never reconnects) and would
        # block the sequencer here: unsent, the request times out and the next connects anew.
        with contextlib.suppress(zmq.Again):
            await dealer.send_multipart((b"", start.to_bytes(SEQ_BYTES, "big")), zmq.NOBLOCK)

    def _end_request(self) -> _Request:
        request, self._request = self._request, None
        self._shared.replay_slots.release()
        return request

    async def _replay_finished(self) -> None:
        request = self._end_request()
        if request.start < request.want and request.received == 0:
            # The engine published the asked-for seq; a buffer without it is a new incarnation's.
            await self._restart(None)
            return
        if request.first_new is not None and request.first_new > self._next:
            await self._give_up(self._next, request.first_new - 1, "not in the replay buffer")
        await self._drain()
        hole = self._hole()
        if hole is not None:
            self._attempts = 0 if self._next > request.want else self._attempts + 1
            if self._attempts < self._settings.replay_attempts:
                if self._gap is None:
                    self._open_gap(*hole)
                self._replay_wanted = True
                return
            await self._give_up(*hole, "replay did not fill it")
            await self._drain()
        self._attempts = 0
        await self._watch_gap()

    async def _replay_timed_out(self) -> None:
        request = self._end_request()
        self._close_dealer()  # so a late answer never arrives
        if request.received == 0:
            self._unanswered += 1
        # Said once per silence: a replay endpoint that never answers is retried for ever.
        level = logging.INFO if self._unanswered <= 1 else logging.DEBUG
        log.log(level, "replay timed out", extra=self.ids(start=request.start))
        if not request.probe:
            self._attempts = 0 if self._next > request.want else self._attempts + 1
            if self._attempts < self._settings.replay_attempts:
                self._replay_wanted = True
                return
            self._attempts = 0
            endpoint = self._spec.rank_endpoint(self.rank.dp_rank, replay=True)
            log.warning(
                f"replay unavailable: no answer from {endpoint} in {self._settings.replay_attempts}"
                " requests; check the engine's --kv-events-config replay_endpoint",
                extra=self.ids(start=request.start, endpoint=endpoint),
            )
            hole = self._hole()
            if hole is not None:
                await self._give_up(*hole, "replay unavailable")
                await self._drain()
        await self._watch_gap()
