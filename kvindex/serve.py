"""``kvindex serve``: the subscriber and the HTTP API in one process and event loop.

Engines come from the config file and ``--engine`` flags, then from the
operator API at runtime. The store is the embedded one unless a Redis URL (or
a ``redis`` config section) is given. SIGTERM/SIGINT stop the HTTP server,
then every rank after the batch in hand (so the store's watermark is that of
the last applied batch), then the store.

The config file (:mod:`kvindex.config`) also serves ``kvindex indexer`` and
``kvindex api`` (:mod:`kvindex.processes`), which read the sections they need.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from api import operators
from api.settings import ApiSettings
from indexer import discovery, metrics
from indexer.announcements import Leases
from indexer.discovery.served import EngineUrl, UrlEngines, follow_moves
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber
from indexer.routed import MemoryRouted, RedisRouted, RoutedEntries
from indexer.stores.base import Store
from indexer.stores.memory import MemoryStore
from indexer.stores.redis import RedisConfig, RedisStore
from kvindex.config import ServeConfig
from kvindex.http import listen, serve_http, stop_signals
from kvindex.wiring import api_app

log = logging.getLogger("kvindex.serve")


def open_store(redis: RedisConfig | None) -> Store:
    """The Redis store when configured, else the embedded one."""
    return MemoryStore() if redis is None else RedisStore(redis)


def open_routed(redis: RedisConfig | None, store: Store) -> RoutedEntries:
    """Routed entries beside the store: in Redis with it (through its client), else in
    process."""
    if redis is None or not isinstance(store, RedisStore):
        return MemoryRouted()
    return RedisRouted(redis, store.client)


def _connected(subscriber: Subscriber) -> Callable[[str], bool]:
    """Whether some rank of an engine has a publisher connected."""
    return lambda engine: any(s.connected for s in subscriber.rank_status(engine))


async def serve(
    config: ServeConfig,
    engines: Sequence[EngineSpec] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    redis: RedisConfig | None = None,
    settings: ApiSettings | None = None,
    discover: Sequence[str] = (),
    engine_urls: Sequence[EngineUrl] = (),
) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly; ``redis``: the store (default
    embedded); ``settings``: the API's (default the config file's); ``discover``:
    ``--discover`` URLs, after the config file's; ``engine_urls``: ``--engine-url``
    engines, after the config file's, registered as their servers answer."""
    operators.warn_if_unavailable("serve", embedded_store=redis is None)
    config.check_binds(engines)
    sources = config.discovery_sources(discover)
    targets = config.url_engines(engine_urls)
    settings = settings or config.api_settings()
    store = open_store(redis)
    registry = EngineRegistry()
    subscriber = Subscriber(store, registry, config.subscriber, settings.auth_token)
    routed = open_routed(redis, store)
    subscriber.add_observer(routed.observe)  # the batches applied confirm routed entries
    leases = Leases(registry, settings.announce, on_removed=routed.forget)
    app = api_app(store, registry, subscriber, settings, routed=routed, leases=leases)
    sampler = found = by_url = moves = None
    try:
        with stop_signals() as stop, listen(host, port) as sock:
            await subscriber.start()
            sampler = asyncio.create_task(metrics.sample_residency(store, config.metrics))
            for spec in [*config.engines, *engines]:
                await registry.add(spec)
            by_url = UrlEngines(targets, registry.add)
            moves = asyncio.create_task(follow_moves(registry, _connected(subscriber)))
            found = discovery.Discovery(sources, leases)
            about = {"engines": [s.name for s in registry.all()], "store": type(store).__name__}
            await serve_http(app, settings, sock, stop, **about)
    finally:
        for task in (sampler, moves):
            if task is not None:
                task.cancel()
        if found is not None:
            await found.stop()
        if by_url is not None:
            await by_url.stop()
        await leases.close()
        await subscriber.stop()
        await app.state.loads.close()
        await routed.close()
        await store.close()
        log.info("stopped")
