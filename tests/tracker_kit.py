"""Group specs, requests and offload events for the tracker's tests, built one
way so that each test says only which chunks it stores and removes."""

from __future__ import annotations

from indexer.core.events import BlockStored
from producer.tracker import GroupSpec, OffloadEvent, OffloadKey, RequestView, Tracker

BLOCK = 4


def group(idx: int = 0, blocks_per_chunk: int = 1, **kw) -> GroupSpec:
    kw.setdefault("kind", "full_attention")
    kw.setdefault("sliding_window", None)
    kw.setdefault("tokens_per_block", BLOCK)
    return GroupSpec(group_idx=idx, blocks_per_chunk=blocks_per_chunk, **kw)


def request(hashes, tokens=None, **kw) -> RequestView:
    """A request whose token i is i + 1, enough for every hash at hash block size BLOCK."""
    hashes = list(hashes)
    return RequestView(hashes, tokens or list(range(1, len(hashes) * BLOCK + 1)), **kw)


def chunk_keys(req: RequestView, spec: GroupSpec, n: int) -> list[OffloadKey]:
    per_chunk = spec.tokens_per_chunk // spec.tokens_per_hash
    return [OffloadKey(spec.group_idx, req.block_hashes[(c + 1) * per_chunk - 1]) for c in range(n)]


def store_chunks(tracker: Tracker, req: RequestView, spec: GroupSpec, n: int) -> list[OffloadKey]:
    keys = chunk_keys(req, spec, n)
    for chunk_idx, key in enumerate(keys):
        tracker.record_store(req, chunk_idx, key)
    return keys


def stored(keys, medium="CPU", **kw) -> OffloadEvent:
    return OffloadEvent(list(keys), medium, removed=False, **kw)


def removed(keys, medium="CPU", **kw) -> OffloadEvent:
    return OffloadEvent(list(keys), medium, removed=True, **kw)


def is_placeholder(event: BlockStored) -> bool:
    return event.block_size == 0 and event.token_ids == [] and len(event.block_hashes) == 1
