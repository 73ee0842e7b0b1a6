"""The tracker's events as they leave the producer: through kvindex's wire codec
and byte for byte as vLLM 0.33 encodes them (0.34's Mamba checkpoints as a
0.34 golden trace holds them), from a producer that imports no
server code, since that is what engines and kvindex must agree on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from indexer.core.events import BlockStored, EventBatch
from indexer.engines.vllm.wire import decode_batch, encode_batch
from producer.tracker import OffloadKey, RequestView, Tracker

from .conftest import FIXTURES, trace_batches
from .tracker_kit import group, removed, request, store_chunks, stored


def test_batch_from_tracker_round_trips_through_the_wire():
    specs = [group(0, blocks_per_chunk=2), group(1, kind="mamba", sliding_window_in_chunks=1)]
    tracker = Tracker(True, specs)
    req = request([2**64 - 1, 2**63 + 5], lora_id=3, lora_name="a")
    [key] = store_chunks(tracker, req, specs[0], 1)
    events = tracker.take_events(
        [
            stored([key, OffloadKey(1, 7)], "STORAGE", locality="REMOTE", ownership="kvcr"),
            removed([key, OffloadKey(1, 7)], "STORAGE", locality="REMOTE", ownership="kvcr"),
        ]
    )
    batch = EventBatch(1760000000.25, events, 0)

    assert decode_batch(encode_batch(batch)) == batch
    assert len(events) == 4 and events[1].kv_cache_spec_kind == "mamba"


WIRE = FIXTURES / "wire"


def test_self_describing_chunk_matches_vllm_bytes():
    spec = group(tokens_per_block=16, blocks_per_chunk=4)
    tracker = Tracker(True, [spec])
    req = RequestView([7, 8, 9, 10, 11, 12, 13, 14], list(range(36, 164)))
    key = OffloadKey(0, 14)
    tracker.record_store(req, 1, key)

    events = tracker.take_events(
        [stored([key], locality="LOCAL"), removed([key], locality="LOCAL")]
    )

    expected = (WIRE / "cpu_self_describing_chunk.msgpack").read_bytes()
    assert encode_batch(EventBatch(1760000001.5, events, 0)) == expected


def test_owned_storage_tier_matches_vllm_bytes():
    spec = group(tokens_per_block=16, blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    req = RequestView([19, 20, 21, 22], [0] * 32 + list(range(32)))
    key = OffloadKey(0, 22)
    tracker.record_store(req, 1, key)
    tier = {"locality": "REMOTE", "ownership": "kvcr"}

    events = tracker.take_events(
        [stored([key], "STORAGE", **tier), removed([key], "STORAGE", **tier)]
    )

    expected = (WIRE / "storage_owned_tier.msgpack").read_bytes()
    assert encode_batch(EventBatch(1760000003.0, events, 1)) == expected


def test_placeholder_matches_vllm_bytes():
    tracker = Tracker(False, [group(tokens_per_block=16, blocks_per_chunk=4)])

    events = tracker.take_events([stored([OffloadKey(0, 2**64 - 1)])])

    expected = (WIRE / "cpu_placeholder.msgpack").read_bytes()
    assert encode_batch(EventBatch(1760000002.0, events, 0)) == expected


def test_producer_imports_no_server_dependencies():
    code = (
        "import sys, producer, producer.tracker; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'fastapi', 'redis', 'api'}); "
        "sys.exit(f'server modules imported: {bad}' if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _checkpoint_and_chunk() -> tuple[BlockStored, BlockStored]:
    """A Mamba checkpoint vLLM 0.34 put on its CPU tier in a golden trace, and the
    full-attention store of the same chunk (its hashes, parent and tokens)."""
    cpu = [
        e
        for batch in trace_batches("0.34.0/mamba-offload")
        for e in batch.events
        if type(e) is BlockStored and e.medium == "CPU" and e.parent_block_hash is not None
    ]
    chunks = {e.block_hashes[-1]: e for e in cpu if e.group_idx == 0}
    mamba = next(e for e in cpu if e.group_idx == 1 and e.block_hashes[0] in chunks)
    return mamba, chunks[mamba.block_hashes[0]]


@pytest.mark.parametrize("release", ["0.33", "0.34"])
def test_a_mamba_chunk_is_published_as_the_release_does(release: str) -> None:
    """0.34: the state checkpoint vLLM's tracker published, field for field; 0.33: the
    placeholder (the chunk's end, block size 0)."""
    vllm, chunk = _checkpoint_and_chunk()
    mamba = {"kind": "mamba", "sliding_window_in_chunks": 1}
    specs = [group(0, 4, tokens_per_block=16), group(1, 4, tokens_per_block=16, **mamba)]
    tracker = Tracker(True, specs, offload_events=release)
    # the chunk as chunk 1 of a request, after a chunk ending with the chunk's parent
    before = [0, 0, 0, chunk.parent_block_hash]
    req = RequestView([*before, *chunk.block_hashes], [0] * 64 + chunk.token_ids)
    key = OffloadKey(1, chunk.block_hashes[-1])
    tracker.record_store(req, 1, key)

    [event] = tracker.take_events([stored([key], locality=vllm.locality)])

    if release == "0.34":
        assert event == vllm
    else:
        assert (event.block_hashes, event.block_size, event.token_ids) == ([key.block_hash], 0, [])


def test_offload_events_of_a_release_the_tracker_does_not_speak_are_refused() -> None:
    with pytest.raises(ValueError, match=r"not '0\.35'"):
        Tracker(True, [group()], offload_events="0.35")
