"""Which block-hash chain stands for a ``tokens`` query on each engine.

An engine whose hashes kvindex can reproduce (its adapter computes them for
the declared ``hash_algo``, and ``hash_seed`` where the engine would seed the
chain at random) gets them computed exactly as the engine does (with its
declared ``lookahead_tokens``), once per distinct hasher (adapter, algorithm,
seed, block size, lookahead tokens) in the query and
converted to the form the engine publishes (uint64 or raw bytes). Any other
engine is matched through the learned token index, rank by rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from indexer.core.events import BlockHash
from indexer.core.matching import TierWeights
from indexer.engine_registry import EngineSpec
from indexer.engines.base import BlockHasher, Prompt
from indexer.query.errors import QueryRefused

__all__ = ["DECLARED", "ChainComputer", "Overrides", "Prompt", "Query", "learned"]


@dataclass(frozen=True, slots=True)
class Overrides:
    """A query's hashing overrides (None: the engine's declared value)."""

    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None

    def hashing_of(self, spec: EngineSpec, block_size: int) -> BlockHasher | None:
        """How to hash for this engine at ``block_size`` (the query's, else the engine's
        declared or learned one); None when only the learned index can answer."""
        algo = self.hash_algo or spec.hash_algo
        if algo is None:
            return None
        seed = self.hash_seed if self.hash_seed is not None else spec.hash_seed
        hashing = spec.engine_adapter.hasher(algo, seed, block_size, spec.lookahead_tokens)
        return hashing if hashing.reproducible else None


DECLARED = Overrides()
#: Whether hashes are reproducible is the algorithm's and the seed's to say, not the
#: block size's: any size asks it of an engine whose own is not known yet.
_ANY_SIZE = 16


def learned(spec: EngineSpec) -> bool:
    """Whether the engine's hashes, as declared, can only be learned from its events."""
    return DECLARED.hashing_of(spec, spec.block_size or _ANY_SIZE) is None


class ChainComputer:
    """Hashes one prompt per distinct hasher, at most once, for one query."""

    def __init__(self, prompt: Prompt) -> None:
        self._prompt = prompt
        self._digests: dict[BlockHasher, list[bytes]] = {}
        self._ints: dict[BlockHasher, list[int]] = {}

    def chain(self, hashing: BlockHasher, as_bytes: bool) -> list[BlockHash]:
        digests = self._digests.get(hashing)
        if digests is None:
            digests = self._digests[hashing] = self._hash(hashing)
        if as_bytes:
            return digests
        ints = self._ints.get(hashing)
        if ints is None:
            ints = self._ints[hashing] = hashing.published(digests)
        return ints

    def _hash(self, hashing: BlockHasher) -> list[bytes]:
        try:
            return hashing.digests(self._prompt)
        except ValueError as e:  # e.g. a LoRA name without its path
            raise QueryRefused(str(e)) from None


@dataclass(frozen=True, slots=True)
class Query:
    """A parsed prefix-match request: ``chain`` (block hashes) or ``prompt`` (tokens)."""

    chain: list[BlockHash] | None = None
    prompt: Prompt | None = None
    #: the prompt as the engines of other adapters take it, by adapter: their servers
    #: render a ``prompt`` or ``messages`` otherwise than the model's (``prompt``)
    rendered: Mapping[str, Prompt] = field(default_factory=dict)
    model: str | None = None
    engines: Sequence[str] | None = None
    overrides: Overrides = field(default_factory=Overrides)
    weights: TierWeights | None = None  # None: the configured ones
    route: bool = False  # pick the best rank and record the prompt as routed to it
    ttl: float = 0.0  # seconds the routed entries of ``route`` live

    def prompt_for(self, spec: EngineSpec) -> Prompt | None:
        """The prompt as this engine takes it."""
        return self.rendered.get(spec.adapter, self.prompt)
