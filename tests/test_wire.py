"""Wire decoding against vLLM 0.33.0's golden bytes, and against garbage."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    normalise_medium,
)
from indexer.engines.vllm.wire import (
    STORED,
    IndexedBatch,
    StoredHashes,
    decode_batch,
    encode_batch,
)
from indexer.engines.zmq_framing import decode_frames

from .conftest import FIXTURES

WIRE = sorted((FIXTURES / "wire").glob("*.msgpack"))
POSITIONAL = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}


def _plain(value: object) -> object:
    """The fixtures' JSON form: bytes as {"bytes_hex": ...}, tuples as lists."""
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _as_map(event: object) -> dict:
    """A fixture event as a map: positional arrays get their field names."""
    if isinstance(event, dict):
        return event
    tag, *values = event
    fields = POSITIONAL[tag].__struct_fields__ if tag in POSITIONAL else ()
    return {"type": tag, **dict(zip(fields, values, strict=False))}


def test_fixture_dir_has_every_shape() -> None:
    assert {p.stem for p in WIRE} >= {"legacy_positional", "bytes_hashes_lora_extra_keys"}


@pytest.mark.parametrize("path", WIRE, ids=lambda p: p.stem)
def test_fixture_decodes_to_its_json(path) -> None:
    batch = decode_batch(path.read_bytes())
    ts, events, *rank = json.loads(path.with_suffix(".json").read_text())
    assert batch.ts == ts
    assert batch.data_parallel_rank == (rank[0] if rank else None)
    assert len(batch.events) == len(events)
    for typed, raw in zip(batch.events, events, strict=True):
        raw = _as_map(raw)
        assert type(typed).__name__ == raw.pop("type")
        for field in msgspec.structs.fields(type(typed)):
            want = raw[field.name] if field.name in raw else _default(field)
            assert _plain(getattr(typed, field.name)) == _plain(want), field.name


def _default(field: msgspec.structs.FieldInfo) -> object:
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("path", [p for p in WIRE if p.stem != "legacy_positional"], ids=str)
def test_decoding_without_tokens_keeps_every_field_the_index_reads(path) -> None:
    raw = path.read_bytes()
    full, indexed = decode_batch(raw), decode_batch(raw, tokens=False)
    assert isinstance(indexed, IndexedBatch)
    assert (indexed.ts, indexed.data_parallel_rank) == (full.ts, full.data_parallel_rank)
    assert len(indexed.events) == len(full.events)
    for lean, event in zip(indexed.events, full.events, strict=True):
        assert type(lean) is (StoredHashes if type(event) is BlockStored else type(event))
        for name in lean.__struct_fields__:
            assert getattr(lean, name) == getattr(event, name), name


@pytest.mark.parametrize("path", [p for p in WIRE if p.stem != "legacy_positional"], ids=str)
def test_reencoding_is_byte_exact(path) -> None:
    raw = path.read_bytes()
    assert encode_batch(decode_batch(raw)) == raw


def test_legacy_positional_upgrades_to_map_events() -> None:
    batch = decode_batch((FIXTURES / "wire" / "legacy_positional.msgpack").read_bytes())
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    stored = batch.events[0]
    assert stored.block_size == 16 and len(stored.token_ids) == 32 and stored.group_idx is None


def test_unknown_fields_ignored_and_medium_case_normalised() -> None:
    payload = msgspec.msgpack.encode(
        [1.5, [{"type": "BlockStored", "block_hashes": [2**64 - 1], "medium": "cpu", "new": 1}]]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events[0].block_hashes == [2**64 - 1]
    assert normalise_medium(batch.events[0].medium) == "CPU"
    assert normalise_medium(None) == "GPU"


def test_positional_event_with_trailing_unknown_fields() -> None:
    event = ["BlockRemoved", [7], "storage", 2, "REMOTE", "kvcr", "future-field"]
    batch = decode_batch(msgspec.msgpack.encode([2.0, [event], 3]))
    assert batch.events == [BlockRemoved([7], "storage", 2, "REMOTE", "kvcr")]
    assert batch.data_parallel_rank == 3


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "bad_payload"),
        (b"\xc1", "bad_payload"),
        (msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), "bad_payload"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]),
            "bad_payload",
        ),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]),
            "bad_payload",
        ),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}]]
            ),
            "unknown_medium",
        ),
        (msgspec.msgpack.encode([1.0, [["Bogus", [1]]]]), "unknown_event"),
        (msgspec.msgpack.encode([1.0, [[[1], [1]]]]), "unknown_event"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", "x"]]]), "bad_event"),
        (msgspec.msgpack.encode({"ts": 1.0}), "bad_payload"),
    ],
)
def test_malformed_payloads_raise_one_typed_error(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError) as error:
        decode_batch(payload)
    assert error.value.reason == reason


def test_frames() -> None:
    assert decode_frames([b"kv", (5).to_bytes(8, "big"), b"p"]) == (b"kv", 5, b"p")
    with pytest.raises(WireError, match="frame_count"):
        decode_frames([b"kv", b"p"])
    with pytest.raises(WireError, match="bad_seq"):
        decode_frames([b"kv", b"\x00\x01", b"p"])


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
_event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
    optional={
        "block_hashes": _msgpack_values,
        "medium": _msgpack_values,
        "token_ids": _msgpack_values,
        "group_idx": _msgpack_values,
    },
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(
        lambda ts, events, rank: msgspec.msgpack.encode([ts, events, rank]),
        _msgpack_values,
        st.lists(_event_like | _msgpack_values, max_size=4),
        _msgpack_values,
    )
)
def test_random_payloads_never_crash_the_decoder(payload: bytes) -> None:
    for tokens in (True, False):
        try:
            batch = decode_batch(payload, tokens=tokens)
        except WireError as error:
            assert error.reason
        else:
            assert isinstance(batch, EventBatch)
            for event in batch.events:
                assert isinstance(event, (*STORED, BlockRemoved, AllBlocksCleared))
