"""A vLLM-wire-compatible KV event publisher: ZMQ PUB plus a replay ROUTER.

By default byte for byte what vLLM 0.33's ``ZmqEventPublisher`` puts on the
wire, so a consumer cannot tell the two apart (another engine adapter's
``adapter`` makes it speak that engine's wire): PUB multipart ``[topic, seq, payload]``
with ``seq`` 8-byte big-endian from 0, +1 per batch; a ROUTER that answers
``[id, b"", start_seq]`` with ``[id, b"", seq, payload]`` for every buffered
batch with ``seq >= start`` and then the end marker ``[id, b"", -1, b""]``;
data-parallel rank r on port + r of both endpoints.

Publishing never blocks the engine: batches go through a bounded queue to a
background thread that numbers, encodes and sends them. A batch that finds
the queue full is dropped and counted, and its seq is still consumed, so a
consumer sees a permanent hole (and marks itself degraded) rather than
silently missing events.

Faults that real deployments produce, as explicit options for tests, demos
and load runs: ``holes`` are seqs consumed but never sent nor buffered (what
vLLM does when a send fails), ``drop_live`` are seqs buffered for replay but
not sent live (a subscriber-side loss that replay repairs), and a small
``buffer_steps`` makes replay come back short.

Imports only msgspec, pyzmq, the standard library, :mod:`indexer.core.events`
and the engine adapters (:mod:`indexer.engines`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Collection
from typing import NamedTuple

import msgspec
import zmq

from indexer.core.events import EventBatch, WireError
from indexer.engines import catalog
from indexer.engines.base import EngineAdapter

log = logging.getLogger("kvindex.publisher")


def binds_by_default(endpoint: str) -> bool:
    """vLLM's heuristic: bind wildcard, ipc and inproc endpoints, connect the rest."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class _Item(NamedTuple):
    batch: EventBatch | bytes | None  # bytes: already encoded; None: stop
    holes_before: int  # batches dropped on a full queue just before this one


#: Seconds :meth:`Publisher.close` waits for ZeroMQ to release a private context.
CONTEXT_END_WITHIN = 10.0


def _end_context(context: zmq.Context) -> None:
    """Destroy ``context`` without hanging the caller.

    Termination waits on ZeroMQ's own threads, and on a loaded machine it was seen
    not to return (300 s) after every socket had been closed with no linger. The
    sockets are closed either way; past the bound only the context's threads and
    ports may outlive the publisher, which the warning says.
    """
    ender = threading.Thread(
        target=context.destroy, kwargs={"linger": 0}, daemon=True, name="kv-publisher-end"
    )
    ender.start()
    ender.join(CONTEXT_END_WITHIN)
    if ender.is_alive():
        log.warning("publisher context not ended", extra={"within_s": CONTEXT_END_WITHIN})


