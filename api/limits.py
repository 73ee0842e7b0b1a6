"""Request body size limit, enforced before a body is buffered.

An oversized ``Content-Length`` is refused at once; a chunked body is
counted as it streams and refused as soon as it passes the limit, so a
client cannot make the server hold an arbitrarily large prompt in memory.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_response


class BodyLimit:
    """Pure ASGI middleware: 413 ``{"error": ...}`` for bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self, size: int) -> str:
        return f"request body of {size} bytes is over the maximum of {self.max_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, self._refusal(int(length)))(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise ApiError(413, self._refusal(seen))
            return message

        await self.app(scope, receive if length is not None else counted, send)
