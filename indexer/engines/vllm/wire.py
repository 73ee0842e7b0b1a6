"""Decoding of vLLM KV-cache event batches (the ZMQ wire of vLLM 0.33).

vLLM 0.33 encodes events as msgpack maps tagged by ``"type"``; older releases
sent positional arrays with the tag first. msgspec cannot mix both shapes in
one union, so a batch is decoded as maps first and, only if that fails, as
positional arrays (one release never mixes the two in one batch).

The events decode straight into :mod:`indexer.core.events`' structs (their
field names are vLLM's). Every way a payload can be wrong surfaces as one
exception, :class:`~indexer.core.events.WireError`, with a short
machine-readable ``reason`` the consumer counts. The ZMQ frames around a
payload are :mod:`indexer.engines.zmq_framing`'s.

Decoding for the index alone (``tokens=False``, what ingest does unless the
token index learns from the engine) runs the compiled scanner of
:mod:`indexer.engines.vllm.frames` when it built; the msgspec path here is its
executable spec, and decodes whatever the scanner leaves to it.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from indexer.core import planning
from indexer.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)
from indexer.engines.base import MAX_HASHES_PER_EVENT, check_batch
from indexer.engines.vllm import frames


def _default(field: msgspec.structs.FieldInfo) -> object:
    if field.default_factory is not msgspec.NODEFAULT:
        return msgspec.field(default_factory=field.default_factory)
    return field.default


def _variant(
    cls: type, *, required: int, keep: tuple[str, ...] | None = None, name: str = "", **options
) -> type:
    """Derive another shape of an event struct from its one field list.

    ``required`` leading fields lose their defaults, as in vLLM's own structs;
    with ``omit_defaults`` that reproduces vLLM's encoding byte for byte.
    ``keep``, if given, names the only fields the variant has.
    """
    fields = [
        (f.name, f.type) if i < required else (f.name, f.type, _default(f))
        for i, f in enumerate(msgspec.structs.fields(cls))
        if keep is None or f.name in keep
    ]
    return msgspec.defstruct(
        name or cls.__name__,
        fields,
        tag=cls.__struct_config__.tag,
        tag_field="type",
        gc=False,
        **options,
    )


#: What the index itself reads of a ``BlockStored``: its hashes and its tier.
_INDEXED_FIELDS = (
    "block_hashes",
    "block_size",
    "medium",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)

#: A ``BlockStored`` decoded for the index alone. Token ids are ten times a
#: payload's hashes (16 per block), and building them as Python ints was half
#: of decoding; msgspec steps over the fields a struct lacks without building
#: them (and so without validating them). Only the learned token index reads them.
StoredHashes = _variant(
    BlockStored, required=1, keep=_INDEXED_FIELDS, name="StoredHashes", frozen=True
)

#: Stored events, in either form.
STORED = (BlockStored, StoredHashes)


class IndexedBatch(EventBatch, array_like=True, gc=False, frozen=True):
    """A batch whose stores are :data:`StoredHashes`: what ingest decodes by default."""

    events: list[StoredHashes | BlockRemoved | AllBlocksCleared]  # type: ignore[valid-type]


# Positional (pre-0.33) events: the same fields in the same order, tag first,
# possibly followed by fields this release does not know. Rare, so untyped.
# Positional encoding predates session_id: that many leading fields, then extras.
_POSITIONAL = {
    "BlockStored": (BlockStored, 13),
    "BlockRemoved": (BlockRemoved, 5),
    "AllBlocksCleared": (AllBlocksCleared, 0),
}
_LegacyBatch = tuple[float, list[list], int | None]


def _from_positional(values: list) -> Event:
    spec = _POSITIONAL.get(values[0]) if values and isinstance(values[0], str) else None
    if spec is None:
        raise WireError("unknown_event", repr(values[:1]))
    cls, known = spec
    named = dict(zip(cls.__struct_fields__[:known], values[1:], strict=False))
    try:
        return msgspec.convert(named, cls)
    except msgspec.ValidationError as e:
        raise WireError("bad_event", str(e)) from None


# vLLM 0.33's exact encoding: required fields always present, nil optionals omitted.
_VLLM_REQUIRED = {BlockStored: 7, BlockRemoved: 2, AllBlocksCleared: 0}
_VLLM = {c: _variant(c, required=n, omit_defaults=True) for c, n in _VLLM_REQUIRED.items()}
_VllmBatch = msgspec.defstruct(
    "KVEventBatch",
    [
        ("ts", float),
        ("events", list[Union[tuple(_VLLM.values())]]),  # noqa: UP007
        ("data_parallel_rank", int | None, None),
    ],
    array_like=True,
    omit_defaults=True,
    gc=False,
)

_decode_map = msgspec.msgpack.Decoder(EventBatch).decode
_decode_indexed = msgspec.msgpack.Decoder(IndexedBatch).decode
_decode_legacy = msgspec.msgpack.Decoder(list).decode
#: The compiled scanner for ``tokens=False``, None without the build.
_scan = frames.index_decoder(StoredHashes, BlockRemoved, AllBlocksCleared, IndexedBatch)


def _convert(event: msgspec.Struct, to: type) -> msgspec.Struct:
    return to(**msgspec.structs.asdict(event))


def decode_batch(payload: bytes, *, tokens: bool = True) -> EventBatch:
    """Decode one batch payload (the third frame) into typed events.

    Media are validated here but left as sent; use :func:`normalise_medium`.
    ``tokens=False`` decodes stores as :data:`StoredHashes` (an
    :class:`IndexedBatch`), skipping what only the token index reads, its events
    as :func:`indexer.core.planning.indexed_events` gives them (alike neighbours
    merged, in planning order): a batch the index counts the same.
    """
    if tokens:
        return _decode_typed(payload, _decode_map)
    batch = _scan(payload) if _scan is not None else None
    return check_batch(batch) if batch is not None else decode_indexed(payload)


def decode_indexed(payload: bytes) -> EventBatch:
    """``decode_batch(payload, tokens=False)`` by msgspec: what the compiled scanner
    must equal, and what decodes every payload it leaves alone."""
    batch = _decode_typed(payload, _decode_indexed)
    events = planning.indexed_events(batch.events, MAX_HASHES_PER_EVENT)
    return msgspec.structs.replace(batch, events=events)


def _decode_typed(payload: bytes, decode: object) -> EventBatch:
    try:
        return check_batch(decode(payload))
    except msgspec.DecodeError as map_error:
        legacy = _legacy_batch(payload, map_error)
    events = [_from_positional(e) for e in legacy[1]]
    return check_batch(EventBatch(legacy[0], events, legacy[2]))


def _legacy_batch(payload: bytes, map_error: Exception) -> tuple:
    """Decode a batch whose events are positional arrays, or report the map error."""
    try:
        values = _decode_legacy(payload)
        return msgspec.convert(values + [None] * (len(values) == 2), _LegacyBatch)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise WireError("bad_payload", str(map_error)) from None


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch exactly as vLLM 0.33 does (maps, nil fields omitted)."""
    events = [_convert(e, _VLLM[type(e)]) for e in batch.events]
    return _encoder.encode(_VllmBatch(batch.ts, events, batch.data_parallel_rank))


_encoder = msgspec.msgpack.Encoder()
_FLOAT64 = struct.Struct(">d")


def batch_ts(payload: bytes) -> float:
    """A payload's batch ts, without decoding its events.

    vLLM encodes a batch as a 2- or 3-element array led by the ts as a
    float64 (``0x92``/``0x93``, ``0xcb``, 8 bytes big-endian); any other
    shape is decoded in full (raises :class:`WireError` if it is no batch).
    """
    if len(payload) > 10 and payload[0] in (0x92, 0x93) and payload[1] == 0xCB:
        return _FLOAT64.unpack_from(payload, 2)[0]
    return decode_batch(payload).ts
