"""Build the kvindex HTTP API over a store, a registry and the subscriber.

``kvindex serve`` calls :func:`create_app` and runs the result with uvicorn
(bind 127.0.0.1 unless told otherwise); tests call it with a memory store
and a fake consumer view. Everything the routes need is passed in here, so
several apps (tests, benchmarks) can live in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from fastapi import FastAPI

from api import announce, health, operators, prefix
from api import routed as routed_api
from api.context import ApiContext
from api.docs import install_docs
from api.errors import GuardedStore, install_error_handlers
from api.limits import BodyLimit
from api.openapi import install_openapi
from api.settings import ApiSettings
from api.ui import install_ui
from indexer import metrics
from indexer.announcements import Leases
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import ConsumerView, Registry, UnknownEngine
from indexer.loads import LoadBoard
from indexer.misdeclared import Misdeclared, MisdeclaredView
from indexer.prompts import Tokenizers
from indexer.query import learned
from indexer.routed import MemoryRouted, RoutedEntries
from indexer.stores.base import Store
from indexer.token_index import TokenIndex

DESCRIPTION = """\
Which engine holds how much of a prompt's KV cache, per tier, from the KV
cache events of vLLM engines. Routers call `/prefix-match`; operators use
`/engines`, `/blocks/{hash}`, `/stats`, `/metrics`, `/healthz`, `/readyz`,
and the page at `/ui/` that draws them.
Every error is `{"error": "<what was wrong>"}`.
"""


@runtime_checkable
class Observable(Protocol):
    """A consumer view that also reports each applied batch (the subscriber)."""

    def add_observer(
        self,
        observer: Callable[[RankId, EventBatch], None],
        reads_tokens: Callable[[str], bool] | None = None,
    ) -> None: ...


def _learns_from(registry: Registry) -> Callable[[str], bool]:
    """Learn tokens only for registered engines whose hashes cannot be recomputed."""

    def learns(engine: str) -> bool:
        try:
            return learned(registry.get(engine))
        except UnknownEngine:
            return False

    return learns


def create_app(
    store: Store,
    registry: Registry,
    consumers: ConsumerView,
    settings: ApiSettings,
    *,
    token_index: TokenIndex | None = None,
    routed: RoutedEntries | None = None,
    tokenizers: Tokenizers | None = None,
    leases: Leases | None = None,
    misdeclared: MisdeclaredView | None = None,
) -> FastAPI:
    """The API app. ``token_index`` defaults to a new one fed by ``consumers``
    when it can report applied batches (``add_observer``); ``routed`` (the routed
    entries) to in-process ones, confirmed by the same batches (given ones are the
    caller's to confirm: an API replica mirroring the engines must not confirm
    what the workers confirm in Redis, a stale clear would drop newer picks);
    ``tokenizers``
    to a pool of ``settings.models`` (apps in one process may share one);
    ``leases`` to new ones over ``registry`` (give them to share them with
    discovery, which announces through them too); ``misdeclared`` to checks of the
    batches ``consumers`` reports (API replicas read the workers' instead)."""
    if token_index is None:
        token_index = TokenIndex(settings.token_index_capacity, _learns_from(registry))
        if isinstance(consumers, Observable):
            consumers.add_observer(token_index.observe, token_index.learns)
    if tokenizers is None:
        tokenizers = Tokenizers(settings.models)
        tokenizers.preload()  # at start, not on the first query: /readyz waits for it
    ctx = ApiContext(GuardedStore(store), registry, consumers, token_index, settings, tokenizers)
    if routed is None:  # given ones are confirmed by whoever applies the batches
        routed = MemoryRouted()
        if isinstance(consumers, Observable):
            consumers.add_observer(routed.observe)
    metrics.watch_routed(routed)
    leases = leases or Leases(registry, settings.announce, on_removed=routed.forget)
    if misdeclared is None:
        checks = misdeclared = Misdeclared(registry)
        if isinstance(consumers, Observable):
            consumers.add_observer(checks.observe, checks.reads_tokens)
    loads = LoadBoard(registry, ctx.store, settings.load)
    ctx = dataclasses.replace(
        ctx, routed=routed, leases=leases, misdeclared=misdeclared, loads=loads
    )

    # FastAPI's own /docs and /redoc load their assets from a CDN: install_docs serves them.
    app = FastAPI(
        title="kvindex",
        version="0.1.0",
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
    )
    app.state.loads = loads  # its scraper ends with the app's owner (LoadBoard.close)
    app.state.tokenizers = tokenizers
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(prefix.router(ctx))
    app.include_router(routed_api.router(ctx))
    app.include_router(operators.router(ctx))
    app.include_router(announce.router(ctx))
    app.include_router(health.router(ctx))
    install_openapi(app)
    install_docs(app)
    install_ui(app)
    return app
