"""SGLang 0.5.23's :class:`~indexer.engines.base.EngineAdapter`: its wire, its page
hashes and its load.

SGLang publishes in vLLM's seq-numbered ZMQ framing (:class:`ZmqFraming`): a
PUB ``[topic, seq, payload]`` per batch, and a replay ROUTER answering
``[b"", topic, seq, payload]`` per buffered batch (10,000 by default) and then
``[b"", b"", -1, b""]``; data-parallel rank r publishes and replays on port +
r. A restart starts seq at 0 with no clear; ``AllBlocksCleared`` is the radix
cache's reset (the whole GPU tree, as kvindex clears it). The payload and the
hashes are SGLang's own (:mod:`.wire`, :mod:`.hashing`).
"""

from __future__ import annotations

import functools
from typing import Any

from indexer.engines.base import NotReproduced, Prompt
from indexer.engines.rendering import ModuleRenderer
from indexer.engines.sglang import hashing, metrics, render, server, wire
from indexer.engines.zmq_framing import ZmqFraming


@functools.lru_cache(maxsize=256)
def _hasher(block_size: int, lookahead_tokens: int) -> hashing.SglangHasher:
    return hashing.SglangHasher(block_size, lookahead_tokens)


class SglangAdapter(ZmqFraming):
    """SGLang's tagged msgpack events in vLLM's framing, SGLang's page hashes."""

    name = "sglang"
    hash_algos = hashing.HASH_ALGOS
    lora_learned = True  # its hashes name the adapter by an internal id, its events by name
    empty_tools_since = None  # its chats take no tools in kvindex (its renderer refuses them)
    compiled = None
    renderer = ModuleRenderer(render, "indexer.engines.sglang.template")
    load_path = metrics.PATH
    read_load = staticmethod(metrics.read_load)
    sources_path = server.PATH
    read_sources = staticmethod(server.read_sources)

    batch_ts = staticmethod(wire.batch_ts)
    decode = staticmethod(wire.decode_batch)
    encode = staticmethod(wire.encode_batch)

    def hasher(
        self, algo: str, seed: str | None, block_size: int, lookahead_tokens: int = 0
    ) -> hashing.SglangHasher | NotReproduced:
        """SGLang's chain; it has no seed, no other algorithm and no lookahead but its
        bigrams' one token: any other declaration is matched through the learned index."""
        if algo not in hashing.HASH_ALGOS or seed is not None or lookahead_tokens not in (0, 1):
            return NotReproduced(
                f"SGLang hashes with {hashing.HASH_ALGOS[0]}, no seed and at most one token"
                f" of lookahead, not {algo!r} seeded {seed!r} with {lookahead_tokens}"
            )
        return _hasher(block_size, lookahead_tokens)

    def stated_extras(
        self, prompt: Prompt, block_size: int, lookahead_tokens: int = 0
    ) -> list[Any]:
        """Every hashed page states the request's namespace (:func:`wire.namespace`)."""
        keys = wire.namespace(prompt.lora_name, prompt.cache_salt)
        pages = hashing.hashed_pages(len(prompt.tokens), block_size, lookahead_tokens)
        return [keys] * pages


ADAPTER = SglangAdapter()
