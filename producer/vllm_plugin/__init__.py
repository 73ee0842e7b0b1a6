"""kvindex's vLLM plugin: an engine started with KV events registers itself.

Installed with ``pip install 'kvindex[vllm-plugin]'`` into the engine's
environment, it is found through the ``vllm.general_plugins`` entry point.
vLLM loads that group in every process it starts (the API server, each engine
core, each worker) and calls :func:`register` with no arguments, so the config
cannot be read at load time. The one process that knows everything kvindex
needs is the engine core, once ``EngineCore._initialize_kv_caches`` has returned:
the KV cache groups and the hash block size exist only from then on. So
:func:`register` wraps that method (and ``shutdown``, to deregister at once on a
clean stop); in the other processes the wrapper never runs. It also keeps
reuse reports out of the stream kvindex reads (:mod:`producer.vllm_plugin.reports`)
and answers kvindex's snapshot requests (:mod:`producer.vllm_plugin.snapshots`).

Each data-parallel rank has its own engine core; rank 0 announces the engine
with all its ranks (they publish on rank 0's ports + r). Announcing runs on a
thread of its own and never fails the engine: a refused or unreachable kvindex
is logged and retried, since the engine serves traffic either way.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from producer.vllm_plugin.settings import PluginSettings

log = logging.getLogger("kvindex.vllm_plugin")
_ATTR = "_kvindex_announcer"


def register() -> None:
    """The entry point vLLM calls; loaded more than once per process, so idempotent."""
    settings = PluginSettings()
    if settings.announce_url is None:
        log.debug("KVINDEX_ANNOUNCE_URL is not set: the engine is not announced")
        return
    from vllm.v1.engine.core import EngineCore

    if settings.filter_reports:
        from producer.vllm_plugin.reports import install

        install(settings)

    if getattr(EngineCore._initialize_kv_caches, "_kvindex", False):
        return
    EngineCore._initialize_kv_caches = _after_kv_cache_init(EngineCore._initialize_kv_caches)
    EngineCore.shutdown = _before_shutdown(EngineCore.shutdown)
    if settings.filter_reports and settings.snapshots:
        from vllm.v1.engine.core import EngineCoreProc

        from producer.vllm_plugin.snapshots import handling_requests

        handle = EngineCoreProc._handle_client_request
        EngineCoreProc._handle_client_request = handling_requests(handle)


def _after_kv_cache_init(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(self: Any, vllm_config: Any) -> Any:
        kv_cache_config = init(self, vllm_config)
        try:  # every rank answers its own snapshots
            from producer.vllm_plugin import snapshots

            snapshots.attach(self, vllm_config, kv_cache_config)
        except Exception:
            log.exception("kvindex: this engine core cannot be snapshotted")
        if vllm_config.parallel_config.data_parallel_index == 0:
            try:
                setattr(self, _ATTR, start(vllm_config, kv_cache_config))
            except Exception:  # the engine serves without kvindex too
                log.exception("kvindex: not announcing this engine")
        return kv_cache_config

    wrapper._kvindex = True
    return wrapper


def _before_shutdown(shutdown: Any) -> Any:
    @functools.wraps(shutdown)
    def wrapper(self: Any) -> Any:
        announcing = getattr(self, _ATTR, None)
        if announcing is not None:
            announcing.stop()
        return shutdown(self)

    return wrapper


def start(vllm_config: Any, kv_cache_config: Any, settings: PluginSettings | None = None) -> Any:
    """Announce the engine and keep renewing (returns an :class:`Announcing`), or
    None when its config is one kvindex cannot follow (logged)."""
    from producer.vllm_plugin.announcing import Announcing
    from producer.vllm_plugin.spec import NotAnnounced, announcement

    settings = settings or PluginSettings()
    try:
        found = announcement(vllm_config, kv_cache_config, settings)
    except NotAnnounced as e:
        log.warning("kvindex: not announcing this engine: %s", e)
        return None
    announcing = Announcing(found, settings)
    threading.Thread(target=announcing.run, name="kvindex-announce", daemon=True).start()
    return announcing
