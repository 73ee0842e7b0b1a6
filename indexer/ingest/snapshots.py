"""Asking an engine for a snapshot of one rank's residency, and when.

A rank whose engine announces a ``snapshot_endpoint`` (kvindex's vLLM plugin
answers there, from inside the engine) asks it for one whenever replay could
not fill a range: a start after the engine's replay buffer moved on, a gap
given up, a store that lost data. The sequencer holds the rank's batches from
the request on; the answer, applied as the rank's whole state
(:func:`~indexer.stores.base.apply_snapshot`), makes it exact again
(:mod:`indexer.core.sequencer`). Each request has a DEALER of its own, a
timeout, and a bound on the answer's size; a process runs at most
``max_concurrent_snapshots`` at once, so a fleet restarting together does not
make every engine serialise its cache at the same moment. An answer that is
no snapshot, or asks for more than the rank may hold
(:func:`~indexer.core.snapshot.beyond_capacity`), is refused before anything
is built from it, counted among the rank's rejections by reason: the rank
stays degraded and asks again later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio

from indexer.core.events import WireError
from indexer.core.snapshot import (
    SNAPSHOT_OVER_CAPACITY,
    Snapshot,
    SnapshotRefused,
    answered_snapshot,
    beyond_capacity,
    snapshot_request,
)
from indexer.ingest.settings import Shared
from indexer.ingest.sockets import socket_limit

#: What a request ended with: the snapshot, or why there is none.
Outcome = Snapshot | str


async def fetch_snapshot(
    context: zmq.asyncio.Context,
    endpoint: str,
    token: str | None,
    timeout: float,
    max_bytes: int,
) -> Snapshot:
    """One rank's snapshot from ``endpoint``; raises :class:`SnapshotRefused`,
    :class:`WireError` or :class:`TimeoutError`."""
    with socket_limit(context):
        dealer = context.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # a larger answer drops the connection
        dealer.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection: a broken one times out
        dealer.connect(endpoint)
        async with asyncio.timeout(timeout):
            await dealer.send_multipart(snapshot_request(token))
            return answered_snapshot(await dealer.recv_multipart(copy=True))
    finally:
        dealer.close(linger=0)


class SnapshotFetch:
    """The snapshot request of one rank, in flight in a task of its own while the
    rank's loop goes on (holding batches); the loop takes its outcome when
    :attr:`done` and is woken by ``wake`` then. ``bounds``: the blocks the rank may
    hold per medium; ``reject``: counts an answer refused, by reason."""

    def __init__(
        self,
        shared: Shared,
        endpoint: str,
        wake: Callable[[], None],
        bounds: Mapping[str, int],
        reject: Callable[[WireError], None],
    ) -> None:
        self._shared, self.endpoint, self._wake = shared, endpoint, wake
        self._bounds, self._reject = bounds, reject
        self._task: asyncio.Task[Outcome] | None = None

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def start(self) -> bool:
        """Send a request if none is in flight and a slot is free; whether one was sent."""
        slots = self._shared.snapshot_slots
        if self._task is not None or slots.locked():
            return False
        await slots.acquire()  # free: does not wait
        self._task = asyncio.create_task(self._fetch())
        return True

    def take(self) -> Outcome:
        """The outcome of the request that is :attr:`done`."""
        task, self._task = self._task, None
        return task.result()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _fetch(self) -> Outcome:
        settings = self._shared.settings
        try:
            snapshot = await fetch_snapshot(
                self._shared.context,
                self.endpoint,
                self._shared.token,
                settings.snapshot_timeout,
                settings.snapshot_bytes,
            )
            if (excess := beyond_capacity(snapshot, self._bounds)) is not None:
                raise WireError(SNAPSHOT_OVER_CAPACITY, excess)
            return snapshot
        except SnapshotRefused as e:
            return f"refused by the engine ({e})"
        except WireError as e:
            self._reject(e)
            return f"not accepted ({e})"
        except TimeoutError:
            return f"no answer in {settings.snapshot_timeout:g} s"
        except zmq.ZMQError as e:
            return f"cannot ask: {e}"
        finally:
            self._shared.snapshot_slots.release()
            with contextlib.suppress(Exception):
                self._wake()
