"""The live side of one rank: its SUB socket, the reader, the connection monitor.

The reader splits frames into the rank's intake as fast as they come (only
a batch's ts is read on the way in); the monitor follows the publisher's
connections, replaces the SUB socket after a disconnection, and says once,
in words, when no publisher has ever connected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.core.events import WireError
from indexer.engine_registry import EngineSpec, RankStatus
from indexer.ingest.intake import LIVE, Item
from indexer.ingest.settings import SubscriberSettings
from indexer.ingest.sockets import close_sub, messages, open_sub

log = logging.getLogger("kvindex.subscriber")
#: Seconds a connecting SUB's retry may take to follow a disconnection (libzmq
#: reports both from its I/O thread at once) before the disconnection counts as its own.
_RETRY_WAIT = 0.2


class LiveFeed:
    """One rank's SUB socket and the tasks reading it and its monitor.

    ``deliver`` queues a live item; ``reject`` counts a bad frame;
    ``connected`` is called when a publisher appears; ``ids`` names the rank
    in logs. ``status.connected`` and ``status.never_connected`` are kept here.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        settings: SubscriberSettings,
        spec: EngineSpec,
        status: RankStatus,
        deliver: Callable[[Item], Awaitable[None]],
        reject: Callable[[WireError], None],
        connected: Callable[[], None],
        ids: Callable[..., dict[str, Any]],
    ) -> None:
        self._context, self._settings, self._spec, self._status = context, settings, spec, status
        self._deliver, self._reject, self._on_connected, self._ids = deliver, reject, connected, ids
        self.endpoint = spec.rank_endpoint(status.dp_rank) or ""
        self._adapter = spec.engine_adapter
        self.queued: tuple[int, float] | None = None  # seq and ts of the newest frame read
        self.failed = False  # the SUB socket could not be reopened: nothing more arrives
        self._ever_connected = False
        self._stopping = False
        self._publisher_check: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open the SUB socket (raises if it cannot) and start reading it."""
        self._open()
        self._publisher_check = asyncio.get_running_loop().call_later(
            self._settings.no_publisher_after, self._check_publisher
        )

    def _open(self) -> None:
        spec = self._spec
        sub, monitor = open_sub(self._context, self._settings, spec.topic, self.endpoint, spec.bind)
        self._sub, self._monitor = sub, monitor
        name = f"{spec.name}/{self._status.dp_rank}"
        self._tasks = [
            asyncio.create_task(self._read(sub), name=f"live {name}"),
            asyncio.create_task(self._watch(monitor), name=f"monitor {name}"),
        ]

    def stop_reading(self) -> None:
        self._stopping = True
        self._publisher_check.cancel()
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """After :meth:`stop_reading`: wait for the tasks, close the sockets."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        close_sub(self._sub, self._monitor)
        self._status.connected = False

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        split, batch_ts = self._adapter.split_live, self._adapter.batch_ts
        async for frames in messages(sub):
            try:
                seq, payload = split(frames)
                ts = batch_ts(payload)
            except WireError as e:
                # Live garbage may come from anyone on the topic: count it, ignore its seq.
                self._reject(e)
                continue
            self.queued = (seq, ts)
            await self._deliver((LIVE, 0, seq, payload, ts))

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        peers, status = 0, self._status
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            why = None
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                peers = max(0, peers - 1)
                why = await self._why_disconnected(monitor)
            if (peers > 0) != status.connected:
                status.connected = peers > 0
                if peers:
                    log.info("rank connected", extra=self._ids())
                    self._connected()
                else:
                    log.info("rank disconnected", extra=self._ids(reason=why))
            if event == zmq.EVENT_DISCONNECTED and not self._spec.bind:
                self._replace()
                return

    async def _why_disconnected(self, monitor: zmq.asyncio.Socket) -> str:
        """Why the publisher went, as far as ZeroMQ tells, in words.

        libzmq cuts a connection whose next frame announces more than
        ``max_message_bytes`` and reports only a disconnection. A connecting SUB
        then says which it was: after the peer closed it retries at once, after a
        protocol error (from a real publisher, that frame) never. The second is
        counted as a rejected frame (``oversize``). An engine that connects to
        kvindex (``bind``) reconnects by itself either way: there the two look alike.
        """
        limit = self._settings.max_message_bytes
        if self._spec.bind:
            return (
                "the engine closed the connection, or sent a frame over max_message_bytes"
                f" ({limit} bytes): ZeroMQ does not tell them apart when the engine connects"
            )
        try:  # not wait_for: on 3.11 it can swallow a stop's cancellation
            async with asyncio.timeout(_RETRY_WAIT):
                after = await monitor.recv_multipart()
        except TimeoutError:
            after = None
        if after is not None and parse_monitor_message(after)["event"] == zmq.EVENT_CONNECT_RETRIED:
            return "the publisher closed the connection"
        why = (
            "ZeroMQ dropped the publisher for breaking the protocol, most likely with a frame"
            f" over max_message_bytes ({limit} bytes)"
        )
        self._reject(WireError("oversize", why))
        return why

    def _replace(self) -> None:
        """A fresh SUB socket after a disconnection. ZeroMQ reconnects after a
        network error but gives up on a peer that broke the protocol (a frame
        over ``max_message_bytes``), which would leave the rank deaf for good;
        and a message cut short by the disconnection must not be continued by
        the next connection's frames (libzmq aborts the process on that)."""
        self._tasks[0].cancel()  # the reader: it never touches the old socket again
        close_sub(self._sub, self._monitor)
        try:
            self._open()
        except OSError as e:  # zmq.ZMQError is an OSError
            self.failed = True  # nothing more can be received: the subscriber is not ready
            log.error("cannot reopen the SUB socket", extra=self._ids(error=str(e)))

    def _connected(self) -> None:
        if self._status.never_connected:
            log.info("publisher found", extra=self._ids(endpoint=self.endpoint))
        self._ever_connected = True
        self._status.never_connected = False
        self._on_connected()

    def _check_publisher(self) -> None:
        """Say once, in words, that a rank has had no publisher since it started."""
        if self._ever_connected or self._stopping:
            return
        self._status.never_connected = True
        endpoint, waited = self.endpoint, self._settings.no_publisher_after
        if self._spec.bind:
            problem = f"no engine connected to {endpoint} in {waited:g} s"
            fix = "point the engine's --kv-events-config endpoint at this address"
        else:
            problem = f"no publisher at {endpoint}: nothing answered in {waited:g} s"
            fix = (
                "check that the engine runs with --kv-events-config publishing on this"
                " host and port (or set bind: true if the engine connects to kvindex)"
            )
        log.warning(f"{problem}; {fix}", extra=self._ids(endpoint=endpoint))
