"""vLLM 0.33's :class:`~indexer.engines.base.EngineAdapter`: its wire, framing, hashing,
compiled hashing core and OpenAI front end."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from indexer.compiled import Status, combined
from indexer.engines import vllm_metrics, vllm_server
from indexer.engines.base import Prompt
from indexer.engines.rendering import ModuleRenderer
from indexer.engines.vllm import frames, native, render, responses, wire
from indexer.engines.zmq_framing import ZmqFraming

if TYPE_CHECKING:  # hashing (hashlib, pickle) loads on first use: ingest and replay need none
    from indexer.engines.vllm import hashing


def _hashing() -> ModuleType:
    """vLLM's block hashing, imported on first use (a tenth of replay's start-up)."""
    from indexer.engines.vllm import hashing

    return hashing


@dataclass(frozen=True, slots=True)
class VllmHasher:
    """vLLM's block hashing for one :class:`~indexer.engines.vllm.hashing.HashSpec`."""

    spec: hashing.HashSpec

    @property
    def reproducible(self) -> bool:
        return self.spec.reproducible

    def digests(self, prompt: Prompt) -> list[bytes]:
        return _hashing().block_hashes(
            self.spec,
            prompt.tokens,
            lora_name=prompt.lora_name,
            lora_path=prompt.lora_path,
            cache_salt=prompt.cache_salt,
            mm_features=prompt.mm_features,
            as_bytes=True,
        )

    def published(self, digests: list[bytes]) -> list[int]:
        return _hashing().published_ints(digests)


@functools.lru_cache(maxsize=256)
def _hasher(algo: str, seed: str | None, block_size: int, lookahead_tokens: int) -> VllmHasher:
    """Cached: building a spec hashes the chain seed."""
    return VllmHasher(_hashing().HashSpec(algo, seed, block_size, lookahead_tokens))


def _untag(key: tuple[Any, ...]) -> Any:
    """A hash-input extra key to the value events publish for it."""
    tag, *values = key
    if tag == "lora":  # events carry the adapter name, not its path
        return values[0]
    return values[0] if len(values) == 1 else tuple(values)


class VllmCompiled:
    """vLLM's compiled parts, reported as one: the hashing core and the payload scanner."""

    parts = (native.PART, frames.PART)

    def status(self) -> Status:
        return combined(part.status() for part in self.parts)

    def warn_if_unavailable(self, role: str) -> bool:
        in_use = [part.warn_if_unavailable(role) for part in self.parts]  # each warns
        return all(in_use)


class VllmAdapter(ZmqFraming):
    """Maps (or positional arrays) in msgpack, seq-numbered ZMQ frames, vLLM's hashes."""

    name = "vllm"
    lora_learned = False  # the adapter's name is one of each block's extra keys
    empty_tools_since = (0, 34)  # 0.33 refuses tools: []
    compiled = VllmCompiled()
    renderer = ModuleRenderer(render, "indexer.engines.vllm.template", responses.responses_call)
    load_path = vllm_metrics.PATH
    read_load = staticmethod(vllm_metrics.read_load)
    sources_path = vllm_server.PATH
    read_sources = staticmethod(vllm_server.read_sources)

    batch_ts = staticmethod(wire.batch_ts)
    decode = staticmethod(wire.decode_batch)
    encode = staticmethod(wire.encode_batch)

    @property
    def hash_algos(self) -> tuple[str, ...]:
        return _hashing().HASH_ALGOS

    def hasher(
        self, algo: str, seed: str | None, block_size: int, lookahead_tokens: int = 0
    ) -> VllmHasher:
        return _hasher(algo, seed, block_size, lookahead_tokens)

    def stated_extras(
        self, prompt: Prompt, block_size: int, lookahead_tokens: int = 0
    ) -> list[tuple[Any, ...] | None]:
        """The hash-input keys untagged, as events list them: where hashing mixes in
        ``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt", salt)``, the
        events give ``name``, ``(id, offset)``, ``salt`` (with lookahead, those of the
        block and the tokens after it, as its hash)."""
        lora = ("lora", prompt.lora_name, None) if prompt.lora_name is not None else None
        hashing = _hashing()
        n_blocks = hashing.hashed_blocks(len(prompt.tokens), block_size, lookahead_tokens)
        keys = hashing.block_extra_keys(
            n_blocks, block_size, lora, prompt.cache_salt, prompt.mm_features, lookahead_tokens
        )
        return [tuple(map(_untag, extra)) if extra else None for extra in keys]


ADAPTER = VllmAdapter()
