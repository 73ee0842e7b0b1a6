"""The API's services, wired by the program.

``kvindex serve``, an API replica (:mod:`kvindex.processes`), the tests and the
benchmarks build the app here: :func:`api_app` wires every service the routes
need (:func:`api_services`) and hands them to :func:`api.app.create_app`, which
only mounts the routes. Nothing is shared between calls, so several apps can
live in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from fastapi import FastAPI

from api.app import create_app
from api.context import ApiContext
from api.errors import GuardedStore
from api.settings import ApiSettings
from indexer import metrics
from indexer.announcements import Leases
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import ConsumerView, EngineSpec, Registry, UnknownEngine
from indexer.loads import LoadBoard
from indexer.misdeclared import Misdeclared, MisdeclaredView
from indexer.prompts import Tokenizers
from indexer.query import LoadAwarePicker, ReadPath, learned
from indexer.routed import MemoryRouted, RoutedEntries
from indexer.stores.base import Store
from indexer.token_index import TokenIndex


@runtime_checkable
class Observable(Protocol):
    """A consumer view that also reports each applied batch (the subscriber)."""

    def add_observer(
        self,
        observer: Callable[[RankId, EventBatch], None],
        reads_tokens: Callable[[str], bool] | None = None,
    ) -> None: ...


def _per_engine(registry: Registry, rule: Callable[[EngineSpec], bool]) -> Callable[[str], bool]:
    """``rule`` of a registered engine's spec, by name; False for one not registered."""

    def applies(engine: str) -> bool:
        try:
            return rule(registry.get(engine))
        except UnknownEngine:
            return False

    return applies


def _lora_learned(spec: EngineSpec) -> bool:
    return spec.engine_adapter.lora_learned


def api_services(
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
) -> ApiContext:
    """What the routes work with. ``token_index`` defaults to a new one fed by
    ``consumers`` when it can report applied batches (``add_observer``); ``routed``
    (the routed entries) to in-process ones, confirmed by the same batches (given
    ones are the caller's to confirm: an API replica mirroring the engines must not
    confirm what the workers confirm in Redis, a stale clear would drop newer picks);
    ``tokenizers`` to a pool of ``settings.models`` (apps in one process may share
    one); ``leases`` to new ones over ``registry`` (give them to share them with
    discovery, which announces through them too); ``misdeclared`` to checks of the
    batches ``consumers`` reports (API replicas read the workers' instead)."""
    observable = isinstance(consumers, Observable)
    if token_index is None:
        token_index = TokenIndex(
            settings.token_index_capacity,
            learns=_per_engine(registry, learned),  # engines whose hashes are not computed
            learns_lora=_per_engine(registry, _lora_learned),  # and LoRA stores, where not
        )
        if observable:
            consumers.add_observer(token_index.observe, token_index.reads_tokens)
    if tokenizers is None:
        tokenizers = Tokenizers(settings.models)
        tokenizers.preload()  # at start, not on the first query: /readyz waits for it
    if routed is None:  # given ones are confirmed by whoever applies the batches
        routed = MemoryRouted()
        if observable:
            consumers.add_observer(routed.observe)
    metrics.watch_routed(routed)
    leases = leases or Leases(registry, settings.announce, on_removed=routed.forget)
    if misdeclared is None:
        checks = misdeclared = Misdeclared(registry)
        if observable:
            consumers.add_observer(checks.observe, checks.reads_tokens)
    guarded = GuardedStore(store)
    loads = LoadBoard(registry, guarded, settings.load)
    picker = LoadAwarePicker(routed, loads, settings.routed).route
    read_path = ReadPath(
        guarded, registry, consumers, token_index, routed, picker, settings.weights, misdeclared
    )
    return ApiContext(
        guarded,
        registry,
        consumers,
        token_index,
        settings,
        tokenizers,
        read_path,
        routed=routed,
        leases=leases,
        misdeclared=misdeclared,
        loads=loads,
    )


def api_app(
    store: Store, registry: Registry, consumers: ConsumerView, settings: ApiSettings, **given
) -> FastAPI:
    """The API app over :func:`api_services`' services (``given``: its keywords)."""
    return create_app(api_services(store, registry, consumers, settings, **given))
