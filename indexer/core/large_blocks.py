"""Engines whose KV blocks span several hash blocks: vLLM's hybrid Mamba models.

Pure logic, no I/O. A hybrid Mamba model's attention block is made as large
as a Mamba state page (say 64 tokens) while prefix caching still hashes every
``block_size`` tokens (say 16, vLLM's ``--prefix-match-unit``): each block is
``units_per_block`` hash blocks, called units here. Such an engine publishes
blocks of two sizes in one group: a full block is one hash, the unit chain's
hash at the block's end; a prompt ending inside a block adds a partial entry,
one unit's hash (removed once the block fills). On the CPU tier a whole chunk
is one store and a tail inside a block one store listing its units' hashes.

vLLM's rules over them, in units:

- GPU hit: full attention's run of whole blocks, each by its last unit's hash,
  then the highest unit inside the next block it holds; the hit is the
  rightmost unit at or below that which every Mamba group holds.
- Lower-tier lookup after ``start`` units: whole chunks, the rightmost end of
  full attention's chunk run from the chunk holding ``start`` that the Mamba
  groups hold (a chunk past ``start`` at least); then, with one block per
  chunk, a tail: the highest unit boundary above that, up to the chain's end
  and short of the end of the block after an anchor (block ends at or below
  the anchor left out), whose hash every group holds, with that block's chunk
  in every group when the boundary lies at or past it. The anchor is the
  whole-chunk hit; since vLLM 0.34 the end of full attention's run instead
  when that is larger and a chunk past ``start``.

A lower tier may add less than a chunk here (a tail): unlike
:func:`indexer.core.matching.loadable`, nothing is dropped for being short.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from indexer.core.events import CPU, GPU, LOWER_TIERS, STORAGE, BlockHash
from indexer.core.matching import PrefixMatch

#: What a rank holds of a chain, by (medium, group_idx): the chain's hashes resident there.
ChainHeld = Mapping[tuple[str, int], Collection[BlockHash]]


@dataclass(frozen=True, slots=True)
class LargeBlocks:
    """The shape of an engine whose blocks are ``units_per_block`` hash blocks.

    ``chunk_blocks``: blocks per offload chunk (None: no lower tier);
    ``full_groups``/``mamba_groups``: the KV groups by kind;
    ``anchor_at_full_attention``: tails anchored as vLLM 0.34 does (0.33: False).
    """

    units_per_block: int
    chunk_blocks: int | None
    full_groups: tuple[int, ...]
    mamba_groups: tuple[int, ...]
    anchor_at_full_attention: bool = True


def large_block_match(
    chain: Sequence[BlockHash], held: ChainHeld, shape: LargeBlocks
) -> PrefixMatch:
    """A rank's match of a unit chain, every count in units (hash blocks)."""
    walk = _Walk(chain, held, shape)
    gpu, full = walk.gpu()
    full_run = full if full != gpu else None
    if not shape.chunk_blocks:
        return PrefixMatch(gpu, prefix_blocks=gpu, full_attention_blocks=full_run)
    prefix = walk.lower(LOWER_TIERS, gpu)
    from_cpu = max(0, min(walk.lower((CPU,), gpu), prefix) - gpu)
    return PrefixMatch(
        gpu,
        walk.lower((CPU,), 0),
        walk.lower((STORAGE,), 0),
        prefix,
        from_cpu,
        prefix - gpu - from_cpu,
        full_run,
    )


class _Walk:
    """The rules of the module doc over one chain; units are counted from 1 (unit
    ``u`` ends ``u`` hash blocks in, and is held where its hash is)."""

    def __init__(self, chain: Sequence[BlockHash], held: ChainHeld, shape: LargeBlocks) -> None:
        self.chain, self.held, self.shape = chain, held, shape
        self.block = shape.units_per_block
        self.chunk = (shape.chunk_blocks or 1) * self.block

    def holds(self, media: Sequence[str], groups: Sequence[int], unit: int) -> bool:
        """Whether every group of ``groups`` holds the unit on one of ``media``."""
        key = self.chain[unit - 1]
        return all(any(key in self.held.get((m, g), ()) for m in media) for g in groups)

    def run(self, media: Sequence[str], start: int, step: int) -> int:
        """Full attention's run of ``step``-unit spans from ``start``, each by its end."""
        end, full, n = start, self.shape.full_groups, len(self.chain)
        while end + step <= n and self.holds(media, full, end + step):
            end += step
        return end

    def gpu(self) -> tuple[int, int]:
        """The GPU hit, and full attention's (its run, then a partial entry)."""
        full = self.run((GPU,), 0, self.block)
        top = min(full + self.block - 1, len(self.chain))
        groups = self.shape.full_groups
        full = next((u for u in range(top, full, -1) if self.holds((GPU,), groups, u)), full)
        mamba = self.shape.mamba_groups
        return next((u for u in range(full, 0, -1) if self.holds((GPU,), mamba, u)), 0), full

    def lower(self, media: Sequence[str], start: int) -> int:
        """Where a load from ``media`` after ``start`` units ends (``start``: none)."""
        chunk, shape = self.chunk, self.shape
        run = self.run(media, start - start % chunk, chunk)
        ends = range(run, start + chunk - 1, -chunk)
        complete = next((u for u in ends if self.holds(media, shape.mamba_groups, u)), start)
        if shape.chunk_blocks != 1:
            return complete
        anchor = complete
        if shape.anchor_at_full_attention and run - start >= chunk:
            anchor = max(complete, run)
        return self._tail(media, complete, anchor)

    def _tail(self, media: Sequence[str], complete: int, anchor: int) -> int:
        """The highest tail boundary above ``complete`` (see the module doc)."""
        block, groups = self.block, (*self.shape.full_groups, *self.shape.mamba_groups)
        bridge = anchor - anchor % block + block
        bridged = None  # whether every group holds the bridge block: asked once
        for boundary in range(min(len(self.chain), anchor + block - 1), complete, -1):
            if boundary <= anchor and boundary % block == 0:
                continue
            if boundary >= bridge:
                if bridged is None:
                    bridged = self.holds(media, groups, bridge)
                if not bridged:
                    continue
            if self.holds(media, groups, boundary):
                return boundary
        return complete
