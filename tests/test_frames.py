"""The compiled payload scanner (``_frames``) against the rules it must equal.

For every payload, ``decode_batch(payload, tokens=False)`` (the scanner, falling
back to msgspec for what it leaves) must give msgspec's batch with its events as
:func:`indexer.core.planning.indexed_events` gives them (merged, in planning
order), or raise the same error; and merging alike events must not change what
the index does with a batch (its plan, its routed confirmations). Inputs: every golden payload,
generated vLLM batches of every event kind and field, and those mutated.
"""

from __future__ import annotations

import logging

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core import planning
from indexer.core.events import AllBlocksCleared, BlockRemoved, EventBatch, WireError
from indexer.core.residency import plan_batch
from indexer.core.routed import confirmations
from indexer.engines import base, catalog
from indexer.engines.vllm import frames, wire
from indexer.ingest.trace import load_trace, map_trace

from .conftest import RELEASES

GOLDEN = sorted(p for folder in RELEASES.values() for p in (folder / "wire").glob("*.msgpack"))
TRACES = sorted(
    p for folder in RELEASES.values() for p in (folder / "traces").glob("*.frames.msgpack")
)


def _id(path) -> str:
    """A golden file's test id: its release and name."""
    return f"{path.parents[1].name}-{path.name.split('.')[0]}"


def _outcome(decode, payload: bytes) -> tuple:
    """What decoding gives, comparable across paths: the batch's exact encoding and
    event classes, or the error's reason and detail."""
    try:
        batch = decode(payload)
    except WireError as error:
        return ("error", error.reason, error.detail)
    classes = [type(e).__name__ for e in batch.events]
    return ("ok", type(batch).__name__, classes, msgspec.msgpack.encode(batch))


def _unmerged(payload: bytes) -> EventBatch:
    """The msgspec path's batch before merging: one event per event sent."""
    return wire._decode_typed(payload, wire._decode_indexed)


def by_core_rule(payload: bytes) -> EventBatch:
    """msgspec's batch, its events merged and ordered by the core's rule: what the
    scanner must give."""
    batch = _unmerged(payload)
    events = planning.indexed_events(batch.events, wire.MAX_HASHES_PER_EVENT)
    return msgspec.structs.replace(batch, events=events)


def _check(payload: bytes) -> tuple:
    """Assert the scanner's path equals the core's rule on ``payload``; the outcome."""
    got = _outcome(lambda p: wire.decode_batch(p, tokens=False), payload)
    assert got == _outcome(by_core_rule, payload)
    if got[0] == "ok":
        merged, events = wire.decode_batch(payload, tokens=False), _unmerged(payload)
        assert plan_batch(merged) == plan_batch(events)
        assert confirmations(merged) == confirmations(events)
    return got


def test_the_scanner_is_built_and_in_use() -> None:
    assert frames.PART.available, frames.PART.error
    assert wire._scan is not None


@pytest.mark.parametrize("path", GOLDEN, ids=_id)
def test_golden_payloads(path) -> None:
    payload = path.read_bytes()
    assert _check(payload)[0] == "ok"
    # positional events are msgspec's to decode; every vLLM 0.33 payload is the scanner's
    assert (wire._scan(payload) is None) == (path.stem == "legacy_positional")


@pytest.mark.parametrize("path", TRACES, ids=_id)
def test_every_payload_of_the_golden_traces(path) -> None:
    trace = msgspec.msgpack.decode(path.read_bytes(), type=list[tuple[int, bytes]])
    for _, payload in trace:
        assert _check(payload)[0] == "ok"
        assert wire._scan(payload) is not None


_hash = st.integers(0, 2**64 - 1) | st.binary(min_size=16, max_size=32)
_hashes = st.lists(_hash, max_size=6)
_medium = st.sampled_from([None, "GPU", "CPU", "STORAGE", "cpu", "gpu", "storage"])
_text = st.none() | st.sampled_from(["REMOTE", "kvcr", "full_attention", "sliding_window"])
_small = st.none() | st.integers(-(2**40), 2**40)
_extra = st.lists(st.none() | st.lists(st.text(max_size=4) | st.integers(0, 99), max_size=3))
_unknown = st.dictionaries(
    st.sampled_from(["new", "x_future", "zz"]), st.integers(-(2**63), 2**64 - 1) | st.text()
)


