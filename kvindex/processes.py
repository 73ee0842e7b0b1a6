"""``kvindex indexer`` and ``kvindex api``: kvindex as many processes over one Redis.

- ``kvindex indexer`` runs a :class:`~indexer.cluster.workers.Worker`: it consumes the
  engine ranks it holds leases on into the Redis store, and hands them over
  when workers join, leave or die. Run as many as the fleet needs.
- ``kvindex api`` serves the HTTP API over the Redis store, the Redis engine
  registry and the statuses workers publish: stateless, any number behind a
  load balancer. ``POST``/``DELETE /engines`` on any replica reach the workers
  through the registry.

Both read the same config file as ``kvindex serve``; a Redis URL (flag or
``redis`` section) is required. What an API replica cannot answer: ``tokens``
queries for engines whose hashes it cannot reproduce, which need the learned
token index of ``kvindex serve`` (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from api import operators
from api.settings import ApiSettings
from indexer.announcements import Leases
from indexer.cluster.announced import RedisBook
from indexer.cluster.mirror import Mirror
from indexer.cluster.misdeclared_board import RedisMisdeclared
from indexer.cluster.redis_registry import RedisRegistry
from indexer.cluster.status_board import StatusBoard
from indexer.cluster.workers import Worker
from indexer.discovery.served import EngineUrl, UrlEngines
from indexer.engine_registry import EngineSpec
from indexer.engines import catalog
from indexer.ingest.subscriber import RankPool
from indexer.metrics import sample_residency, watch_routed
from indexer.misdeclared import Misdeclared
from indexer.routed import RedisRouted
from indexer.stores.base import StoreUnavailable
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.stores.redis.client import cancel_task
from kvindex.config import ServeConfig, resolve_auth_token
from kvindex.http import cannot_listen, listen, serve_http, stop_signals
from kvindex.wiring import api_app

log = logging.getLogger("kvindex.processes")

#: How often the indexer process checks that its worker still runs.
_HEALTH_CHECK = 1.0


async def run_indexer(
    config: ServeConfig,
    redis: RedisConfig,
    engines: Sequence[EngineSpec] = (),
    *,
    engine_urls: Sequence[EngineUrl] = (),
    worker_id: str | None = None,
    metrics: tuple[str, int] | None = None,
) -> bool:
    """Run one worker until SIGTERM or SIGINT; False if it failed on its own.

    ``engines`` and ``engine_urls`` (and the config file's) are registered unless
    already there, the latter once their servers describe them.
    ``metrics``: ``(host, port)`` to serve Prometheus metrics on.
    """
    catalog.warn_if_unavailable("indexer")
    config.check_binds(engines)
    targets = config.url_engines(engine_urls)
    store = RedisStore(redis)
    registry = RedisRegistry(store.client)
    # the API's token (flag aside), which engines' snapshot endpoints ask for
    pool = RankPool(config.subscriber, resolve_auth_token(config.api_settings()).auth_token)
    # confirmed and cleared by the batches this worker applies
    routed = RedisRouted(redis, store.client)
    pool.add_observer(routed.observe)
    watch_routed(routed)
    # the engines this worker consumes are checked here, and read by every API replica
    findings = RedisMisdeclared(store.client, registry)
    store.on_loss(findings.republish)  # what Redis lost, the checks here will not learn again
    checks = Misdeclared(registry, on_change=findings.publish)
    pool.add_observer(checks.observe, checks.reads_tokens)
    worker = Worker(store, registry, pool, config.indexer, worker_id)
    exporter = sampler = by_url = None
    try:
        with stop_signals() as stop:
            await registry.seed([*config.engines, *engines])
            by_url = UrlEngines(targets, lambda spec: registry.seed([spec]))
            if metrics is not None:
                exporter = _serve_metrics(*metrics)
            await worker.start()
            sampler = asyncio.create_task(sample_residency(store, config.metrics))
            while not stop.is_set() and worker.running():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), _HEALTH_CHECK)
            healthy = stop.is_set()
            if not healthy:
                log.error("worker failed", extra={"worker": worker.id})
            return healthy
    finally:
        if sampler is not None:
            sampler.cancel()
        if by_url is not None:
            await by_url.stop()
        await worker.stop()
        await routed.close()
        await store.close()
        if exporter is not None:
            exporter.shutdown()


def _serve_metrics(host: str, port: int) -> WSGIServer:
    """The Prometheus exporter's server; a taken port is an OSError naming it."""
    try:
        return start_http_server(port, host)[0]
    except OSError as e:
        raise OSError(cannot_listen(host, port, e, "--metrics-port")) from None


async def run_api(
    config: ServeConfig,
    redis: RedisConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: ApiSettings | None = None,
    mirror: bool = False,
) -> None:
    """Serve the HTTP API over the shared Redis state until SIGTERM or SIGINT;
    ``settings``: the API's (default the config file's); ``mirror``: answer from
    this process's own consumption of every engine (:mod:`indexer.cluster.mirror`)
    instead of reading residency from Redis."""
    operators.warn_if_unavailable("api", embedded_store=mirror)
    settings = settings or config.api_settings()
    store = RedisStore(redis)
    registry = RedisRegistry(store.client)
    registry.declare(config.engines)  # registered again should the registry be lost
    polls = config.indexer
    # what /engines, /stats and `degraded` show: the mirror's own consumers, or the
    # statuses the workers publish
    own = board = None
    if mirror:
        own = Mirror(registry, config.subscriber, settings.auth_token)
    else:
        board = StatusBoard(store.client, registry, stale_after=3 * polls.status_interval)
        store.on_loss(board.forget)  # the statuses read before a loss may be of what it lost
    routed = RedisRouted(redis, store.client)
    # every replica sees and sweeps the same leases: an engine may renew through any of them
    book = RedisBook(store.client)
    leases = Leases(registry, settings.announce, on_removed=routed.forget, book=book)
    misdeclared = RedisMisdeclared(store.client, registry)
    app = api_app(
        own.store if own else store,
        registry,
        own or board,
        settings,
        routed=routed,
        leases=leases,
        misdeclared=misdeclared,
    )
    tasks: list[asyncio.Task] = []
    try:
        with stop_signals() as stop, listen(host, port) as sock:
            store.watch()  # a replica writes no batch: it looks for lost data all the same
            with contextlib.suppress(StoreUnavailable):  # the polls retry; /readyz says 503
                await registry.refresh()
                if board is not None:
                    await board.refresh()
            tasks = [asyncio.create_task(misdeclared.follow(polls.status_interval))]
            if own is not None:  # the mirror refreshes the registry itself, then syncs with it
                await own.start()
                tasks.append(asyncio.create_task(own.follow(polls.registry_poll)))
            else:
                tasks.append(asyncio.create_task(registry.follow(polls.registry_poll)))
                tasks.append(asyncio.create_task(board.follow(polls.status_interval)))
            leases.start()
            kind = "mirror" if own else "RedisStore"
            await serve_http(app, settings, sock, stop, store=kind)
    finally:
        await asyncio.gather(*map(cancel_task, tasks))  # a cancel redis-py drops is sent again
        await asyncio.gather(*tasks, return_exceptions=True)
        await leases.close()
        if own is not None:
            await own.stop()
        await app.state.loads.close()
        await routed.close()
        await store.close()
        log.info("stopped")
