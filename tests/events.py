"""Builders for hand-written KV events in tests: only what a test cares about."""

from __future__ import annotations

from collections.abc import Iterable

from indexer.core.events import BlockHash, BlockRemoved, BlockStored


def stored(
    hashes: Iterable[BlockHash],
    medium: str = "GPU",
    group: int = 0,
    kind: str | None = "full_attention",
    owner: str | None = None,
    locality: str | None = None,
    block_size: int = 16,
    window: int | None = None,
) -> BlockStored:
    """A store of ``hashes``; ``block_size=0`` makes it a chunk-end placeholder.

    ``window``: a sliding-window group's window in tokens.
    """
    hashes = list(hashes)
    return BlockStored(
        hashes,
        None,
        [0] * block_size * len(hashes),
        block_size,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        ownership=owner,
        locality=locality,
    )


def removed(
    hashes: Iterable[BlockHash], medium: str = "GPU", group: int = 0, owner: str | None = None
) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group, ownership=owner)