def _event(kind: str, fields: dict, unknown: dict) -> dict:
    """An event map as vLLM's msgspec writes it: the tag first, nil fields left out."""
    present = {k: v for k, v in fields.items() if v is not None}
    return {"type": kind, **present, **unknown}


_stored = st.builds(
    _event,
    st.just("BlockStored"),
    st.fixed_dictionaries(
        {
            "block_hashes": _hashes,
            "parent_block_hash": st.none() | _hash,
            "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=40),
            "block_size": st.sampled_from([None, 0, 16, 32]),
            "lora_id": _small,
            "medium": _medium,
            "lora_name": st.none() | st.text(max_size=6),
            "extra_keys": st.none() | _extra,
            "group_idx": st.none() | st.integers(0, 3),
            "kv_cache_spec_kind": _text,
            "kv_cache_spec_sliding_window": st.none() | st.sampled_from([0, 128, 4096]),
            "locality": _text,
            "ownership": _text,
            "session_id": st.none() | st.text(max_size=6),
            "lookahead_token_ids": st.none()
            | st.lists(st.lists(st.integers(0, 2**17), max_size=3), max_size=4),
        }
    ),
    _unknown,
)
_removed = st.builds(
    _event,
    st.just("BlockRemoved"),
    st.fixed_dictionaries(
        {
            "block_hashes": _hashes,
            "medium": _medium,
            "group_idx": st.none() | st.integers(0, 3),
            "locality": _text,
            "ownership": _text,
        }
    ),
    _unknown,
)
_cleared = st.builds(_event, st.just("AllBlocksCleared"), st.just({}), _unknown)
#: Few distinct values, so neighbours are often alike and merge.
_one_hash_removal = st.builds(
    lambda h, medium: {"type": "BlockRemoved", "block_hashes": [h], "medium": medium},
    st.integers(0, 50),
    st.sampled_from([None, "GPU", "CPU"]),
)
#: A pool evicting and storing on one tier, hashes from a few values: stretches of
#: many runs, where planning moves removals first unless one removes a hash stored
#: before it.
_churn = st.builds(
    lambda kind, hashes, medium, spec: {
        "type": kind, "block_hashes": hashes, "medium": medium,
        **({"block_size": 16, "kv_cache_spec_kind": spec} if kind == "BlockStored" else {}),
    },
    st.sampled_from(["BlockStored", "BlockRemoved"]),
    st.lists(st.integers(0, 12), min_size=1, max_size=4),
    st.sampled_from([None, "CPU"]),
    st.sampled_from([None, "full_attention", "mamba"]),
)  # fmt: skip
_events = st.lists(
    _stored | _removed | _cleared | _one_hash_removal | _churn | _churn | _churn, max_size=16
)
_rank = st.none() | st.integers(0, 2**31)
_batches = st.builds(
    lambda ts, events, rank, three: msgspec.msgpack.encode(
        [ts, events, rank] if three or rank is not None else [ts, events]
    ),
    st.floats(allow_nan=False),
    _events,
    _rank,
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(_batches)
def test_generated_vllm_batches(payload: bytes) -> None:
    assert _check(payload)[0] == "ok"
    assert wire._scan(payload) is not None  # all of vLLM's shapes are the scanner's


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    payload = bytearray(draw(_batches))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(payload)))
        how = draw(st.sampled_from(["cut", "flip", "insert", "delete"]))
        if how == "cut":
            del payload[at:]
        elif how == "insert":
            payload.insert(at, draw(st.integers(0, 255)))
        elif at < len(payload):
            if how == "flip":
                payload[at] = draw(st.integers(0, 255))
            else:
                del payload[at]
    return bytes(payload)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(_mutated())
def test_mutated_and_truncated_batches(payload: bytes) -> None:
    _check(payload)


def _nested(depth: int) -> list:
    return [_nested(depth - 1)] if depth else []


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff",  # claims 4G events, has none
        b"\x92\xcb" + b"\x00" * 8 + b"\x90" + b"\x00",  # trailing byte
        msgspec.msgpack.encode([1, []]),  # an int ts: msgspec's to judge
        msgspec.msgpack.encode([1.0, [], True]),
        msgspec.msgpack.encode([1.0, [], -1]),
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1], "type": "BlockRemoved"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": None}]]
        ),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "group_idx": True}]]
        ),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "TAPE"}]]
        ),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]]),
        msgspec.msgpack.encode([1.0, [{"type": "Nope", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [7], "storage"]], 3]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}, [1]]]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "AllBlocksCleared", "x": msgspec.msgpack.Ext(1, b"")}]]
        ),
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared", "x": _nested(40)}]]),
        # a key repeated, a string that is no UTF-8 (read and skipped)
        b"\x92\xcb" + b"\x00" * 8 + b"\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
        b"\xacblock_hashes\x91\x02",
        b"\x92\xcb" + b"\x00" * 8 + b"\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
        b"\xa6medium\xa2\xff\xfe",
        b"\x92\xcb" + b"\x00" * 8 + b"\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
        b"\xa4note\xa2\xff\xfe",
    ],
)
def test_bad_and_odd_payloads_get_msgspec_s_answer(payload: bytes) -> None:
    _check(payload)


