"""An engine's kvindex registration, read from vLLM 0.33's own config objects.

Each field comes from where vLLM itself takes it, so what kvindex is told is
what the engine does, not what an operator typed:

- block size: the granularity of the block hashes vLLM publishes, which its
  ``resolve_kv_cache_block_sizes`` derives from the KV cache groups (one group:
  the cache block size; several: their common divisor);
- KV cache groups: ``kv_cache_config.kv_cache_groups``, each spec's kind as the
  events name it (``get_kv_cache_spec_kind``) and its sliding window;
- hash algorithm: ``cache_config.prefix_caching_hash_algo``; the seed is
  ``PYTHONHASHSEED`` when set. Without it the cryptographic algorithms use a
  fixed public seed (kvindex knows it) and the xxhash ones a random
  per-process one, which nobody outside the engine can know: "seeded", unknown;
- lookahead tokens: ``num_hash_lookahead_tokens``, the tokens after each block
  its hash covers (EAGLE-style drafting that drops blocks, prefix caching on and
  no KV connector, or in 0.34 one that supports it); 0 where vLLM has no such property;
- endpoints: ``kv_events_config``. vLLM binds a wildcard, ipc or inproc
  endpoint and connects to any other (then kvindex binds); rank ``r`` publishes
  on the port + ``r``, so rank 0's endpoints describe every rank. kvindex is
  given the plugin's report-free stream beside them
  (:mod:`producer.vllm_plugin.reports`) unless that is turned off; the name
  stays the one of vLLM's endpoint;
- offload chunk size: with vLLM's ``OffloadingConnector``, the
  ``blocks_per_chunk`` vLLM computes from ``kv_connector_extra_config``;
- GPU capacity: ``kv_cache_config.num_blocks``, the blocks of the rank's
  pool (kvindex bounds what a rank may hold on GPU by it);
- release: ``vllm.__version__`` (where a partial tail is anchored, and whether
  ``tools: []`` is refused, changed in 0.34).

vLLM is imported here only inside functions: kvindex never depends on it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from producer.vllm_plugin.groups import group_of
from producer.vllm_plugin.settings import PluginSettings

log = logging.getLogger("kvindex.vllm_plugin")
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


class NotAnnounced(Exception):
    """The engine's config is one kvindex cannot follow: the reason is logged."""


@dataclass(frozen=True)
class Announcement:
    """The ``POST /engines`` body and whether a hash seed is in force."""

    spec: dict[str, Any]
    seeded: bool


def announcement(vllm_config: Any, kv_cache_config: Any, settings: PluginSettings) -> Announcement:
    """The registration of the engine ``vllm_config`` describes, once its KV cache
    is set up (``kv_cache_config``). Raises :class:`NotAnnounced`."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        raise NotAnnounced("KV events are off (--kv-events-config enable_kv_cache_events)")
    if events.publisher != "zmq":
        raise NotAnnounced(f"publisher {events.publisher!r}: kvindex reads vLLM's zmq events")
    bind = not _engine_binds(events.endpoint)
    name = settings.engine_name or _default_name(
        events.endpoint if bind else _reachable(events.endpoint, settings), settings
    )
    stream, reuse_reports = _stream(events, settings)
    endpoint = stream.endpoint if bind else _reachable(stream.endpoint, settings)
    _, block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    seed = os.environ.get("PYTHONHASHSEED")
    spec: dict[str, Any] = {
        "name": name,
        "endpoint": endpoint,
        "replay_endpoint": stream.replay_endpoint and _reachable(stream.replay_endpoint, settings),
        "model": _served_name(vllm_config.model_config),
        "topic": events.topic,
        "dp_ranks": vllm_config.parallel_config.data_parallel_size,
        "block_size": block_size,
        "hash_algo": algo,
        "hash_seed": seed,
        "lookahead_tokens": getattr(vllm_config, "num_hash_lookahead_tokens", 0),
        "blocks_per_chunk": _blocks_per_chunk(vllm_config, kv_cache_config),
        "bind": bind,
        "kv_groups": [group_of(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups],
        "reuse_reports": reuse_reports,
        "gpu_blocks": kv_cache_config.num_blocks,
        "snapshot_endpoint": _snapshot_endpoint(stream, reuse_reports, bind, settings),
        "url": settings.engine_url,  # where route: "best" reads the engine's load
        "release": _release(),
    }
    return Announcement(spec, seeded=seed is not None or algo.startswith("xxhash"))


def _release() -> str:
    """vLLM's version: the rules that changed between releases follow it in kvindex."""
    import vllm

    return vllm.__version__


@dataclass(frozen=True)
class _Stream:
    endpoint: str
    replay_endpoint: str | None


def _stream(events: Any, settings: PluginSettings) -> tuple[_Stream, str]:
    """The stream kvindex reads and what it makes of reuse reports: the plugin's own,
    without them, unless it is turned off or has no place beside vLLM's."""
    vllm = _Stream(events.endpoint, events.replay_endpoint)
    if not settings.filter_reports:
        return vllm, "capped"
    from producer.vllm_plugin.reports import NotMoved, moved

    offset = settings.events_port_offset
    try:
        replay = vllm.replay_endpoint and moved(vllm.replay_endpoint, offset)
        return _Stream(moved(vllm.endpoint, offset), replay), "filtered"
    except NotMoved as e:
        log.warning("kvindex: reuse reports capped, not filtered: %s", e)
        return vllm, "capped"


def _snapshot_endpoint(
    stream: _Stream, reuse_reports: str, kvindex_binds: bool, settings: PluginSettings
) -> str | None:
    """Where the engine answers snapshots (:mod:`producer.vllm_plugin.snapshots`):
    beside the plugin's own stream, whose seqs snapshots are tagged with, where it
    serves them (:meth:`PluginSettings.snapshot_token`, the server's own test)."""
    token = settings.snapshot_token(stream.replay_endpoint, not kvindex_binds)
    if reuse_reports != "filtered" or token is None:
        return None
    from producer.vllm_plugin.reports import NotMoved, moved

    try:
        return _reachable(moved(stream.endpoint, settings.snapshot_port_offset), settings)
    except NotMoved as e:
        log.warning("kvindex: no snapshots: %s", e)
        return None


def _engine_binds(endpoint: str) -> bool:
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher._is_bind_endpoint(endpoint)


def _reachable(endpoint: str, settings: PluginSettings) -> str:
    """The address kvindex connects to for an endpoint the engine binds."""
    if endpoint.startswith("inproc://"):
        raise NotAnnounced(f"{endpoint}: an inproc endpoint is reachable from the engine only")
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc: a path on this machine
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in _WILDCARDS:
        host = settings.host()
    if port == "0":
        raise NotAnnounced(f"{endpoint}: port 0 (the OS picks it) cannot be announced")
    return f"tcp://{host}:{port}"


def _default_name(endpoint: str, settings: PluginSettings) -> str:
    if endpoint.startswith("tcp://"):
        return endpoint.removeprefix("tcp://").replace("[", "").replace("]", "")
    return settings.host()


def _served_name(model_config: Any) -> str:
    """The name clients ask for (``--served-model-name``, else the model), which is
    what routers pass kvindex."""
    served = model_config.served_model_name
    return served[0] if isinstance(served, list | tuple) else served or model_config.model


def _blocks_per_chunk(vllm_config: Any, kv_cache_config: Any) -> int | None:
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector != "OffloadingConnector":
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )

    return build_offloading_config(vllm_config, kv_cache_config).cache.blocks_per_chunk
