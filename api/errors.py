"""One error shape for every failure: ``{"error": "<what was wrong>"}``.

Routers and operators read the message, so every handler here turns its
exception into a sentence that names the offending input. FastAPI's own
``{"detail": ...}`` shapes are replaced.

A store that fails is a 503, never a 500, and this module is the one place
that says so. A Redis timeout, a dropped connection or a cluster redirect
storm surfaces as whatever exception the client library raises:
:class:`GuardedStore` turns each into :class:`StoreUnavailable`, and one
handler answers that.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from api.metrics import STORE_ERRORS, STORE_SECONDS
from indexer.query import QueryRefused
from indexer.stores.base import Store, StoreUnavailable

log = logging.getLogger("kvindex.api")


class ErrorBody(msgspec.Struct):
    error: str


class ApiError(Exception):
    """A request the API refuses, with the status and message to answer."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


_encode = msgspec.json.Encoder().encode


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _encode(ErrorBody(message)), status, headers=headers, media_type="application/json"
    )


def _validation_message(exc: RequestValidationError) -> str:
    """``query.block_size: Input should be a valid integer`` for each problem."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.headers)


async def _refused(_: Request, exc: Exception) -> Response:
    """The read path's refusals: an engine or model nobody registered is not found,
    anything else in the query cannot be processed."""
    assert isinstance(exc, QueryRefused)
    return error_response(404 if exc.unknown else 422, exc.message)


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, _validation_message(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    headers = exc.headers
    if exc.status_code == 405:
        headers = {"Allow": ", ".join(_allowed_methods(request))}
    return error_response(exc.status_code, str(exc.detail), headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path.

    Starlette lists only the first matching route's methods, but FastAPI
    makes one route per method: GET and POST /prefix-match are two routes.
    """
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= route.methods
    return sorted(methods)


#: Seconds a request waits for the store's probe while the store is known down.
PROBE_WAIT = 0.1


class StoreHealth:
    """Whether the store answered its last call; while it has not, requests fail fast.

    A Redis that hangs (paused, or its host gone) makes each call wait out its
    socket timeout: without this every request would, though the first failure
    already told. So after a failure one probe (a ping) is kept asking the store:
    a request waits at most :data:`PROBE_WAIT` for it, and is refused at once unless
    it answers. The race with recovery is the probe's: it is in flight while the
    store is away, so a store that answers again answers it within a round trip,
    and a request arriving then waits for that very answer instead of being refused
    on old news. A probe that fails starts no other until a request needs one, so an
    idle API does not poll a store that is down.
    """

    def __init__(self, ping: Callable[[], Awaitable[object]]) -> None:
        self._ping = ping
        self._down: str | None = None  # the last failure, while not answered since
        self._probe: asyncio.Task[None] | None = None

    def answered(self) -> None:
        self._down = None

    def failed(self, error: BaseException) -> None:
        self._down = str(error) or type(error).__name__

    async def admit(self) -> None:
        """Return when the store may be called; StoreUnavailable while it is known down."""
        if self._down is None:
            return
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._check(), name="store probe")
        await asyncio.wait([self._probe], timeout=PROBE_WAIT)
        if self._down is not None:
            raise StoreUnavailable(f"{self._down} (failing fast until the store answers)")

    async def _check(self) -> None:
        try:
            await self._ping()
        except Exception as e:
            self.failed(e)
        else:
            self.answered()


class GuardedStore:
    """Delegates to a :class:`Store`; any failure raises :class:`StoreUnavailable`.

    Every call site would otherwise need its own ``try``: the API cannot know
    which exceptions a backend's client library raises. Each call is timed
    here too (``kvindex_api_store_seconds``), for the same reason, and fails
    fast while the store is known down (:class:`StoreHealth`). Methods that are
    not coroutines are the store's own, as they are.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._health = StoreHealth(store.ping)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)
        if not inspect.iscoroutinefunction(method):
            return method  # what the store already knows (last_loss): no I/O to guard or time
        seconds, health = STORE_SECONDS.labels(name), self._health

        @functools.wraps(method)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            await health.admit()
            started = time.perf_counter()
            try:
                result = await method(*args, **kwargs)
            except StoreUnavailable as e:
                health.failed(e)
                raise
            except Exception as e:
                health.failed(e)
                raise StoreUnavailable(str(e) or type(e).__name__) from e
            finally:
                seconds.observe(time.perf_counter() - started)
            health.answered()
            return result

        setattr(self, name, guarded)  # built once per method
        return guarded


_logged_store_errors: set[str] = set()


async def _store_error(_: Request, exc: Exception) -> Response:
    cause = exc.__cause__ or exc
    kind = type(cause).__name__
    STORE_ERRORS.labels(kind).inc()
    if kind not in _logged_store_errors:  # once per kind: an outage fails every request
        _logged_store_errors.add(kind)
        log.warning("store unreachable", extra={"error": repr(cause)})
    return error_response(503, f"store unreachable: {cause}")


async def _client_gone(request: Request, _: Exception) -> Response:
    """The client hung up before its body arrived (its own timeout, usually because this
    process answered late): nothing to read, no one to answer, nothing gone wrong here."""
    log.debug("client disconnected before its request arrived", extra={"path": request.url.path})
    return error_response(400, "client disconnected before its request arrived")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(QueryRefused, _refused)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(StoreUnavailable, _store_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
