"""The engine side of snapshots: answering kvindex with a rank's whole residency.

kvindex asks an engine rank for a snapshot when replay cannot bring what it
missed (:mod:`indexer.ingest.snapshots`). Three parts, engine-neutral:

- :class:`SnapshotServer`: a ROUTER on a thread of its own. It checks each
  request's token, takes one snapshot at a time (requests beyond
  ``backlog`` wait in ZeroMQ's queue, then are dropped: the asker times out
  and asks again later), encodes it off the engine's thread and answers.
- :class:`Handoff`: a snapshot must be taken on the engine's own thread,
  between two steps, when everything it changed is published: the server
  thread asks, the engine thread looks at :attr:`Handoff.wanted` (one
  attribute read: nothing more while nobody asks) and gives.
- :class:`PublishedResidency`: counts kept from the batches an engine
  publishes, for tiers the engine has no table of its own for (a CPU offload
  as its events announced it; a simulated engine's every tier): the caller
  gives it the events of those tiers.

The snapshot's ``seq`` is the last batch published before it was taken,
numbered as the publisher numbers them.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from indexer.core.events import EventBatch
from indexer.core.residency import RankResidency, plan_batch
from indexer.core.snapshot import (
    BUSY,
    DENIED,
    FAILED,
    NOTHING_PUBLISHED,
    OK,
    Snapshot,
    encode_snapshot,
    requested_token,
    snapshot_answer,
    snapshot_of,
)

log = logging.getLogger("kvindex.snapshots")

#: A snapshot's ``(seq, ts)``: the last batch published before it.
Published = tuple[int, float]


class Handoff:
    """A snapshot asked for on one thread and taken on the engine's."""

    def __init__(self) -> None:
        self.wanted = False  # read by the engine thread at every chance it has
        self._taken = threading.Event()
        self._lock = threading.Lock()
        self._result: Snapshot | None = None

    def ask(self, timeout: float, wake: Callable[[], None] = lambda: None) -> Snapshot | None:
        """Ask, wake the engine (it may be idle) and wait; None: not taken in time."""
        with self._lock:
            self._taken.clear()
            self._result = None
            self.wanted = True
        wake()
        taken = self._taken.wait(timeout)
        with self._lock:
            self.wanted = False
            return self._result if taken else None

    def give(self, take: Callable[[], Snapshot]) -> None:
        """On the engine thread, at a moment its state is all published: take the
        snapshot if one is still wanted."""
        with self._lock:
            if not self.wanted:
                return
            self._result = take()
            self.wanted = False
            self._taken.set()


class PublishedResidency:
    """Counts as kvindex keeps them, from the batches the engine publishes."""

    def __init__(self) -> None:
        self.residency = RankResidency()
        self.last: Published = (NOTHING_PUBLISHED, 0.0)

    def published(self, seq: int, batch: EventBatch) -> None:
        self.residency.apply(plan_batch(batch))
        self.last = (seq, batch.ts)

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.residency, *self.last)


class SnapshotServer:
    """Answers snapshot requests at ``endpoint`` (bound) with ``take()``'s snapshot.

    ``token``: what a request must carry (compared in constant time); ``take``
    runs on the server's thread and may wait for the engine (:class:`Handoff`);
    it returns None when no snapshot could be taken (answered ``failed``).
    """

    POLL = 0.2  # seconds between looks at whether to stop

    def __init__(
        self,
        endpoint: str,
        token: str,
        take: Callable[[], Snapshot | None],
        *,
        backlog: int = 4,
        context: zmq.Context | None = None,
    ) -> None:
        if not token:
            raise ValueError("a snapshot server needs a token: snapshots are the engine's state")
        self._token, self._take = token.encode(), take
        self._context = context or zmq.Context.instance()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, backlog)
        self._router.setsockopt(zmq.MAXMSGSIZE, 4096)  # a request is a few bytes
        self._router.bind(endpoint)
        self.endpoint = self._router.get(zmq.LAST_ENDPOINT).decode()
        self.served = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvindex-snapshots", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._router.poll(self.POLL * 1000):
                    self._answer(self._router.recv_multipart())
        except Exception:  # never the engine's problem
            log.exception("snapshot server stopped")
        finally:
            self._router.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        client, request = frames[0], frames[1:]
        token = requested_token(request)
        if token is None or not hmac.compare_digest(token.encode(), self._token):
            reply = (DENIED, b"not a snapshot request with this engine's token")
        else:
            reply = self._snapshot()
        with contextlib.suppress(zmq.Again):  # an asker gone or flooding: not waited for
            self._router.send_multipart([client, *snapshot_answer(*reply)], zmq.NOBLOCK)

    def _snapshot(self) -> tuple[bytes, bytes]:
        try:
            snapshot = self._take()
        except Exception as e:
            log.exception("snapshot failed")
            return FAILED, f"{type(e).__name__}: {e}".encode()
        if snapshot is None:
            return BUSY, b"the engine did not reach a point between steps in time"
        self.served += 1
        log.info("snapshot served", extra={"seq": snapshot.seq, "blocks": snapshot.blocks})
        return OK, encode_snapshot(snapshot)


class SelfSnapshotting:
    """A publisher whose engine answers snapshots from the batches it publishes (a
    simulated engine: it has no table of its own to read).

    Publishing and counting a batch happen under one lock, which a snapshot
    takes too: what it holds is exactly the batches up to its seq.
    """

    def __init__(self, publisher: Any, endpoint: str, token: str) -> None:
        self.publisher = publisher
        self._published = PublishedResidency()
        self._lock = threading.Lock()
        self.server = SnapshotServer(endpoint, token, self._take)

    def publish(self, batch: EventBatch) -> bool:
        with self._lock:
            sent = self.publisher.publish(batch)
            self._published.published(self.publisher.last_offered_seq, batch)
        return sent

    def _take(self) -> Snapshot:
        with self._lock:
            return self._published.snapshot()

    def close(self) -> None:
        self.server.close()
        self.publisher.close()
