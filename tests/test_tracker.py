"""The producer's offload event tracker: vLLM 0.33 OffloadingEventsTracker behaviour."""

from __future__ import annotations

import pytest

from indexer.core.events import BlockRemoved
from producer.tracker import OffloadEvent, OffloadKey, RequestView, Tracker

from .tracker_kit import (
    BLOCK,
    chunk_keys,
    group,
    is_placeholder,
    removed,
    request,
    store_chunks,
    stored,
)


def test_chunk_fans_out_to_its_per_block_hashes_on_store_and_removal():
    spec = group(blocks_per_chunk=3)
    tracker = Tracker(True, [spec])
    req = request(range(100, 106), lora_id=7, lora_name="sql")
    keys = store_chunks(tracker, req, spec, 2)

    first, second = tracker.take_events([stored(keys, locality="LOCAL")])

    assert first.block_hashes == [100, 101, 102]
    assert first.parent_block_hash is None
    assert first.token_ids == list(range(1, 13))
    assert second.block_hashes == [103, 104, 105]
    assert second.parent_block_hash == 102
    assert second.token_ids == list(range(13, 25))
    for event in (first, second):
        assert (event.block_size, event.medium, event.group_idx) == (BLOCK, "CPU", 0)
        assert (event.lora_id, event.lora_name, event.locality) == (7, "sql", "LOCAL")
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
            "full_attention",
            None,
        )
        assert event.extra_keys is None

    [removal] = tracker.take_events([removed(keys, locality="LOCAL")])
    assert removal == BlockRemoved([100, 101, 102, 103, 104, 105], "CPU", 0, "LOCAL")
    # The last residency is gone, so is the snapshot.
    [again] = tracker.take_events([stored(keys[:1])])
    assert is_placeholder(again) and again.block_hashes == [102]


def test_parent_links_chunks_published_in_separate_batches():
    spec = group()
    tracker = Tracker(True, [spec])
    keys = store_chunks(tracker, request(range(6)), spec, 6)

    batch1 = tracker.take_events([stored(keys[:3])])
    batch2 = tracker.take_events([stored(keys[3:])])

    assert [e.block_hashes for e in batch1 + batch2] == [[i] for i in range(6)]
    assert batch2[0].parent_block_hash == batch1[-1].block_hashes[-1]


def test_key_order_is_free_and_unknown_keys_get_placeholders():
    spec = group(blocks_per_chunk=3)
    tracker = Tracker(True, [spec])
    keys = store_chunks(tracker, request(range(6)), spec, 2)

    chunk1, placeholder, chunk0 = tracker.take_events(
        [stored([keys[1], OffloadKey(0, 12345), keys[0]])]
    )

    assert [len(e.block_hashes) for e in (chunk1, placeholder, chunk0)] == [3, 1, 3]
    assert is_placeholder(placeholder) and placeholder.block_hashes == [12345]
    assert chunk0.parent_block_hash is None
    assert chunk1.parent_block_hash == chunk0.block_hashes[-1]


def test_disabled_tracker_records_nothing_and_emits_placeholders():
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(False, [spec])
    req = request(range(6))
    keys = store_chunks(tracker, req, spec, 3)
    for chunk_idx, key in enumerate(keys):
        tracker.record_lookup(req, chunk_idx, key)

    events = tracker.take_events([stored(keys, locality="REMOTE"), removed(keys)])

    assert all(is_placeholder(e) for e in events[:3])
    assert [e.block_hashes[0] for e in events[:3]] == [1, 3, 5]
    # Without self-describing events vLLM 0.33 leaves the group spec off.
    assert {(e.kv_cache_spec_kind, e.locality) for e in events[:3]} == {(None, "REMOTE")}
    assert events[3:] == [BlockRemoved([1, 3, 5], "CPU", 0)]


@pytest.mark.parametrize("window_chunks", [1, 2], ids=["ssm", "sliding-window"])
def test_sliding_window_groups_keep_placeholders_with_their_group_spec(window_chunks):
    spec = group(
        1, kind="sliding_window", sliding_window=128, sliding_window_in_chunks=window_chunks
    )
    tracker = Tracker(True, [spec])
    req = request(range(3))
    keys = store_chunks(tracker, req, spec, 3)
    tracker.record_lookup(req, 0, keys[0])
    tracker.record_partial_store(req, BLOCK, keys[0])
    tracker.record_partial_lookup(req, BLOCK, keys[0])

    events = tracker.take_events([stored(keys)])

    assert all(is_placeholder(e) for e in events)
    assert {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events
    } == {(1, "sliding_window", 128)}


