"""``kvindex serve``: the subscriber and the HTTP API in one process and event loop.

Engines come from the config file and ``--engine`` flags, then from the
operator API at runtime. The store is the embedded one unless a Redis URL (or
a ``redis`` config section) is given. SIGTERM/SIGINT stop the HTTP server,
then every rank after the batch in hand (so the store's watermark is that of
the last applied batch), then the store.

The same config file serves ``kvindex indexer`` and ``kvindex api``
(:mod:`indexer.processes`), which read the sections they need. YAML, or TOML
by its ``.toml`` suffix::

    engines:                      # EngineSpec fields, see indexer.engines
      - name: vllm-a
        endpoint: tcp://10.0.0.5:5557
        replay_endpoint: tcp://10.0.0.5:5558
        dp_ranks: 2
        blocks_per_chunk: 16
    subscriber:                   # SubscriberSettings, see indexer.subscriber
      replay_timeout: 2.0
      gap_clear_threshold: 1000
      bind:                       # BindPolicy: where engines with bind: true may
        ipc_dir: /run/kvindex     # make kvindex listen (default: loopback tcp only)
    api:                          # ApiSettings, see api.settings
      auth_token_file: /run/secrets/kvindex-token   # or auth_token, $KVINDEX_AUTH_TOKEN
    redis:                        # RedisConfig, see indexer.stores.redis
      url: redis://127.0.0.1:6379/0
      cluster: false
    indexer:                      # WorkerSettings, see indexer.workers
      lease_ttl: 6.0
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import socket
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h11
import msgspec
import uvicorn
import yaml
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.app import create_app
from api.settings import ApiSettings
from indexer import native
from indexer.engines import BindRefused, EngineRegistry, EngineSpec, is_loopback
from indexer.stores.base import Store
from indexer.stores.memory import MemoryStore
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.subscriber import Subscriber, SubscriberSettings
from indexer.workers import WorkerSettings

log = logging.getLogger("kvindex.serve")


class ConfigError(ValueError):
    """The config file cannot be used; the message says where and why."""


class OpenDoor(ConfigError):
    """The API would let anyone who reaches it register engines: refused at start."""


#: The environment variable holding the API's bearer token.
AUTH_TOKEN_ENV = "KVINDEX_AUTH_TOKEN"


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``--config`` file."""

    engines: list[EngineSpec] = []
    subscriber: SubscriberSettings = SubscriberSettings()
    api: dict[str, Any] = {}
    redis: dict[str, Any] | None = None
    indexer: WorkerSettings = WorkerSettings()

    def api_settings(self) -> ApiSettings:
        """The api section, with the subscriber's bind policy for ``POST /engines``."""
        if "engine_binds" in self.api:
            raise ConfigError("api: engine_binds is the subscriber's: set subscriber.bind")
        return _dataclass(ApiSettings, {**self.api, "engine_binds": self.subscriber.bind}, "api")

    def check_binds(self, engines: Sequence[EngineSpec] = ()) -> None:
        """Refuse the file's and flags' engines that would bind where they may not."""
        for spec in [*self.engines, *engines]:
            try:
                self.subscriber.bind.check(spec)
            except BindRefused as e:
                raise ConfigError(str(e)) from None

    def redis_config(
        self, url: str | None, *, cluster: bool = False, prefix: str | None = None
    ) -> RedisConfig | None:
        """The Redis store's config; the flags (``url``, ``cluster``, ``prefix``)
        override the file's. None: no Redis at all."""
        if self.redis is None and url is None:
            return None
        section = dict(self.redis or {})
        flags = {"url": url, "cluster": cluster or None, "prefix": prefix}
        section.update((k, v) for k, v in flags.items() if v is not None)
        return _dataclass(RedisConfig, section, "redis")


def _dataclass(cls: type, section: dict[str, Any], name: str) -> Any:
    unknown = set(section) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        return msgspec.convert(section, cls)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"{name}: {e}") from None


def load_config(path: str | Path) -> ServeConfig:
    """Read a YAML or TOML config file (TOML when the name ends in ``.toml``)."""
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
        return msgspec.convert(data or {}, ServeConfig)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}") from None
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise ConfigError(f"{path}: {e}") from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line (its own text spans several, with a caret drawing)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"not valid YAML: {' '.join(str(error).split())}"
    mark = error.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = f" ({error.context})" if error.context else ""
    return f"YAML syntax error at {where}: {error.problem}{context}"


def resolve_auth_token(
    settings: ApiSettings, token_file: str | None = None, environ: Mapping[str, str] = os.environ
) -> ApiSettings:
    """The settings with ``auth_token`` from the first source that has one:
    ``token_file`` (``--auth-token-file``), ``$KVINDEX_AUTH_TOKEN``,
    ``api.auth_token_file``, ``api.auth_token``. A file or the environment
    keeps the token out of ``ps`` and out of a config file others may read."""
    from_env = environ.get(AUTH_TOKEN_ENV, "").strip()
    if token_file:
        token = _read_token(token_file)
    elif from_env:
        token = from_env
    elif settings.auth_token_file:
        token = _read_token(settings.auth_token_file)
    else:
        return settings
    return dataclasses.replace(settings, auth_token=token)


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"auth token file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"auth token file {path} is empty")
    return token


def refuse_open_door(host: str, settings: ApiSettings) -> None:
    """Raise :class:`OpenDoor` when a non-loopback listener would have no token."""
    if is_loopback(host) or settings.auth_token is not None:
        return
    raise OpenDoor(
        f"--host {host} is reachable from other machines and no auth token is set, so anyone"
        f" could register or remove engines: set ${AUTH_TOKEN_ENV}, --auth-token-file or"
        " api.auth_token_file (or pass --insecure-no-auth to run open anyway)"
    )


def open_store(redis: RedisConfig | None) -> Store:
    """The Redis store when configured, else the embedded one."""
    return MemoryStore() if redis is None else RedisStore(redis)


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


class _H11WithHeadTimeout(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request head.

    uvicorn bounds only the idle time after a response (``timeout_keep_alive``,
    cancelled by the first byte that arrives): a client that connects and
    sends nothing, or sends a head a byte at a time, holds its connection
    forever. Here a head must be complete within ``head_timeout`` seconds of
    the connection opening or of the previous response, or the connection
    is closed.
    """

    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # no pipelined head was waiting
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

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
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


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
    # uvicorn answers 503 once its connections reach limit_concurrency, so
    # one more than the connections allowed.
    config = uvicorn.Config(
        app,
        http=functools.partial(_H11WithHeadTimeout, head_timeout=settings.header_timeout),
        log_config=None,
        access_log=False,
        h11_max_incomplete_event_size=settings.max_body_bytes,
        limit_concurrency=settings.max_connections + 1,
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


async def serve(
    config: ServeConfig,
    engines: Sequence[EngineSpec] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    redis: RedisConfig | None = None,
    settings: ApiSettings | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly; ``redis``: the store (default
    embedded); ``settings``: the API's (default the config file's)."""
    native.warn_if_unavailable("serve")
    config.check_binds(engines)
    settings = settings or config.api_settings()
    store = open_store(redis)
    registry = EngineRegistry()
    subscriber = Subscriber(store, registry, config.subscriber)
    app = create_app(store, registry, subscriber, settings)
    try:
        with stop_signals() as stop, listen(host, port) as sock:
            await subscriber.start()
            for spec in [*config.engines, *engines]:
                await registry.add(spec)
            about = {"engines": [s.name for s in registry.all()], "store": type(store).__name__}
            await serve_http(app, settings, sock, stop, **about)
    finally:
        await subscriber.stop()
        await store.close()
        log.info("stopped")
