"""kvindex's HTTP server: uvicorn on a socket bound beforehand, stopped by a signal.

:func:`listen` binds the socket (a taken port is an error that names the
fix), :func:`serve_http` serves an ASGI app on it until an event is set
(:func:`stop_signals`: SIGTERM or SIGINT), with a deadline for each request
head, bounds on connections and on what unfinished heads hold, and refusals
in the API's JSON shape (:mod:`kvindex.h11_guard`). ``kvindex serve`` and
``kvindex api`` both serve through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from api.settings import ApiSettings
from kvindex.h11_guard import GuardedH11Protocol, HeadBudget

log = logging.getLogger("kvindex.serve")


def listen(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket here, so a taken port is an error, not uvicorn's exit.

    The socket is made with an explicit IPPROTO_TCP: asyncio turns on
    TCP_NODELAY only for sockets whose protocol says TCP, and without it every
    keep-alive response waits ~40 ms on Nagle and delayed ACKs.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(cannot_listen(host, port, e, "--port")) from None
    return sock


def cannot_listen(host: str, port: int, error: OSError, flag: str) -> str:
    """Why a listening socket could not be opened, naming the port and the fix."""
    if error.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is in use ({error.strerror}): stop what holds it"
            f" or choose another {flag}"
        )
    return f"cannot listen on {host} port {port}: {error.strerror or error}"


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after serving, killing the process
    before the ranks have stopped; :func:`serve` handles signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT, for as long as the block runs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_http(
    app: Any, settings: ApiSettings, sock: socket.socket, stop: asyncio.Event, **about: Any
) -> None:
    """Serve ``app`` on a listening socket until ``stop`` is set (or the server fails)."""
    # h11 refuses request heads over 16 KiB by default: too small for a GET
    # /prefix-match of an 8k-token prompt. Allow what the API itself allows.
    # h11 is named, not left to "auto": uvicorn would pick httptools whenever
    # it is installed, whose parser refuses heads over a fixed ~80 KB whatever
    # is configured here (a 16k-token GET prompt is about 100 KB).
    # uvicorn's own limit_concurrency is not set: it is checked only once a head
    # is in, and it would count the connections the protocol has refused.
    config = uvicorn.Config(
        app,
        http=functools.partial(
            GuardedH11Protocol,
            head_timeout=settings.header_timeout,
            heads=HeadBudget(settings.head_bytes),
            max_connections=settings.max_connections,
            max_head=settings.max_body_bytes,
        ),
        log_config=None,
        access_log=False,
        h11_max_incomplete_event_size=settings.max_body_bytes,
    )
    server = _Server(config)
    http = asyncio.create_task(server.serve(sockets=[sock]))
    host, port = sock.getsockname()[:2]
    log.info("serving", extra={"host": host, "port": port, **about})
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([http, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    server.should_exit = True
    await http
