"""A mixed fleet: vLLM and SGLang engines serving one model behind one kvindex.

Their servers render a chat otherwise (SGLang turns a final assistant message
into a user message and joins text parts with a space; vLLM keeps the role and
joins with a newline), so the same ``messages`` are different tokens on each,
and each hashes its own tokens its own way. One query must answer both exactly:
each engine is matched with its own server's tokens and its own hashes.
"""

from __future__ import annotations

import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch
from indexer.engine_registry import EngineSpec
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.rendering import ChatMessage
from indexer.prompts import ModelTokenizer
from indexer.stores.redis import RedisStore
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import free_ports, redis_config, server_for, wait_until
from .prompts_kit import FIXTURES, POOL

MODEL = "chatmlish"
MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "You route KV caches."}]},
    {"role": "user", "content": [{"type": "text", "text": "which"}, "engine holds it"]},
    {"role": "assistant", "content": "the one whose prefix is longest, of course"},
]
#: (engine, adapter, block size) of the fleet.
FLEET = (("vllm-a", "vllm", 16), ("sgl-a", "sglang", 4))


def tokens_of(adapter: str) -> list[int]:
    messages = [ChatMessage(**m) for m in MESSAGES]
    return POOL.tokens_now(MODEL, messages=messages, adapter=adapter)


def store_of(adapter: str, block_size: int, tokens: list[int]) -> BlockStored:
    """What the engine publishes once it cached the prompt: its own hashes of its tokens."""
    hasher = catalog.adapter(adapter).hasher("sha256", None, block_size)
    hashes = hasher.published(hasher.digests(Prompt(tuple(tokens))))
    full = len(hashes) * block_size
    return BlockStored(hashes, None, tokens[:full], block_size, extra_keys=[None] * len(hashes))


def test_the_two_servers_render_the_chat_differently() -> None:
    vllm, sglang = tokens_of("vllm"), tokens_of("sglang")
    assert vllm != sglang
    assert vllm[:4] == sglang[:4]  # the same model's tokenizer, the same start


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_one_messages_query_answers_each_engine_with_its_own_tokens(
    request: pytest.FixtureRequest, kind: str
) -> None:
    settings = ApiSettings(models={MODEL: ModelTokenizer(str(FIXTURES / MODEL))})
    store = None if kind == "memory" else RedisStore(redis_config(server_for(request, kind).url))
    try:
        async with LiveApi(settings=settings, store=store) as live:
            want = {}
            for name, adapter, size in FLEET:
                base = free_ports(2)
                spec = EngineSpec(
                    name=name,
                    endpoint=f"tcp://127.0.0.1:{base}",
                    replay_endpoint=f"tcp://127.0.0.1:{base + 1}",
                    model=MODEL,
                    block_size=size,
                    adapter=adapter,
                )
                engine = catalog.adapter(adapter)
                publisher = Publisher(
                    spec.endpoint, spec.replay_endpoint, bind=True, adapter=engine
                )
                live.publishers.append(publisher)
                tokens = tokens_of(adapter)
                assert publisher.publish(EventBatch(1.0, [store_of(adapter, size, tokens)], 0))
                await live.registry.add(spec)
                want[name] = len(tokens) // size

            def applied() -> bool:
                return all(live.subscriber.rank_status(n)[0].applied_seq == 0 for n, _, _ in FLEET)

            await wait_until(applied, what="both engines' stores")
            body = {"model": MODEL, "messages": MESSAGES}
            answer = (await live.client.post("/prefix-match", json=body)).json()
            got = {e["engine"]: e["gpu_blocks"] for e in answer["engines"]}
            assert got == want and all(want.values())
    finally:
        if store is not None:
            await store.close()
