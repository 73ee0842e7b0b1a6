"""The replay client of one rank: a DEALER to the engine's replay ROUTER, opened per need.

A request asks for every buffered batch from a start seq on; the engine
answers with each of them, then an end marker (the frames are the engine
adapter's). Answers are read into the
rank's intake, tagged with the DEALER's generation: closing the DEALER
(a timeout, an engine restart) starts a new generation, so a late answer
to an abandoned request is recognised and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from indexer.core.events import WireError
from indexer.engines.base import EngineAdapter
from indexer.ingest.intake import BAD, END, HELD, REPLAY, Item
from indexer.ingest.settings import REPLAY_HWM, SubscriberSettings
from indexer.ingest.sockets import messages, open_socket, socket_limit


class ReplayClient:
    """The DEALER of the next request: opened only when one is sent, and kept
    while the engine answers. A whole replay buffer may arrive at once: the
    reader stops reading when the intake is full, and ``REPLAY_HWM`` bounds
    what ZeroMQ queues meanwhile (the ROUTER drops the rest: the missing
    seqs are asked again).

    ``holds(seq)``: whether a replayed seq is already held or applied (its ts
    is then not even read); ``activity(now)``: a frame arrived;
    ``reject(error)``: a frame was no batch.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        settings: SubscriberSettings,
        adapter: EngineAdapter,
        endpoint: str,
        deliver: Callable[[Item], Awaitable[None]],
        holds: Callable[[int], bool],
        activity: Callable[[float], None],
        reject: Callable[[WireError], None],
    ) -> None:
        self._context, self._settings, self.endpoint = context, settings, endpoint
        self._adapter = adapter
        self._deliver, self._holds, self._activity, self._reject = deliver, holds, activity, reject
        self._dealer: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self.generation = 0  # answers of an abandoned DEALER are ignored

    def open(self) -> None:
        """Have a DEALER connected (raises if no socket can be opened)."""
        if self._dealer is not None:
            return
        self.generation += 1
        dealer = open_socket(self._context, self._settings, zmq.DEALER, REPLAY_HWM)
        # One connection per request: a broken one times the request out, and a
        # reconnection could continue a message it cut short (libzmq aborts on that).
        dealer.setsockopt(zmq.RECONNECT_IVL, -1)
        try:
            with socket_limit(self._context):
                dealer.connect(self.endpoint)
        except BaseException:
            dealer.close(linger=0)
            raise
        self._dealer = dealer
        self._reader = asyncio.create_task(self._read(dealer, self.generation))

    async def ask(self, start: int) -> None:
        """Send a request from ``start`` on the open DEALER.

        A kept DEALER whose engine restarted has no peer (it never reconnects)
        and would block here: unsent, the request times out and the next
        connects anew.
        """
        with contextlib.suppress(zmq.Again):
            await self._dealer.send_multipart(self._adapter.replay_request(start), zmq.NOBLOCK)

    def close(self) -> None:
        """Close the DEALER, so no answer to a request sent on it ever arrives."""
        if self._dealer is not None:
            self._reader.cancel()
            self._dealer.close(linger=0)
            self._dealer = self._reader = None

    def stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self, dealer: zmq.asyncio.Socket, generation: int) -> None:
        async for frames in messages(dealer):
            self._activity(time.monotonic())
            await self._deliver(self._item(frames, generation))

    def _item(self, frames: list[bytes], generation: int) -> Item:
        try:
            seq, payload = self._adapter.split_replay(frames)
            if seq is None:
                return END, generation, 0, b"", 0.0
            if generation == self.generation and self._holds(seq):
                return HELD, generation, seq, b"", 0.0
            return REPLAY, generation, seq, payload, self._adapter.batch_ts(payload)
        except WireError as e:
            self._reject(e)  # the seq stays missing: replay attempts run out on it
            return BAD, generation, 0, b"", 0.0
