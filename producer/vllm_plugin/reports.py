"""Reuse reports kept out of kvindex's stream, where they are made.

A request may ask vLLM for a reuse report (``vllm_xargs:
{"kv_cache_report_mode": "full"}``). The engine's block pool then announces
every GPU block the request reused from its prefix cache
(``BlockPool.emit_cached_block_events``) as a ``BlockStored`` of exactly the
shape of a new physical copy's, and nothing ever removes it. On vLLM's wire the
two cannot be told apart; counting a report as a copy keeps a block resident
after its last copy is evicted. Inside the engine they can: the plugin marks the
events that method appends, and publishes every batch a second time without
them on a publisher of its own (vLLM's wire format, one batch for each of
vLLM's, so the same seqs, with a replay buffer as deep as vLLM's), at the
engine's endpoints moved by :func:`moved` (``KVINDEX_EVENTS_PORT_OFFSET``); a
batch after a connector reset also says what it dropped (:mod:`.resets`).
kvindex reads that stream; vLLM's own, which other consumers read, is left byte
for byte as it was.

vLLM is imported here only inside functions: kvindex never depends on it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import msgspec

from producer.vllm_plugin import resets, snapshots
from producer.vllm_plugin.settings import PluginSettings

log = logging.getLogger("kvindex.vllm_plugin")

_MIRROR = "_kvindex_mirror"
_SNAPSHOTS = "_kvindex_snapshots"  # the engine core's snapshot service a publisher serves
#: Report events appended but not yet published, by id; holding each keeps its id
#: from being reused by another event before its batch is published.
_REPORTED: dict[int, Any] = {}
_ENCODER = msgspec.msgpack.Encoder()  # vLLM's publisher encodes batches with a default one
_MAX_PORT = 65535
#: The settings of the last ``install``: read when a publisher is created.
_SETTINGS: PluginSettings | None = None


class NotMoved(ValueError):
    """An endpoint the plugin's publisher cannot take a place beside."""


def moved(endpoint: str, offset: int) -> str:
    """Where the plugin publishes beside one of vLLM's endpoints: a tcp port moved by
    ``offset`` (rank r's port + r stays rank r's), an ipc path or inproc name with a
    ``.kvindex`` suffix. Raises :class:`NotMoved`."""
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}.kvindex"
    host, _, port = endpoint.rpartition(":")
    if port == "0":
        raise NotMoved(f"{endpoint}: port 0 (the OS picks it) has no port beside it")
    if not 0 < int(port) + offset <= _MAX_PORT:
        raise NotMoved(f"{endpoint}: port {port} + offset {offset} is not a port")
    return f"{host}:{int(port) + offset}"


def install(settings: PluginSettings) -> None:
    """Mark reports as the block pool makes them and mirror every zmq publisher of
    this process without them (answering snapshots beside it, where the engine core
    can be snapshotted). Idempotent: vLLM loads plugins more than once; publishers
    created from then on follow the last call's ``settings``."""
    from vllm.distributed.kv_events import ZmqEventPublisher
    from vllm.v1.core.block_pool import BlockPool

    global _SETTINGS
    _SETTINGS = settings
    if getattr(BlockPool.emit_cached_block_events, "_kvindex", False):
        return
    BlockPool.emit_cached_block_events = _marking(BlockPool.emit_cached_block_events)
    resets.install()
    ZmqEventPublisher.__init__ = _mirrored(ZmqEventPublisher.__init__)
    ZmqEventPublisher.publish = _publishing(ZmqEventPublisher.publish)
    ZmqEventPublisher.shutdown = _closing(ZmqEventPublisher.shutdown)


def without_reports(batch: Any) -> Any:
    """The batch less the reports it carries (the same object when it has none)."""
    if not _REPORTED:
        return batch
    kept = [event for event in batch.events if _REPORTED.pop(id(event), None) is None]
    if len(kept) == len(batch.events):
        return batch
    return msgspec.structs.replace(batch, events=kept)


def _marking(emit: Any) -> Any:
    @functools.wraps(emit)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = len(self.kv_event_queue)
        result = emit(self, *args, **kwargs)
        for event in self.kv_event_queue[before:]:
            _REPORTED[id(event)] = event
        return result

    wrapper._kvindex = True
    return wrapper


def _mirrored(init: Any) -> Any:
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        settings = _SETTINGS or PluginSettings()
        found = snapshots.claim()  # the engine core creating this publisher, if any
        try:
            setattr(self, _MIRROR, _mirror_of(self, settings.events_port_offset))
        except Exception:  # the engine publishes on vLLM's stream either way
            log.exception("kvindex: no report-free stream beside %s", self._endpoint)
            return
        binds = self._is_bind_endpoint(self._endpoint)
        if found is not None and _serve_snapshots(found, getattr(self, _MIRROR), binds, settings):
            setattr(self, _SNAPSHOTS, found)

    return wrapper


def _serve_snapshots(found: Any, mirror: Any, binds: bool, settings: PluginSettings) -> bool:
    """Answer snapshots beside the mirror, tagged with its seqs (where they are on;
    ``binds``: vLLM binds its endpoints)."""
    token = settings.snapshot_token(mirror.replay_endpoint, binds)
    if token is None:
        return False
    try:
        found.serve(moved(mirror.endpoint, settings.snapshot_port_offset), token)
    except Exception:  # the engine serves either way; kvindex falls back to replay
        log.exception("kvindex: not serving snapshots beside %s", mirror.endpoint)
        return False
    return True


def _mirror_of(publisher: Any, offset: int) -> Any:
    """kvindex's publisher beside vLLM's, at its endpoints moved (already its rank's)."""
    from producer.publisher import Publisher

    replay = publisher._replay_endpoint
    return Publisher(
        moved(publisher._endpoint, offset),
        moved(replay, offset) if replay else None,
        topic=publisher._topic_bytes.decode(),
        buffer_steps=publisher._buffer.maxlen,
    )


def _publishing(publish: Any) -> Any:
    @functools.wraps(publish)
    def wrapper(self: Any, events: Any) -> None:
        publish(self, events)  # sets the batch's data-parallel rank, as both streams carry
        mirror = getattr(self, _MIRROR, None)
        if mirror is not None:
            kept = without_reports(events)
            if (found := getattr(self, _SNAPSHOTS, None)) is not None:
                kept = resets.with_implied_removals(self, found, kept)
            payload = _ENCODER.encode(kept)
            mirror.publish_encoded(payload)
            if found is not None:
                _count(self, found, mirror.last_offered_seq, kept)

    return wrapper


def _count(publisher: Any, found: Any, seq: int, batch: Any) -> None:
    """Tell the snapshot service of a published batch. This runs inside vLLM's
    publish, on the engine's thread: a failure stops the snapshots (kvindex's
    requests then time out, and it stays degraded as without them), never the
    engine."""
    try:
        found.published(seq, batch)
    except Exception:
        log.exception("kvindex: snapshots stopped for %s", publisher._endpoint)
        delattr(publisher, _SNAPSHOTS)
        found.close()


def _closing(shutdown: Any) -> Any:
    @functools.wraps(shutdown)
    def wrapper(self: Any) -> None:
        shutdown(self)
        mirror = getattr(self, _MIRROR, None)
        if mirror is not None:
            mirror.close()
        if (found := getattr(self, _SNAPSHOTS, None)) is not None:
            found.close()

    return wrapper
