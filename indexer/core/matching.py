"""Prefix matching: how much of a block-hash chain one engine rank can serve.

Pure logic, no I/O. Every store combines its per-tier lookups into a
:class:`PrefixMatch` with :func:`match_prefix` (hybrid models then go through
:func:`indexer.core.hybrid.hybrid_match`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from indexer.core.events import CPU, LOWER_TIERS, STORAGE, BlockHash


@dataclass(frozen=True, slots=True)
class TierWeights:
    """Score per prefix block by the tier it would be served from: what a block there
    saves the engine, relative to a GPU hit. A query's ``weights`` override them."""

    #: A block the engine reuses from GPU.
    gpu: float = 1.0
    #: A block loaded from the CPU tier: cheaper than computing it, dearer than GPU.
    cpu: float = 0.8
    #: A block loaded from the storage tier.
    storage: float = 0.5
    #: A block a router has just sent to the rank that its events have not confirmed
    #: yet: lower it when routers record picks they may not send.
    routed: float = 0.8


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a block-hash chain one engine rank can serve, tier by tier.

    ``gpu_blocks``: leading blocks the engine reuses from GPU (for a hybrid model
    the fixed point over its KV groups, see :func:`hybrid_match`).
    ``cpu_blocks``/``storage_blocks``:
    leading blocks loadable from that tier alone, in whole chunks.
    ``prefix_blocks``: the GPU run extended by whole chunks from any lower
    tier, when that adds a chunk's worth of blocks or more (:func:`loadable`);
    ``from_cpu``/``from_storage`` count the prefix blocks that extension
    takes from each.
    """

    gpu_blocks: int = 0
    cpu_blocks: int = 0
    storage_blocks: int = 0
    prefix_blocks: int = 0
    from_cpu: int = 0
    from_storage: int = 0
    full_attention_blocks: int | None = None  # None: the same as gpu_blocks

    @property
    def gpu_blocks_full_attention(self) -> int:
        """The leading GPU run of the full-attention groups alone (hybrid models may
        reuse less: ``gpu_blocks`` is what vLLM's scheduler would reuse)."""
        fa = self.full_attention_blocks
        return self.gpu_blocks if fa is None else fa

    def score(self, weights: TierWeights) -> float:
        from_gpu = self.prefix_blocks - self.from_cpu - self.from_storage
        return (
            from_gpu * weights.gpu
            + self.from_cpu * weights.cpu
            + self.from_storage * weights.storage
        )


#: What a rank matches when a store's answer leaves it out: nothing, on every tier.
NO_MATCH = PrefixMatch()


#: ``chunk_in(medium, j)``: is chunk ``j`` of the chain resident on that lower medium?
ChunkLookup = Callable[[str, int], bool]


def match_prefix(
    num_blocks: int, gpu_blocks: int, chunk_blocks: int | None, chunk_in: ChunkLookup
) -> PrefixMatch:
    """Combine a GPU run and lower-tier chunk residency into a prefix match.

    Lower tiers load whole chunks, aligned to the start of the prompt, and a
    chunk is resident exactly when its end hash is (the chain hash of the end
    block fixes the whole chunk). After the GPU run, the engine loads the
    chunk holding the first missing block and the ones after it, CPU first.
    One pass over the chunks asks each tier at most once per chunk and stops
    as soon as no answer can grow.
    """
    if not chunk_blocks:
        return PrefixMatch(gpu_blocks, prefix_blocks=gpu_blocks)
    chunks = num_blocks // chunk_blocks
    runs: dict[str, int | None] = {CPU: None, STORAGE: None}  # None: still running
    taken = {CPU: 0, STORAGE: 0}
    prefix, extending, first = gpu_blocks, True, gpu_blocks // chunk_blocks
    for j in range(chunks):
        grow = extending and j >= first
        if not grow and runs[CPU] is not None and runs[STORAGE] is not None:
            if not extending:
                break
            continue  # the GPU run still covers chunk j: nothing to ask until `first`
        source = None  # the first lower tier holding chunk j, once asked
        for medium in LOWER_TIERS:
            if runs[medium] is None or (grow and source is None):
                if chunk_in(medium, j):
                    source = source or medium
                elif runs[medium] is None:
                    runs[medium] = j
        if grow:
            if source is None:
                extending = False
            else:
                taken[source] += (j + 1) * chunk_blocks - prefix
                prefix = (j + 1) * chunk_blocks
    cpu, storage = (chunks if runs[m] is None else runs[m] for m in LOWER_TIERS)
    return PrefixMatch(
        gpu_blocks, cpu * chunk_blocks, storage * chunk_blocks, prefix, taken[CPU], taken[STORAGE]
    )


def loadable(match: PrefixMatch, chunk_blocks: int | None) -> PrefixMatch:
    """``match`` as vLLM's offloading connector loads it: never less than a whole chunk
    of blocks after the GPU hit (it skips a shorter load, e.g. the rest of a chunk
    the GPU holds most of), so a lower tier adding fewer leaves the prefix the GPU's.

    Every store applies this last, to the match its walk found.
    """
    gain = match.prefix_blocks - match.gpu_blocks
    if not chunk_blocks or not 0 < gain < chunk_blocks:
        return match
    return replace(match, prefix_blocks=match.gpu_blocks, from_cpu=0, from_storage=0)


def chunk_end(chain: Sequence[BlockHash], chunk_blocks: int, j: int) -> BlockHash:
    """The hash that identifies chunk ``j`` of a chain: its last block's."""
    return chain[(j + 1) * chunk_blocks - 1]


def leading_run(chain: Sequence[BlockHash], tables: Sequence[dict[BlockHash, int]]) -> int:
    """Number of leading hashes of ``chain`` resident in any of ``tables``."""
    if len(tables) == 1:
        (table,) = tables
        for i, h in enumerate(chain):
            if h not in table:
                return i
        return len(chain)
    for i, h in enumerate(chain):
        if not any(h in t for t in tables):
            return i
    return len(chain)
