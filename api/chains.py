"""Which block-hash chain stands for a ``tokens`` query on each engine.

An engine whose hashes kvindex can reproduce (a declared ``hash_algo``, and
its ``hash_seed`` where vLLM would seed the chain at random) gets them computed
exactly as vLLM does, once per distinct (algorithm, seed, block size) in the
query and converted to the form the engine publishes (uint64 or raw bytes).
Any other engine is matched through the learned token index, rank by rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from api.errors import ApiError
from indexer.core.events import BlockHash
from indexer.engines.vllm.hashing import HashSpec, MMFeature, block_hashes, published_ints
from indexer.registry import EngineSpec


@functools.lru_cache(maxsize=256)
def hash_spec(algo: str, seed: str | None, block_size: int) -> HashSpec:
    """Specs are cached: building one hashes the chain seed."""
    return HashSpec(algo, seed, block_size)


@dataclass(frozen=True, slots=True)
class Overrides:
    """A query's hashing overrides (None: the engine's declared value)."""

    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None

    def block_size_of(self, spec: EngineSpec) -> int:
        return self.block_size or spec.block_size

    def hashing_of(self, spec: EngineSpec) -> HashSpec | None:
        """How to hash for this engine; None when only the learned index can answer."""
        algo = self.hash_algo or spec.hash_algo
        if algo is None:
            return None
        seed = self.hash_seed if self.hash_seed is not None else spec.hash_seed
        hashing = hash_spec(algo, seed, self.block_size_of(spec))
        return hashing if hashing.reproducible else None


DECLARED = Overrides()


def learned(spec: EngineSpec) -> bool:
    """Whether the engine's hashes, as declared, can only be learned from its events."""
    return DECLARED.hashing_of(spec) is None


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt given as token ids, with what vLLM mixes into its block hashes."""

    tokens: tuple[int, ...]
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: Sequence[MMFeature] = ()


class ChainComputer:
    """Hashes one prompt per distinct spec, at most once, for one query."""

    def __init__(self, prompt: Prompt) -> None:
        self._prompt = prompt
        self._digests: dict[HashSpec, list[bytes]] = {}
        self._ints: dict[HashSpec, list[int]] = {}

    def chain(self, hashing: HashSpec, as_bytes: bool) -> list[BlockHash]:
        digests = self._digests.get(hashing)
        if digests is None:
            digests = self._digests[hashing] = self._hash(hashing)
        if as_bytes:
            return digests
        ints = self._ints.get(hashing)
        if ints is None:
            ints = self._ints[hashing] = published_ints(digests)
        return ints

    def _hash(self, hashing: HashSpec) -> list[bytes]:
        p = self._prompt
        try:
            return block_hashes(
                hashing,
                p.tokens,
                lora_name=p.lora_name,
                lora_path=p.lora_path,
                cache_salt=p.cache_salt,
                mm_features=p.mm_features,
                as_bytes=True,
            )
        except ValueError as e:  # e.g. a LoRA name without its path
            raise ApiError(422, str(e)) from None