@pytest.mark.parametrize(("blocks_per_chunk", "expected"), [(1, [63]), (2, [63, 127])])
def test_fine_request_hashes_resolve_to_block_hashes(blocks_per_chunk, expected):
    """A block's hash is the last finer request hash inside it (hybrid hash block size)."""
    spec = group(blocks_per_chunk=blocks_per_chunk, tokens_per_block=256, hash_block_size=4)
    tracker = Tracker(True, [spec])
    req = request(range(64 * blocks_per_chunk))
    [key] = store_chunks(tracker, req, spec, 1)

    [event] = tracker.take_events([stored([key])])

    assert event.block_hashes == expected
    assert event.block_size == 256
    assert len(event.token_ids) == 256 * blocks_per_chunk


def test_chunk_restored_after_eviction_carries_the_new_snapshot():
    spec = group()
    tracker = Tracker(True, [spec])
    [key] = store_chunks(tracker, request([9]), spec, 1)
    [first] = tracker.take_events([stored([key])])
    tracker.take_events([removed([key])])

    tracker.record_store(request([9], tokens=[5, 6, 7, 8]), 0, key)
    [second] = tracker.take_events([stored([key])])

    assert first.token_ids == [1, 2, 3, 4]
    assert second.token_ids == [5, 6, 7, 8]


def test_removals_are_grouped_by_kv_group():
    specs = [group(0, blocks_per_chunk=2), group(1, blocks_per_chunk=2)]
    tracker = Tracker(True, specs)
    key0 = store_chunks(tracker, request([0, 1]), specs[0], 1)[0]
    key1 = store_chunks(tracker, request([10, 11]), specs[1], 1)[0]

    events = tracker.take_events([removed([key0, OffloadKey(1, 99), key1], ownership="kvcr")])

    assert events == [
        BlockRemoved([0, 1], "CPU", 0, ownership="kvcr"),
        BlockRemoved([99, 10, 11], "CPU", 1, ownership="kvcr"),
    ]


@pytest.mark.parametrize("primary_first", [True, False])
def test_owned_secondary_tier_keeps_the_snapshot_until_the_last_removal(primary_first):
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    [key] = store_chunks(tracker, request([1, 2]), spec, 1)
    tracker.take_events([stored([key])])
    [secondary] = tracker.take_events(
        [stored([key], "STORAGE", locality="REMOTE", ownership="kvcr")]
    )
    primary = removed([key])
    owned = removed([key], "STORAGE", locality="REMOTE", ownership="kvcr")

    first, last = (primary, owned) if primary_first else (owned, primary)
    [r1] = tracker.take_events([first])
    [r2] = tracker.take_events([last])
    [r3] = tracker.take_events([last])

    assert (secondary.block_hashes, secondary.ownership) == ([1, 2], "kvcr")
    assert r1.block_hashes == r2.block_hashes == [1, 2]
    assert r3.block_hashes == [2]  # snapshot gone: the chunk-end placeholder


def test_tier_without_removals_does_not_keep_the_snapshot():
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    [key] = store_chunks(tracker, request([1, 2]), spec, 1)
    tracker.take_events([stored([key]), stored([key], "STORAGE", removal_expected=False)])

    tracker.take_events([removed([key])])
    [restored] = tracker.take_events([stored([key], "STORAGE", removal_expected=False)])

    assert is_placeholder(restored)


def test_removal_before_a_queued_secondary_store_in_one_batch_keeps_the_payload():
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    [key] = store_chunks(tracker, request([1, 2]), spec, 1)
    tracker.take_events([stored([key])])

    removal, store = tracker.take_events([removed([key]), stored([key], ownership="kvcr")])
    [later] = tracker.take_events([removed([key], ownership="kvcr")])

    assert removal.block_hashes == store.block_hashes == later.block_hashes == [1, 2]
    assert store.token_ids == list(range(1, 9))


def test_metadata_only_removal_drops_the_residency_silently():
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    [key] = store_chunks(tracker, request([1, 2]), spec, 1)
    tracker.take_events([stored([key]), stored([key], "STORAGE", ownership="kvcr")])

    silent = tracker.take_events([removed([key], "STORAGE", ownership="kvcr", metadata_only=True)])
    [cpu] = tracker.take_events([removed([key])])
    [after] = tracker.take_events([removed([key], "STORAGE", ownership="kvcr")])

    assert silent == []
    assert cpu.block_hashes == [1, 2]
    assert after.block_hashes == [2]  # the failed store no longer held the snapshot


def test_metadata_only_applies_to_removals():
    with pytest.raises(ValueError, match="removals only"):
        OffloadEvent([OffloadKey(0, 1)], "CPU", removed=False, metadata_only=True)
    with pytest.raises(ValueError, match="CPU or STORAGE"):
        OffloadEvent([OffloadKey(0, 1)], "GPU", removed=True)


