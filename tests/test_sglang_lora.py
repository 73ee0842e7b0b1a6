"""A LoRA adapter's pages on an SGLang engine, matched through what its events teach.

SGLang namespaces an adapter's page hashes by an id of its own that its events
do not carry (they name the adapter), so kvindex cannot compute them; the
events still state each page's tokens and the adapter's name. A ``tokens``
query naming ``lora_name`` walks the pages those events described, while the
base model's pages stay hashed as SGLang hashes them.
"""

from __future__ import annotations

import random

import pytest

from indexer.core.events import BlockStored, EventBatch
from indexer.engine_registry import EngineSpec
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.stores.redis import RedisStore
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import free_ports, redis_config, server_for

PAGE = 4
SGLANG = catalog.adapter("sglang")
rng = random.Random(5)
TOKENS = [rng.randrange(1, 30_000) for _ in range(10 * PAGE)]


def base_store(tokens: list[int]) -> BlockStored:
    """The base model's pages, hashed as SGLang hashes them."""
    hasher = SGLANG.hasher("sha256", None, PAGE)
    hashes = hasher.published(hasher.digests(Prompt(tuple(tokens))))
    return BlockStored(hashes, None, tokens, PAGE, extra_keys=[None] * len(hashes))


def lora_store(tokens: list[int], name: str) -> BlockStored:
    """An adapter's pages: hashes kvindex cannot compute (SGLang's internal id in them)."""
    pages = len(tokens) // PAGE
    hashes = [rng.getrandbits(64) for _ in range(pages)]
    return BlockStored(
        hashes, None, tokens, PAGE, lora_id=7, lora_name=name, extra_keys=[[name]] * pages
    )


async def gpu_blocks(live: LiveApi, **query: object) -> int:
    answer = await live.client.post("/prefix-match", json={"tokens": TOKENS, **query})
    assert answer.status_code == 200, answer.text
    (row,) = answer.json()["engines"]
    return row["gpu_blocks"]


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_an_adapters_pages_are_matched_by_tokens_through_its_events(
    request: pytest.FixtureRequest, kind: str
) -> None:
    store = None if kind == "memory" else RedisStore(redis_config(server_for(request, kind).url))
    try:
        async with LiveApi(store=store) as live:
            base = free_ports(2)
            spec = EngineSpec(
                name="sgl",
                endpoint=f"tcp://127.0.0.1:{base}",
                replay_endpoint=f"tcp://127.0.0.1:{base + 1}",
                block_size=PAGE,
                adapter="sglang",
            )
            publisher = Publisher(spec.endpoint, spec.replay_endpoint, bind=True, adapter=SGLANG)
            live.publishers.append(publisher)
            batches = [base_store(TOKENS[: 4 * PAGE]), lora_store(TOKENS[: 6 * PAGE], "math")]
            for event in batches:  # before kvindex follows: replay brings them
                assert publisher.publish(EventBatch(1.0, [event], 0))
            await live.registry.add(spec)
            await live.wait_applied("sgl", [len(batches) - 1])
            assert await gpu_blocks(live) == 4  # computed, as SGLang hashes
            assert await gpu_blocks(live, lora_name="math") == 6  # learned from the events
            assert await gpu_blocks(live, lora_name="poetry") == 0  # another adapter's
            assert await gpu_blocks(live, lora_name="math", cache_salt="t1") == 0
    finally:
        if store is not None:
            await store.close()
