"""uvicorn's h11 protocol with the guards uvicorn has no option for.

uvicorn bounds a connection's idle time only after a response, checks its
connection limit only once a request head is in, and answers that limit in
plain text. :class:`GuardedH11Protocol` adds a deadline for each request head,
bounds on connections and on the bytes unfinished heads hold, and refusals in
the API's JSON shape. It subclasses uvicorn's ``H11Protocol``, which is not a
public interface: this module is the one place kvindex leans on uvicorn's
internals, the lock pins the uvicorn it was written against, and
``tests/test_h11_guard.py`` fails, naming what moved, when an upgrade moves them.
What uvicorn's public options do cover (the largest head h11 buffers) is set
through them, in :mod:`kvindex.http`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from http import HTTPStatus
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.errors import error_response
from indexer.memory_trim import return_freed_memory


class HeadBudget:
    """The bytes of unfinished request heads held across a server's connections.

    Each connection may buffer a head of up to ``max_body_bytes`` (h11's limit)
    for ``header_timeout`` seconds: without a shared bound, many slow heads
    hold that much each at once. When the heads held fall back to none after
    holding at least ``TRIM_AFTER``, the allocator is asked to return the
    freed pages: glibc keeps them otherwise (heads are freed in whatever
    order their clients leave, so its heap cannot shrink from the top):
    measured, a 16 MiB budget filled once left about as much resident.
    """

    TRIM_AFTER = 4 << 20

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._peak = 0  # the most held since the allocator last returned memory

    def fits(self, size: int) -> bool:
        return self.held + size <= self.limit

    def take(self, size: int) -> None:
        self.held += size
        self._peak = max(self._peak, self.held)

    def give_back(self, size: int) -> None:
        self.held -= size
        if self.held == 0 and self._peak >= self.TRIM_AFTER:
            self._peak = 0
            # after this callback, once the connection's buffers are freed
            asyncio.get_running_loop().call_soon(return_freed_memory)


def _busy(message: str) -> bytes:
    """A whole 503 response that closes the connection, sent outside h11 (which
    answers only a request it has read, and these are refused before that)."""
    body = json.dumps({"error": message}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_TOO_MANY_HEADS = _busy("too many request heads in progress: try again shortly")


async def _within_limit(
    app: ASGIApp, tasks: set[Any], limit: int, scope: Scope, receive: Receive, send: Send
) -> None:
    """``app``, unless this request makes more than ``limit`` requests in flight: then a
    JSON 503 (uvicorn's own ``limit_concurrency`` answers plain text, where every other
    refusal of the API is ``{"error": ...}``)."""
    if len(tasks) > limit:
        message = f"over {limit} requests in flight (api.max_connections): try again shortly"
        await error_response(503, message, {"Connection": "close"})(scope, receive, send)
        return
    await app(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request head and bounds
    on what unfinished heads hold.

    uvicorn bounds only the idle time after a response (``timeout_keep_alive``,
    cancelled by the first byte that arrives): a client that connects and
    sends nothing, or sends a head a byte at a time, holds its connection
    forever. Here a head must be complete within ``head_timeout`` seconds of
    the connection opening or of the previous response, or the connection
    is closed.

    uvicorn checks its connection limit only once a head is complete, so
    connections beyond it buffer heads too: here a connection beyond
    ``max_connections`` (or arriving while that many requests are in flight,
    which uvicorn's limit counted too) is answered 503 at once and what it
    sends is dropped unread until it closes (or its head deadline passes). The bytes of
    unfinished heads are counted in ``heads`` until they are freed (the head
    is parsed, or the connection is gone); a read that would take them over
    the budget is dropped and its connection answered 503 and closed, unless
    the read ends a head. A head h11 cannot take (over ``max_head`` bytes: 431,
    saying to POST it; anything else it refuses: 400) is answered as the API
    answers, before a close that lets the answer arrive.
    """

    def __init__(
        self,
        *args: Any,
        head_timeout: float,
        heads: HeadBudget,
        max_connections: int,
        max_head: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.app = functools.partial(_within_limit, self.app, self.tasks, max_connections)
        self._max_head = max_head
        self._head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None
        self._heads, self._max_connections = heads, max_connections
        self._head_bytes = 0  # this connection's share of ``heads``
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self._max_connections
        if len(self.connections) > limit or len(self.tasks) >= limit:
            self._refused = True
            transport.write(
                _busy(
                    f"too many connections: over {limit} open connections or requests in"
                    " flight (api.max_connections); try again when some have closed"
                )
            )
            if transport.can_write_eof():
                transport.write_eof()  # the client reads the answer, then closes
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped: a refused connection buffers nothing
        if self.conn.their_state is h11.IDLE and not self._room_for(data):
            self._refused = True
            self.transport.write(_TOO_MANY_HEADS)
            self.transport.close()  # frees the head held so far (connection_lost)
            return
        super().data_received(data)
        if self._refused:  # the head was refused (400/431): its deadline closes it
            self._release_head()
        elif self.conn.their_state is not h11.IDLE:  # the head is in
            self._cancel_head_deadline()
            self._release_head()
        elif not self.transport.is_closing():
            self._head_bytes += len(data)
            self._heads.take(len(data))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request head h11 refuses, as JSON: a head over
        ``max_head`` bytes (a GET prompt too long for a URL) is a 431 that says to
        POST it. Closing at once would reset the connection while the client is
        still sending, and the client would lose the answer: instead kvindex stops
        sending, drops what still comes, and closes when the client does (or at the
        head deadline)."""
        buffered, _ = self.conn.trailing_data
        if len(buffered) > self._max_head:
            message = (
                f"request head over {self._max_head} bytes: send a long prompt as a JSON"
                " body (POST /prefix-match)"
            )
            refusal = error_response(431, message)
        else:
            refusal = error_response(400, msg)
        head = h11.Response(
            status_code=refusal.status_code,
            headers=[*refusal.raw_headers, (b"connection", b"close")],
            reason=HTTPStatus(refusal.status_code).phrase,
        )
        for event in (head, h11.Data(data=refusal.body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._refused = True  # what still comes is dropped
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._await_head()  # closed at the deadline, if the client has not closed by then

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # no pipelined head was waiting
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        self._release_head()
        super().connection_lost(exc)

    def _room_for(self, data: bytes) -> bool:
        """Whether this read may be buffered: it fits in the budget, or it ends a
        head (a complete head is parsed at once and holds nothing afterwards)."""
        return self._heads.fits(len(data)) or b"\r\n\r\n" in data

    def _release_head(self) -> None:
        if self._head_bytes:
            self._heads.give_back(self._head_bytes)
            self._head_bytes = 0

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self._head_timeout, self._head_late)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if (self._refused or self.conn.their_state is h11.IDLE) and not self.transport.is_closing():
            self.transport.close()