def test_lookup_backfills_a_promoted_chunk_without_overwriting_a_store():
    spec = group()
    tracker = Tracker(True, [spec])
    req = request([1, 2])
    [hit, kept] = chunk_keys(req, spec, 2)
    tracker.record_lookup(req, 0, hit)
    tracker.record_store(req, 1, kept)
    tracker.record_lookup(request([1, 2], tokens=[9] * 8), 1, kept)

    promoted, stored_chunk = tracker.take_events([stored([hit, kept])])

    assert (promoted.block_hashes, promoted.token_ids) == ([1], [1, 2, 3, 4])
    assert (stored_chunk.parent_block_hash, stored_chunk.token_ids) == (1, [5, 6, 7, 8])


def test_lookup_registers_the_primary_residency_on_an_existing_snapshot():
    """vLLM 0.33: a hit re-registers (CPU, None), so the primary's later removal
    still fans out after the owned tier let go."""
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    req = request([1, 2])
    [key] = store_chunks(tracker, req, spec, 1)
    tracker.take_events([stored([key]), stored([key], "STORAGE", ownership="kvcr")])
    tracker.take_events([removed([key])])  # snapshot lives on for kvcr only

    tracker.record_lookup(req, 0, key)
    tracker.take_events([removed([key], "STORAGE", ownership="kvcr")])
    [cpu] = tracker.take_events([removed([key])])

    assert cpu.block_hashes == [1, 2]


def test_unallocated_lookups_add_no_state():
    spec = group()
    tracker = Tracker(True, [spec])
    req = request([1])
    [key] = chunk_keys(req, spec, 1)
    tracker.record_lookup(req, 0, key, allocated=False)
    tracker.record_partial_lookup(req, BLOCK, key, allocated=False)

    [event] = tracker.take_events([stored([key])])

    assert is_placeholder(event)


def test_reset_forgets_every_snapshot():
    spec = group()
    tracker = Tracker(True, [spec])
    keys = store_chunks(tracker, request(range(3)), spec, 3)

    tracker.reset()

    assert all(is_placeholder(e) for e in tracker.take_events([stored(keys)]))


def test_partial_tail_describes_only_its_valid_hashes_and_tokens():
    spec = group(tokens_per_block=16, hash_block_size=4)
    tracker = Tracker(True, [spec])
    req = RequestView([b"h%d" % i for i in range(8)], list(range(1, 33)))
    key = OffloadKey(0, b"h6")

    tracker.record_partial_store(req, 28, key)
    [event] = tracker.take_events([stored([key])])

    assert event.block_hashes == [b"h4", b"h5", b"h6"]
    assert event.parent_block_hash == b"h3"
    assert event.token_ids == list(range(17, 29))
    assert event.block_size == 4


def test_partial_lookup_does_not_overwrite_a_partial_store():
    spec = group()
    tracker = Tracker(True, [spec])
    key = OffloadKey(0, 1)
    tracker.record_partial_store(request([1]), BLOCK, key)
    tracker.record_partial_lookup(request([1], tokens=[9, 9, 9, 9]), BLOCK, key)

    [event] = tracker.take_events([stored([key])])

    assert event.token_ids == [1, 2, 3, 4]


@pytest.mark.parametrize(("method", "position"), [("record_store", 0), ("record_partial_store", 8)])
def test_reoffload_keeps_the_secondary_residency(method, position):
    """Re-snapshotting a chunk must not forget the tiers that still hold it."""
    spec = group(blocks_per_chunk=2)
    tracker = Tracker(True, [spec])
    req = request([1, 2])
    key = OffloadKey(0, 2)
    tracker.record_lookup(req, 0, key)
    [secondary] = tracker.take_events([stored([key], "STORAGE", ownership="kvcr")])

    getattr(tracker, method)(req, position, key)
    tracker.take_events([removed([key])])
    [owned] = tracker.take_events([removed([key], "STORAGE", ownership="kvcr")])
    [gone] = tracker.take_events([removed([key], "STORAGE", ownership="kvcr")])

    assert secondary.token_ids == list(range(1, 9))
    assert (owned.block_hashes, owned.ownership) == ([1, 2], "kvcr")
    assert gone.block_hashes == [2]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t, r: t.record_store(r, 0, OffloadKey(0, 2)), "does not end"),
        (lambda t, r: t.record_store(r, 2, OffloadKey(0, 2)), "does not cover"),
        (lambda t, r: t.record_store(r, 0, OffloadKey(5, 1)), "no GroupSpec"),
        (lambda t, r: t.record_partial_store(r, 3, OffloadKey(0, 1)), "tail boundary"),
    ],
)
def test_inconsistent_requests_are_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call(Tracker(True, [group()]), request([1, 2]))


def test_group_spec_rejects_block_not_made_of_whole_hashes():
    with pytest.raises(ValueError, match="not a multiple"):
        group(tokens_per_block=16, hash_block_size=5)
