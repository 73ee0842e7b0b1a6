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
    api:                          # ApiSettings, see api.settings
      auth_token: s3cret
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
import logging
import signal
import socket
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
import yaml

from api.app import create_app
from api.settings import ApiSettings
from indexer.engines import EngineRegistry, EngineSpec
from indexer.stores.base import Store
from indexer.stores.memory import MemoryStore
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.subscriber import Subscriber, SubscriberSettings
from indexer.workers import WorkerSettings

log = logging.getLogger("kvindex.serve")


class ConfigError(ValueError):
    """The config file cannot be used; the message says where and why."""


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``--config`` file."""

    engines: list[EngineSpec] = []
    subscriber: SubscriberSettings = SubscriberSettings()
    api: dict[str, Any] = {}
    redis: dict[str, Any] | None = None
    indexer: WorkerSettings = WorkerSettings()

    def api_settings(self) -> ApiSettings:
        return _dataclass(ApiSettings, self.api, "api")

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
    except (OSError, tomllib.TOMLDecodeError, yaml.YAMLError, msgspec.ValidationError) as e:
        raise ConfigError(f"{path}: {e}") from None


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
    except OSError:
        sock.close()
        raise
    return sock


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
    limit = settings.max_body_bytes
    config = uvicorn.Config(
        app, http="h11", log_config=None, access_log=False, h11_max_incomplete_event_size=limit
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
) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly; ``redis``: the store (default embedded)."""
    store = open_store(redis)
    registry = EngineRegistry()
    subscriber = Subscriber(store, registry, config.subscriber)
    settings = config.api_settings()
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