class Publisher:
    """Publish :class:`~indexer.core.events.EventBatch` es as one engine's dp rank.

    ``endpoint``/``replay_endpoint`` are the rank-0 addresses, offset by
    ``data_parallel_rank`` as vLLM does. ``bind`` None follows vLLM's
    bind-or-connect heuristic for the PUB socket; the replay ROUTER always
    binds. The bound addresses (useful with port 0) are :attr:`endpoint` and
    :attr:`replay_endpoint`.
    """

    #: How long the idle thread waits for a batch before looking at replay again.
    IDLE_POLL = 0.05

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        data_parallel_rank: int = 0,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        bind: bool | None = None,
        holes: Collection[int] = (),
        drop_live: Collection[int] = (),
        context: zmq.Context | None = None,
        adapter: EngineAdapter | None = None,
    ) -> None:
        self._adapter = adapter = adapter or catalog.adapter(catalog.DEFAULT)
        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._holes = frozenset(holes)
        self._drop_live = frozenset(drop_live)
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self._pending_holes = 0
        self._enqueued = 0
        self._offered = 0  # batches given to publish, sent or dropped: each takes a seq
        self._processed = 0
        self._next_seq = 0
        self.dropped = 0
        self.replays_served = 0
        self._closed = False
        self._give_up_at = 0.0  # when closing: stop sending after this (monotonic)

        # A context of its own unless given one: closing it frees the ports at once,
        # so a restarted publisher in the same process can bind them again.
        self._context = context or zmq.Context()
        self._owns_context = context is None
        ctx = self._context
        pub_endpoint = adapter.rank_endpoint(endpoint, data_parallel_rank)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if binds_by_default(pub_endpoint) if bind is None else bind:
            self._pub.bind(pub_endpoint)
            pub_endpoint = self._pub.get(zmq.LAST_ENDPOINT).decode()
        else:
            self._pub.connect(pub_endpoint)
        self.endpoint: str = pub_endpoint
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            # A whole buffer answers one request: never let the ROUTER drop part of it.
            self._replay.set_hwm(buffer_steps + 1)
            self._replay.bind(adapter.rank_endpoint(replay_endpoint, data_parallel_rank))
            self.replay_endpoint = self._replay.get(zmq.LAST_ENDPOINT).decode()

        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kv-publisher-dp{data_parallel_rank}"
        )
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The seq the next batch taken off the queue will get."""
        return self._next_seq

    @property
    def last_offered_seq(self) -> int:
        """The seq of the last batch given to publish (sent or not yet, or dropped on a
        full queue); -1 before the first. What the engine had published by then is
        what a snapshot taken now is exact as of."""
        return self._offered - 1

    def publish(self, batch: EventBatch) -> bool:
        """Queue a batch without blocking; False if the queue was full (dropped)."""
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._rank)
        return self._enqueue(batch)

    def publish_encoded(self, payload: bytes) -> bool:
        """Queue an already encoded batch, sent as is: a recorded trace re-published
        byte for byte, or a load generator that encodes once."""
        return self._enqueue(payload)

    def _enqueue(self, batch: EventBatch | bytes) -> bool:
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._lock:
            self._offered += 1
            try:
                self._queue.put_nowait(_Item(batch, self._pending_holes))
            except queue.Full:
                self.dropped += 1
                self._pending_holes += 1
                return False
            self._pending_holes = 0
            self._enqueued += 1
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued so far has been sent; False on timeout."""
        target = self._enqueued
        with self._progress:
            return self._progress.wait_for(lambda: self._processed >= target, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued for up to ``timeout`` seconds (the rest is dropped),
        stop the thread, close the sockets."""
        if self._closed:
            return
        self._give_up_at = time.monotonic() + timeout
        self._closed = True
        with contextlib.suppress(queue.Full):  # if full, the thread stops at the deadline
            self._queue.put(_Item(None, 0), timeout=timeout)
        self._thread.join()
        if self._processed < self._enqueued:
            log.warning(
                "publisher closed with batches unsent",
                extra={"unsent": self._enqueued - self._processed},
            )
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._owns_context:
            _end_context(self._context)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- background thread ---------------------------------------------------

    def _run(self) -> None:
        while not (self._closed and time.monotonic() > self._give_up_at):
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=self.IDLE_POLL)
            except queue.Empty:
                continue
            if item.batch is None:
                return
            self._next_seq += item.holes_before
            self._send(item.batch)
            with self._progress:
                self._processed += 1
                self._progress.notify_all()

    def _send(self, batch: EventBatch | bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        if seq in self._holes:
            return
        payload = batch if type(batch) is bytes else self._adapter.encode(batch)
        if seq not in self._drop_live:
            try:
                self._pub.send_multipart(self._adapter.live_frames(self._topic, seq, payload))
            except zmq.ZMQError:
                # vLLM's behaviour: the seq is spent and never buffered, a permanent hole.
                log.exception("publish failed", extra={"seq": seq})
                time.sleep(0.1)
                return
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        client, *frames = self._replay.recv_multipart()
        try:
            start = self._adapter.replay_start(frames)
        except WireError:
            log.warning("invalid replay request", extra={"frames": len(frames) + 1})
            return
        self.replays_served += 1
        answer = self._adapter.replay_answer
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart([client, *answer(seq, payload)])
        self._replay.send_multipart([client, *answer(None, b"")])
