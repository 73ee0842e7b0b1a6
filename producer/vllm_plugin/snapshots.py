"""Snapshots of one vLLM engine core's prefix cache, served to kvindex.

Each engine core (one per data-parallel rank) answers at its report-free
stream's endpoint moved by ``KVINDEX_SNAPSHOT_PORT_OFFSET`` (rank r's port + r
stays rank r's), with the token the plugin announces the engine with
(:mod:`producer.snapshots` has the server). What a snapshot holds:

- GPU: the block pool's own table of cached blocks. vLLM keys it by the block
  hash with the KV group's id in its last four bytes, to one block or, for a
  hash cached more than once, each of its physical copies (:func:`_copies`); each copy was
  announced by a ``BlockStored`` and each eviction removes one, so the number
  of copies is the count kvindex keeps. Hashes are published as vLLM
  publishes them (``maybe_convert_block_hash``); group kinds as the plugin
  declares them.
- CPU and storage (an offloading connector): the plugin's own counts of the
  lower-tier events it publishes, kept only where a connector runs.

Taken on the engine thread between steps, when nothing it changed is
unpublished: right after a batch is published, or, on an idle engine, when
the engine core handles the wake-up the server puts in its input queue
(vLLM's ``WAKEUP`` request does nothing else). The GPU table is copied
there (a C-level dict copy, plus the length of each multi-copy entry); turning
keys into hashes happens on the server's thread. While nobody asks, the
engine pays one attribute read per published batch, and the lower-tier
counts where a connector runs.

vLLM is imported here only inside functions: kvindex never depends on it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from indexer.core.events import CPU, GPU
from indexer.core.hybrid import GroupDeclaration
from indexer.core.snapshot import Snapshot, SnapshotTier
from indexer.engines import catalog
from producer.snapshots import Handoff, PublishedResidency, SnapshotServer
from producer.vllm_plugin.groups import group_of

log = logging.getLogger("kvindex.vllm_plugin")

#: How long the server waits for the engine thread to take a snapshot.
TAKE_TIMEOUT = 20.0
_VLLM = catalog.adapter(catalog.DEFAULT)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class _Taken:
    """What the engine thread copies; the rest is done off it."""

    seq: int
    ts: float
    table: dict  # the block pool's cache, copied
    copies: dict  # key -> physical copies, for the keys with several
    lower: Snapshot  # CPU and storage tiers


class EngineSnapshots:
    """The snapshot service of this process's engine core."""

    def __init__(self, engine_core: Any, kv_cache_config: Any, offloading: bool) -> None:
        self._core = engine_core
        self._kinds = _declared_kinds(kv_cache_config)
        self._published = PublishedResidency()  # of the lower tiers only
        self._offloading = offloading
        self._handoff = Handoff()
        self._server: SnapshotServer | None = None

    def serve(self, endpoint: str, token: str) -> None:
        """Answer at ``endpoint`` (the engine binds it)."""
        self._server = SnapshotServer(endpoint, token, self._serve)
        log.info("kvindex: snapshots served at %s", self._server.endpoint)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    # --- the engine thread -------------------------------------------------------

    def published(self, seq: int, batch: Any) -> None:
        """vLLM's ``batch`` was published as ``seq``: count its lower tiers (decoded as
        kvindex reads them, the GPU events left out first); take a snapshot if one
        is wanted (everything changed is published now)."""
        lower = self._offloading and [e for e in batch.events if not _on_gpu(e.medium)]
        if lower:
            payload = _ENCODER.encode(msgspec.structs.replace(batch, events=lower))
            self._published.published(seq, _VLLM.decode(payload, tokens=False))
        else:
            self._published.last = (seq, batch.ts)
        if self._handoff.wanted:
            self._handoff.give(self._take)

    def connector_copies(self) -> list[tuple[int, list]]:
        """Per KV group, each hash of the connector's own tier (CPU, no ownership) as
        many times as it was published stored and not removed."""
        return [
            (tier.group_idx, [h for h, n in table.counts.items() for _ in range(n)])
            for tier, table in self._published.residency.tables.items()
            if tier.medium == CPU and tier.ownership is None and table.counts
        ]

    def between_steps(self) -> None:
        """The engine core handled a client request: take a wanted snapshot unless
        some change is not yet published (then the next batch published takes it)."""
        if self._handoff.wanted and not self._block_pool().kv_event_queue:
            self._handoff.give(self._take)

    def _take(self) -> _Taken:
        cached = self._block_pool().cached_block_hash_to_block
        table = cached._cache.copy()
        return _Taken(
            *self._published.last, table, _copies(cached, table), self._published.snapshot()
        )

    def _block_pool(self) -> Any:
        return self._core.scheduler.kv_cache_manager.block_pool

    # --- the server thread -------------------------------------------------------

    def _serve(self) -> Snapshot | None:
        taken = self._handoff.ask(TAKE_TIMEOUT, self._wake)
        return None if taken is None else _assembled(taken, self._kinds)

    def _wake(self) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        queue = getattr(self._core, "input_queue", None)
        if queue is not None:
            queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def _copies(cached: Any, table: dict) -> dict:
    """Each key cached by several physical blocks, with their number. vLLM 0.34 keeps
    one block id per key in its table and the ids of every key cached more than once
    in a table beside it (``_dup_ids``); 0.33 keeps a key's copies, when there are
    several, as a dict in place of its block."""
    several = getattr(cached, "_dup_ids", None)
    if several is not None:
        return {key: len(ids) for key, ids in several.items()}
    return {key: len(blocks) for key, blocks in table.items() if type(blocks) is dict}


