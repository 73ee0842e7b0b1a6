"""Engine-side tracker that makes offloaded chunk events self-describing.

An offload manager names a chunk only by its :class:`OffloadKey` (KV group and
the chunk's last block hash), so its raw events say nothing about the tokens,
the parent hash or the per-block hashes inside the chunk. A consumer can then
only match chunk ends, and only if it can recompute the engine's hashes.

The tracker snapshots that payload while the request is still at hand (when
the chunk is stored, or hit on lookup) and keeps it until the last tier
holding the chunk removes it, so both the store and the later removal fan out
to the same per-block hashes. Where no snapshot exists (self-describing off,
sliding-window or recurrent groups, chunks never seen with their request) it
emits vLLM's placeholder: the chunk-end hash alone, ``block_size`` 0.

Semantics follow vLLM's ``OffloadingEventsTracker`` of the release the tracker
is made for (``offload_events``): 0.33's, or 0.34's, where a recurrent (Mamba)
group's chunk or partial tail is one self-describing state checkpoint (the
last hash, chained to the one before it, no tokens) instead of a placeholder.
The API takes plain request data so any engine can use it. Hashes pass through
unchanged: give them in the form the engine publishes (64-bit ints or raw digests).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from indexer.core.events import BlockHash, BlockRemoved, BlockStored

OffloadMedium = Literal["CPU", "STORAGE"]
#: A tier holding a chunk: ``(medium, ownership)``; ownership None is the engine's own.
OffloadTier = tuple[str, str | None]
Event = BlockStored | BlockRemoved

#: The offload manager's own tier. Stores and lookup hits land here first.
PRIMARY: OffloadTier = ("CPU", None)
#: The vLLM releases whose offload events the tracker speaks.
OFFLOAD_EVENTS = ("0.33", "0.34")


def check_offload_events(release: str) -> None:
    """Refuse a vLLM release whose offload events the tracker does not speak."""
    if release not in OFFLOAD_EVENTS:
        raise ValueError(f"offload events are vLLM {OFFLOAD_EVENTS}'s, not {release!r}")


#: The kind of a recurrent group: vLLM 0.34 describes its chunks as state checkpoints.
RECURRENT = "mamba"


class OffloadKey(NamedTuple):
    """How an offload manager names a chunk: its KV group and last block hash."""

    group_idx: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group as the offload manager sees it.

    ``sliding_window_in_chunks`` is set for sliding-window and recurrent
    (SSM) groups: their chunks are not a prefix of the prompt, so they keep
    the placeholder payload. ``hash_block_size`` is the token span of one
    request hash when it is finer than a block (hybrid models); a block's
    hash is then the last request hash inside it.
    """

    group_idx: int
    kind: str | None
    sliding_window: int | None
    tokens_per_block: int
    blocks_per_chunk: int
    sliding_window_in_chunks: int | None = None
    hash_block_size: int | None = None

    def __post_init__(self) -> None:
        if min(self.tokens_per_block, self.blocks_per_chunk, self.tokens_per_hash) <= 0:
            raise ValueError(f"group {self.group_idx}: sizes must be positive")
        if self.tokens_per_block % self.tokens_per_hash:
            raise ValueError(
                f"group {self.group_idx}: tokens_per_block {self.tokens_per_block} is not "
                f"a multiple of hash_block_size {self.tokens_per_hash}"
            )

    @property
    def tokens_per_hash(self) -> int:
        return self.tokens_per_block if self.hash_block_size is None else self.hash_block_size

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the tracker needs of a live request: its hash chain and tokens."""

    block_hashes: Sequence[BlockHash]
    token_ids: Sequence[int]
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """A raw event from the offload manager: chunks stored to or removed from a tier.

    ``removal_expected`` is False for tiers that never report removals (they
    must not keep a snapshot alive). ``metadata_only`` marks the removal of a
    tier copy that was never published (a failed store): it is forgotten
    without an event.
    """

    keys: Sequence[OffloadKey]
    medium: OffloadMedium
    removed: bool
    locality: str | None = None
    ownership: str | None = None
    removal_expected: bool = True
    metadata_only: bool = False

    def __post_init__(self) -> None:
        if self.medium not in ("CPU", "STORAGE"):
            raise ValueError(f"offload medium must be CPU or STORAGE, not {self.medium!r}")
        if self.metadata_only and not self.removed:
            raise ValueError("metadata_only applies to removals only")


class _Span(NamedTuple):
    """Tokens ``[start, end)`` of a request, published in blocks of ``block_size``."""

    group: GroupSpec
    start: int
    end: int
    block_size: int


@dataclass(slots=True)
class _Snapshot:
    """The ``BlockStored`` payload of one chunk and the tiers still holding it."""

    group: GroupSpec
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    tiers: set[OffloadTier] = field(default_factory=lambda: {PRIMARY})


class Tracker:
    """Turns raw offload events into vLLM's ``BlockStored``/``BlockRemoved`` events, as
    the release ``offload_events`` (one of :data:`OFFLOAD_EVENTS`) publishes them.

    Call a ``record_*`` method while the request is alive, then pass the
    manager's events through :meth:`take_events` in the order it emitted them.
    """

    def __init__(
        self, self_describing: bool, group_specs: Iterable[GroupSpec], offload_events: str = "0.33"
    ) -> None:
        check_offload_events(offload_events)
        self.self_describing = self_describing
        self._checkpoints = offload_events != "0.33"
        self._groups = {group.group_idx: group for group in group_specs}
        self._snapshots: dict[OffloadKey, _Snapshot] = {}

    def record_store(self, req: RequestView, chunk_idx: int, key: OffloadKey) -> None:
        """Snapshot a complete chunk the manager accepted to store.

        The group is the key's. A fresh snapshot replaces an older one (the
        chunk was re-offloaded) but keeps the tiers that still hold it.
        """
        if group := self._describable(key):
            self._replace(key, self._snapshot(req, key, _chunk_span(group, chunk_idx)))

    def record_partial_store(self, req: RequestView, boundary_tokens: int, key: OffloadKey) -> None:
        """Snapshot a partial recurrent tail stored up to ``boundary_tokens``."""
        if group := self._describable(key):
            self._replace(key, self._snapshot(req, key, _tail_span(group, boundary_tokens)))

    def record_lookup(
        self, req: RequestView, chunk_idx: int, key: OffloadKey, *, allocated: bool = True
    ) -> None:
        """Note a primary-tier hit on a complete chunk (ready or still being written).

        A hit proves the primary tier holds the chunk, so it is registered as
        a holding tier even on an existing snapshot, whose payload is kept. A key
        the manager has not allocated (a miss or a deferred lookup) adds nothing.
        """
        group = self._describable(key) if allocated else None
        if group and not self._mark_primary(key):
            self._snapshots[key] = self._snapshot(req, key, _chunk_span(group, chunk_idx))

    def record_partial_lookup(
        self, req: RequestView, boundary_tokens: int, key: OffloadKey, *, allocated: bool = True
    ) -> None:
        """Note a primary-tier hit on a partial recurrent tail; see :meth:`record_lookup`."""
        group = self._describable(key) if allocated else None
        if group and not self._mark_primary(key):
            self._snapshots[key] = self._snapshot(req, key, _tail_span(group, boundary_tokens))

    def take_events(self, events: Iterable[OffloadEvent]) -> list[Event]:
        """Translate one batch of raw events, in order, into wire events."""
        published: list[Event] = []
        removed: set[OffloadKey] = set()
        for event in events:
            if event.removed:
                removed.update(event.keys)
                published.extend(self._removals(event))
            else:
                published.extend(self._stores(event))
        # A primary removal can precede a secondary store of the same chunk in
        # one batch; drop a snapshot only once every store has registered.
        for key in removed:
            snapshot = self._snapshots.get(key)
            if snapshot is not None and not snapshot.tiers:
                del self._snapshots[key]
        return published

    def reset(self) -> None:
        """Forget every snapshot: after a manager cache reset they describe nothing."""
        self._snapshots.clear()

    def _describable(self, key: OffloadKey) -> GroupSpec | None:
        """The key's group if its chunks get a snapshot, else None."""
        if not self.self_describing:
            return None
        group = self._groups.get(key.group_idx)
        if group is None:
            raise ValueError(f"no GroupSpec for KV group {key.group_idx}")
        if group.sliding_window_in_chunks is None or self._is_checkpointed(group):
            return group
        return None

    def _is_checkpointed(self, group: GroupSpec) -> bool:
        return self._checkpoints and group.kind == RECURRENT

    def _replace(self, key: OffloadKey, snapshot: _Snapshot) -> None:
        if old := self._snapshots.get(key):
            snapshot.tiers |= old.tiers
        self._snapshots[key] = snapshot

    def _mark_primary(self, key: OffloadKey) -> bool:
        """Register the primary tier on an existing snapshot; False if none."""
        snapshot = self._snapshots.get(key)
        if snapshot is not None:
            snapshot.tiers.add(PRIMARY)
        return snapshot is not None

    def _snapshot(self, req: RequestView, key: OffloadKey, span: _Span) -> _Snapshot:
        """The payload of ``span``; a recurrent group's reduced to the state it holds,
        valid at its last hash (vLLM 0.34): that hash alone, chained to the one
        before it, and no tokens."""
        snapshot = self._build(req, key, span)
        if self._is_checkpointed(span.group):
            hashes = snapshot.block_hashes
            if len(hashes) > 1:
                snapshot.parent_block_hash = hashes[-2]
            snapshot.block_hashes, snapshot.token_ids = hashes[-1:], ()
        return snapshot

    @staticmethod
    def _build(req: RequestView, key: OffloadKey, span: _Span) -> _Snapshot:
        tokens_per_hash = span.group.tokens_per_hash
        first, last = span.start // tokens_per_hash, span.end // tokens_per_hash
        if span.start < 0 or last > len(req.block_hashes) or span.end > len(req.token_ids):
            raise ValueError(
                f"request with {len(req.block_hashes)} hashes and {len(req.token_ids)} "
                f"tokens does not cover tokens [{span.start}, {span.end})"
            )
        if req.block_hashes[last - 1] != key.block_hash:
            raise ValueError(f"{key} does not end tokens [{span.start}, {span.end})")
        stride = span.block_size // tokens_per_hash
        return _Snapshot(
            group=span.group,
            block_hashes=tuple(req.block_hashes[first:last][stride - 1 :: stride]),
            parent_block_hash=req.block_hashes[first - 1] if first else None,
            token_ids=tuple(req.token_ids[span.start : span.end]),
            block_size=span.block_size,
            lora_id=req.lora_id,
            lora_name=req.lora_name,
        )

    def _stores(self, event: OffloadEvent) -> list[BlockStored]:
        # Each event names its own parent, so the order of keys does not matter.
        stored = []
        for key in event.keys:
            snapshot = self._snapshots.get(key)
            if snapshot is None:
                stored.append(self._placeholder(key, event))
                continue
            if event.removal_expected:
                snapshot.tiers.add((event.medium, event.ownership))
            stored.append(
                BlockStored(
                    block_hashes=list(snapshot.block_hashes),
                    parent_block_hash=snapshot.parent_block_hash,
                    token_ids=list(snapshot.token_ids),
                    block_size=snapshot.block_size,
                    lora_id=snapshot.lora_id,
                    medium=event.medium,
                    lora_name=snapshot.lora_name,
                    group_idx=key.group_idx,
                    kv_cache_spec_kind=snapshot.group.kind,
                    kv_cache_spec_sliding_window=snapshot.group.sliding_window,
                    locality=event.locality,
                    ownership=event.ownership,
                )
            )
        return stored

    def _placeholder(self, key: OffloadKey, event: OffloadEvent) -> BlockStored:
        group = self._groups.get(key.group_idx) if self.self_describing else None
        return BlockStored(
            block_hashes=[key.block_hash],
            medium=event.medium,
            group_idx=key.group_idx,
            kv_cache_spec_kind=group.kind if group else None,
            kv_cache_spec_sliding_window=group.sliding_window if group else None,
            locality=event.locality,
            ownership=event.ownership,
        )

    def _removals(self, event: OffloadEvent) -> list[BlockRemoved]:
        # One event per KV group keeps group_idx unambiguous for the consumer.
        tier = (event.medium, event.ownership)
        by_group: dict[int, list[BlockHash]] = {}
        for key in event.keys:
            hashes = by_group.setdefault(key.group_idx, [])
            snapshot = self._snapshots.get(key)
            if snapshot is None:
                hashes.append(key.block_hash)
            else:
                snapshot.tiers.discard(tier)
                hashes.extend(snapshot.block_hashes)
        if event.metadata_only:
            return []
        return [
            BlockRemoved(
                block_hashes=hashes,
                medium=event.medium,
                group_idx=group_idx,
                locality=event.locality,
                ownership=event.ownership,
            )
            for group_idx, hashes in by_group.items()
        ]


def _chunk_span(group: GroupSpec, chunk_idx: int) -> _Span:
    """A complete chunk, published in the group's blocks."""
    start = chunk_idx * group.tokens_per_chunk
    return _Span(group, start, start + group.tokens_per_chunk, group.tokens_per_block)


def _tail_span(group: GroupSpec, boundary_tokens: int) -> _Span:
    """The valid prefix of the chunk containing token ``boundary_tokens - 1``.

    A recurrent tail ends on a hash boundary before its block is full, so it
    is published at hash granularity and only up to that boundary.
    """
    if boundary_tokens <= 0 or boundary_tokens % group.tokens_per_hash:
        raise ValueError(
            f"tail boundary {boundary_tokens} is not a positive multiple of "
            f"{group.tokens_per_hash} tokens"
        )
    start = (boundary_tokens - 1) // group.tokens_per_chunk * group.tokens_per_chunk
    return _Span(group, start, boundary_tokens, group.tokens_per_hash)