def test_an_event_over_the_hash_limit_is_rejected_as_too_many_hashes() -> None:
    hashes = list(range(base.MAX_HASHES_PER_EVENT + 1))
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": hashes}]])
    assert _check(payload)[:2] == ("error", "too_many_hashes")


def test_alike_neighbours_merge_and_lower_tier_stores_do_not() -> None:
    removals = [{"type": "BlockRemoved", "block_hashes": [h]} for h in range(5)]
    chunks = [{"type": "BlockStored", "block_hashes": [h, h + 1], "block_size": 16,
               "medium": "CPU"} for h in (10, 20)]  # fmt: skip
    gpu = [{"type": "BlockStored", "block_hashes": [h], "block_size": 16} for h in (30, 31)]
    payload = msgspec.msgpack.encode(
        [1.0, [*removals, *chunks, *gpu, {"type": "AllBlocksCleared"}]]
    )
    batch = wire.decode_batch(payload, tokens=False)
    assert [len(e.block_hashes) for e in batch.events] == [5, 2, 2, 2, 0]
    assert batch.events[0] == BlockRemoved([0, 1, 2, 3, 4])
    assert type(batch.events[-1]) is AllBlocksCleared
    assert _check(payload)[0] == "ok"


def test_a_merged_event_lists_at_most_the_limit(monkeypatch) -> None:
    most = 3
    monkeypatch.setattr(wire, "MAX_HASHES_PER_EVENT", most)
    scan = frames.scanner.IndexDecoder(
        wire.StoredHashes, BlockRemoved, AllBlocksCleared, wire.IndexedBatch, most
    )
    monkeypatch.setattr(wire, "_scan", scan)
    sizes = [1, 2, 1, 1, 3, 1]
    events = [{"type": "BlockRemoved", "block_hashes": [7] * n} for n in sizes]
    payload = msgspec.msgpack.encode([1.0, events])
    assert [len(e.block_hashes) for e in scan(payload).events] == [3, 2, 3, 1]
    assert _check(payload)[0] == "ok"


@pytest.mark.parametrize("path", TRACES, ids=_id)
def test_a_mapped_trace_has_the_loaded_trace_s_payloads(path) -> None:
    mapped = map_trace(path)
    assert [(seq, bytes(view)) for seq, view in mapped] == load_trace(path)


@pytest.mark.parametrize("size", [0, 200, 70_000])  # bin8, bin16, bin32 headers
def test_a_mapped_trace_reads_every_bin_header(tmp_path, size: int) -> None:
    path = tmp_path / "trace.msgpack"
    path.write_bytes(msgspec.msgpack.encode([[3, b"x" * size]]))
    assert [(seq, bytes(view)) for seq, view in map_trace(path)] == [(3, b"x" * size)]


def test_a_mapped_trace_refuses_what_is_no_trace(tmp_path) -> None:
    path = tmp_path / "trace.msgpack"
    for data in (b"", msgspec.msgpack.encode([[3, "text"]])):
        path.write_bytes(data)
        with pytest.raises(msgspec.MsgspecError):
            map_trace(path)


def test_a_missing_scanner_is_reported_and_warned_through_the_catalog(monkeypatch, caplog) -> None:
    monkeypatch.setattr(frames.PART, "module", None)
    monkeypatch.setattr(frames.PART, "error", "ImportError: no _frames")
    with caplog.at_level(logging.WARNING, logger="kvindex.native"):
        assert catalog.warn_if_unavailable("serve") is False
    assert [(r.role, r.import_error) for r in caplog.records] == [
        ("serve", "ImportError: no _frames")
    ]
    assert "payload scanner" in caplog.records[0].getMessage()
    assert catalog.compiled_statuses() == [
        {"compiled_core": False, "compiled_core_error": "ImportError: no _frames"}
    ]
