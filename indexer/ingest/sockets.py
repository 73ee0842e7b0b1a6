"""The ZeroMQ sockets of a rank consumer: limits, the SUB and its monitor, draining reads.

Every consumer socket has the same limits (a receive high-water mark
bounding its queue in bytes, no linger, ``max_message_bytes``, reconnect
backoff), and running out of
sockets or files is an error that names both limits and the fixes.
"""

from __future__ import annotations

import contextlib
import errno
import resource
from collections.abc import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from indexer.ingest.settings import SubscriberSettings

#: Messages drained from a ready socket per poll. Readers give the loop back
#: when the turn's ingest budget is spent (:mod:`indexer.ingest.slices`).
YIELD_EVERY = 64


class SocketLimit(OSError):
    """No more sockets can be opened: the message names the limit that was reached."""


@contextlib.contextmanager
def socket_limit(context: zmq.Context) -> Iterator[None]:
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


def open_socket(
    context: zmq.asyncio.Context, settings: SubscriberSettings, kind: int, hwm_cap: int
) -> zmq.asyncio.Socket:
    """A socket with the limits every consumer socket has; its receive high-water
    mark keeps what ZeroMQ queues per connection within ``queue_bytes``
    (:meth:`~indexer.ingest.settings.SubscriberSettings.receive_hwm`)."""
    with socket_limit(context):
        sock = context.socket(kind)
    sock.setsockopt(zmq.RCVHWM, settings.receive_hwm(hwm_cap))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, round(settings.reconnect_max * 1000))
    return sock


def open_sub(
    context: zmq.asyncio.Context,
    settings: SubscriberSettings,
    topic: str,
    endpoint: str,
    bind: bool,
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A SUB socket bound or connected to ``endpoint``, and the monitor of its
    connections (handshakes, disconnections, and the reconnections that tell a
    publisher that closed from one ZeroMQ dropped); nothing is left open on failure."""
    sub = open_socket(context, settings, zmq.SUB, settings.sub_hwm)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    try:
        with socket_limit(context):
            monitor = sub.get_monitor_socket(events)
    except BaseException:
        sub.close(linger=0)
        raise
    try:
        with socket_limit(context):
            (sub.bind if bind else sub.connect)(endpoint)
    except BaseException:
        close_sub(sub, monitor)
        raise
    return sub, monitor


def close_sub(sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    sub.disable_monitor()
    monitor.close(linger=0)
    sub.close(linger=0)


async def messages(sock: zmq.asyncio.Socket) -> AsyncIterator[list[bytes]]:
    """Every message of a socket: an awaited poll, then a non-blocking drain of
    what is queued (an awaited receive costs four times a non-blocking one)."""
    drain = zmq.Socket.shadow(sock.underlying).recv_multipart
    while True:
        await sock.poll(flags=zmq.POLLIN)
        for _ in range(YIELD_EVERY):
            try:
                yield drain(zmq.NOBLOCK)
            except zmq.Again:
                break