def _assembled(taken: _Taken, kinds: Mapping[int, str | None]) -> Snapshot:
    by_group: dict[int, tuple[list, list]] = {}
    copies, published = taken.copies, _published_form()
    for key in taken.table:
        hashes, counts = by_group.setdefault(int.from_bytes(key[-4:], "big"), ([], []))
        hashes.append(published(key[:-4]))
        counts.append(copies.get(key, 1))
    gpu = [
        SnapshotTier(GPU, None, group, None, hashes, counts if len(copies) else None)
        for group, (hashes, counts) in sorted(by_group.items())
    ]
    lower = taken.lower
    tiers = [*gpu, *lower.tiers]
    return Snapshot(taken.seq, taken.ts, tiers, {**lower.group_kinds, **kinds}, lower.chunk_blocks)


def _on_gpu(medium: str | None) -> bool:
    """Whether an event's medium is the GPU: nil, or GPU in any case (as
    :func:`~indexer.core.events.normalise_medium` reads it, without raising on the
    engine's thread for a medium kvindex does not know)."""
    return medium is None or medium.upper() == GPU


def _published_form() -> Any:
    """How vLLM publishes a block hash: the low 64 bits of the digest as an int, or the
    digest's bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM's
    ``maybe_convert_block_hash``, which reads that setting again for every hash: at
    a million blocks that alone took seconds, so it is read once here)."""
    from vllm import envs

    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return bytes
    mask = (1 << 64) - 1
    return lambda digest: int.from_bytes(digest, "big") & mask


def _declared_kinds(kv_cache_config: Any) -> dict[int, str | None]:
    """Each group's kind as kvindex keys it from the plugin's declaration."""
    groups = [group_of(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    block_size = groups[0]["block_size"] if groups else 16
    declared = [(g["kind"], g["sliding_window"], g["block_size"]) for g in groups]
    return dict(GroupDeclaration(declared, block_size).kinds)


#: The attribute of an engine core holding its service.
_ATTR = "_kvindex_snapshots"
#: The service attached last and not yet claimed by a publisher: vLLM's engine core
#: sets up its KV cache (``attach``), then its scheduler creates the event
#: publisher, which claims it (one engine core per process, but nothing here
#: needs that: each publisher serves the engine core attached just before it).
_UNCLAIMED: EngineSnapshots | None = None


def attach(engine_core: Any, vllm_config: Any, kv_cache_config: Any) -> EngineSnapshots:
    """Set up this engine core's service, served by the publisher it creates next."""
    global _UNCLAIMED
    transfer = vllm_config.kv_transfer_config
    found = EngineSnapshots(engine_core, kv_cache_config, offloading=transfer is not None)
    setattr(engine_core, _ATTR, found)
    _UNCLAIMED = found
    return found


def claim() -> EngineSnapshots | None:
    """The service of the engine core attached last, for the publisher being created
    (once: another publisher of the process serves none)."""
    global _UNCLAIMED
    found, _UNCLAIMED = _UNCLAIMED, None
    return found


def of(engine_core: Any) -> EngineSnapshots | None:
    """An engine core's service, if it was attached."""
    return getattr(engine_core, _ATTR, None)


def handling_requests(handle: Any) -> Any:
    """Wrap ``EngineCoreProc._handle_client_request``: a wanted snapshot is taken
    after any request the engine core handles (the wake-up, when idle)."""

    @functools.wraps(handle)
    def wrapper(self: Any, *args: Any) -> Any:
        result = handle(self, *args)
        if (found := getattr(self, _ATTR, None)) is not None:
            found.between_steps()
        return result

    wrapper._kvindex = True
    return wrapper
