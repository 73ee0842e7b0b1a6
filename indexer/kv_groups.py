"""An engine's declared KV cache groups: which kvindex can match, and the shape of the
blocks they give it (:mod:`indexer.core.large_blocks` where they span several hashes)."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from indexer.core.hybrid import MAMBA, is_scored
from indexer.core.large_blocks import LargeBlocks

Positive = Annotated[int, msgspec.Meta(ge=1)]
_RELEASE = re.compile(r"(\d+)\.(\d+)")


class KVGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache group of the engine's model; declared, its events are checked."""

    #: vLLM's ``kv_cache_spec_kind`` (``full_attention``, ``sliding_window``, ``mamba``...).
    kind: str
    #: The window in tokens, for ``sliding_window`` groups only.
    sliding_window: Positive | None = None
    #: The group's block size; null: the engine's. A multiple of it: the hash unit is
    #: then the engine's ``block_size`` (vLLM's hybrid Mamba models, docs/vllm.md).
    block_size: Positive | None = None


def check_kv_groups(groups: list[KVGroup], block_size: int) -> None:
    """Raise ValueError for groups kvindex cannot match as vLLM does: groups of one block
    size, the engine's (its hash unit) or a multiple of it for full attention and Mamba."""
    sizes = [group.block_size or block_size for group in groups]
    for i, group in enumerate(groups):
        if sizes[i] != sizes[0]:
            raise ValueError(
                f"kv_groups[{i}]: block_size {sizes[i]} differs from kv_groups[0]'s"
                f" {sizes[0]}; kvindex matches KV groups of one block size only"
                " (vLLM aligns hits across sizes to their least common multiple)"
            )
        if sizes[i] != block_size and (
            sizes[i] % block_size or not (is_scored(group.kind) or group.kind == MAMBA)
        ):
            raise ValueError(
                f"kv_groups[{i}]: block_size {sizes[i]} differs from the engine's block_size"
                f" {block_size} (tokens per block hash); kvindex takes a larger block only as"
                " a multiple of it, for full attention and Mamba groups"
            )
        if (group.kind == "sliding_window") != (group.sliding_window is not None):
            raise ValueError(
                f"kv_groups[{i}]: a sliding_window group needs its sliding_window (tokens),"
                " and only such a group has one"
            )


def released_before(release: str | None, major: int, minor: int) -> bool:
    """Whether ``release`` (None: not announced) is older than ``major.minor``."""
    found = _RELEASE.match(release or "")  # a release field's pattern: a match if set
    return found is not None and (int(found[1]), int(found[2])) < (major, minor)


def large_blocks(
    groups: list[KVGroup] | None,
    block_size: int | None,
    blocks_per_chunk: int | None,
    release: str | None,
) -> LargeBlocks | None:
    """The shape of an engine whose groups' blocks span several hash blocks of
    ``block_size`` tokens (None: they do not, or no group is declared), with tails
    anchored as its ``release`` does (vLLM 0.34 on at full attention's run)."""
    if not groups or block_size is None or (groups[0].block_size or block_size) == block_size:
        return None
    scored = tuple(i for i, g in enumerate(groups) if is_scored(g.kind))
    return LargeBlocks(
        (groups[0].block_size or block_size) // block_size,
        blocks_per_chunk,
        scored,
        tuple(i for i in range(len(groups)) if i not in scored),
        anchor_at_full_attention=not released_before(release, 0, 34),
    )
