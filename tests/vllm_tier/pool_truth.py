"""What vLLM's GPU block pool holds, read from its blocks: the truth the tier holds
kvindex (and golden traces) to."""

from __future__ import annotations

from collections import Counter
from typing import Any


def cached_copies(pool: Any) -> Counter:
    """Each cached key (block hash and group) with the number of the pool's blocks
    holding it: each block's hash and any more it is cached under, counted over the
    blocks, not read from the hash table whose layout changed between releases (and
    which the plugin's snapshots read)."""
    keys: Counter = Counter()
    for block in pool.blocks:
        if block.block_hash is not None:
            keys[block.block_hash] += 1
        keys.update(pool.cached_block_hashes_by_block.get(block.block_id, ()))
    return keys
