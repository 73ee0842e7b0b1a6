"""kvindex's event model: what an engine says happened to its KV cache blocks.

Engine-neutral in meaning; the field names are vLLM's (the first engine), so
an adapter whose wire uses those names and field order can decode payloads
straight into these structs, without a copy. Media, block hashes and the engine rank that
owns a seq stream are defined here and nowhere else.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

import msgspec

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIA = (GPU, CPU, STORAGE)
LOWER_TIERS = (CPU, STORAGE)

#: A published block hash: the low 64 bits of the digest, or the raw digest.
BlockHash = Annotated[int, msgspec.Meta(ge=0)] | bytes

_OPTIONS = {"frozen": True, "gc": False, "forbid_unknown_fields": False}


class WireError(ValueError):
    """A frame or payload that is not a valid vLLM KV event batch."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


_CANONICAL: dict[str | None, str] = {None: "GPU", **{m: m for m in MEDIA}}


def normalise_medium(medium: str | None) -> str:
    """Upper-case a medium name; nil means GPU (vLLM's default pool)."""
    canonical = _CANONICAL.get(medium)
    if canonical is None:
        canonical = medium.upper()
        if canonical not in MEDIA:
            raise WireError("unknown_medium", repr(medium))
        _CANONICAL[medium] = canonical  # bounded: only case variants of three names
    return canonical


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", **_OPTIONS):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: the tokens after each block that its hash covers, one list per hash (vLLM 0.33
    #: with lookahead hashing; None without)
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", **_OPTIONS):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    # Not a field (never encoded): see AllBlocksCleared.
    kv_cache_spec_kind: ClassVar[None] = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", **_OPTIONS):
    # Not fields (never encoded): every event answers the same attribute reads,
    # so the per-event passes of decoding and planning run in C (attrgetter).
    block_hashes: ClassVar[tuple[()]] = ()
    medium: ClassVar[None] = None
    ownership: ClassVar[None] = None
    group_idx: ClassVar[None] = None
    locality: ClassVar[None] = None
    kv_cache_spec_kind: ClassVar[None] = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One published batch: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class RankId(NamedTuple):
    """One data-parallel rank of one engine: the unit that owns a seq stream."""

    engine: str
    dp_rank: int
