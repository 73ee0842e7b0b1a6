"""The learned token index never matches one tenant's blocks for another.

vLLM 0.33's GPU ``BlockStored`` events list every block's extra keys (LoRA
name, cache salt, multimodal items; ``null`` for a block with none). Its
self-describing CPU/STORAGE events, from the offloading events tracker,
carry ``extra_keys = None`` whatever the request mixed into its hashes: a
LoRA adapter shows only in ``lora_name``, a cache salt not at all. The
events below are shaped that way; the engine hashes with a seed kvindex is
never told, so every ``tokens`` answer comes from the learned index.
"""

from __future__ import annotations

import pytest

from indexer.core.events import BlockHash, BlockRemoved, BlockStored, EventBatch, RankId
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.token_index import TokenIndex

from .apikit import LiveApi

SIZE = 16
PROMPT = tuple(range(1000, 1000 + 4 * SIZE))  # one chunk of 4 blocks
OTHER_PROMPT = tuple(range(5000, 5000 + 4 * SIZE))
LORA = {"lora_name": "sql-adapter", "lora_path": "/adapters/sql"}
SALT_A, SALT_B = "tenant-a", "tenant-b"
ENGINE_HASHING = HashSpec("xxhash", "the engine's secret", SIZE)  # a seed kvindex never learns
RANK = RankId("secret", 0)


def _hashes(tokens: tuple[int, ...], **extras: str) -> list[BlockHash]:
    return block_hashes(ENGINE_HASHING, tokens, **extras)


def gpu_store(tokens: tuple[int, ...], **extras: str) -> BlockStored:
    """What vLLM's block pool publishes: each block's extra keys, untagged."""
    lora, salt = extras.get("lora_name"), extras.get("cache_salt")
    per_block: list[list | None] = []
    for i in range(len(tokens) // SIZE):
        keys = [k for k in (lora, salt if i == 0 else None) if k is not None]
        per_block.append(keys or None)
    return BlockStored(
        block_hashes=_hashes(tokens, **extras),
        token_ids=list(tokens),
        block_size=SIZE,
        lora_id=1 if lora else None,
        medium="GPU",
        lora_name=lora,
        extra_keys=per_block,
    )


def offload_store(tokens: tuple[int, ...], medium: str = "CPU", **extras: str) -> BlockStored:
    """What vLLM's offloading events tracker publishes: no extra keys at all."""
    lora = extras.get("lora_name")
    return BlockStored(
        block_hashes=_hashes(tokens, **extras),
        token_ids=list(tokens),
        block_size=SIZE,
        lora_id=1 if lora else None,
        medium=medium,
        lora_name=lora,
        locality="LOCAL",
    )


def _batches() -> list[EventBatch]:
    """Tenant A (LoRA + salt) cached on GPU, offloaded to CPU, evicted from GPU;
    tenant B's (salt only) chunk on STORAGE, its GPU events long gone; and
    a plain request, to show that what can be learned still is."""
    tenant_a = {**LORA, "cache_salt": SALT_A}
    return [
        EventBatch(1.0, [gpu_store(PROMPT, **tenant_a)], 0),
        EventBatch(
            2.0,
            [
                offload_store(PROMPT, **tenant_a),
                BlockRemoved(_hashes(PROMPT, **tenant_a), "GPU"),
            ],
            0,
        ),
        EventBatch(3.0, [offload_store(PROMPT, "STORAGE", cache_salt=SALT_B)], 0),
        EventBatch(4.0, [gpu_store(OTHER_PROMPT)], 0),
    ]


# --- the index itself ----------------------------------------------------------


def _taught() -> TokenIndex:
    index = TokenIndex(1000)
    for batch in _batches():
        index.observe(RANK, batch)
    return index


def test_offload_events_without_extra_keys_teach_nothing() -> None:
    index = _taught()
    assert len(index) == 8  # tenant A's four GPU blocks and the plain request's four
    assert index.walk(RANK, PROMPT, SIZE) == []


@pytest.mark.parametrize(
    "extras",
    [
        {},
        {"cache_salt": SALT_A},
        {"lora_name": LORA["lora_name"]},
        {"lora_name": LORA["lora_name"], "cache_salt": SALT_B},
        {"cache_salt": SALT_B},  # stored, but by an event that did not say so: unknown
    ],
)
def test_a_query_matches_only_with_exactly_the_extras_learned(extras: dict[str, str]) -> None:
    assert _taught().walk(RANK, PROMPT, SIZE, **extras) == []


def test_the_tenant_that_stored_the_blocks_still_matches() -> None:
    index = _taught()
    chain = index.walk(RANK, PROMPT, SIZE, lora_name=LORA["lora_name"], cache_salt=SALT_A)
    assert chain == _hashes(PROMPT, **LORA, cache_salt=SALT_A)
    assert index.walk(RANK, OTHER_PROMPT, SIZE) == _hashes(OTHER_PROMPT)


def _index_taught(event: BlockStored) -> TokenIndex:
    index = TokenIndex(100)
    index.observe(RANK, EventBatch(1.0, [event], 0))
    return index


def test_events_that_state_extras_for_only_some_blocks_teach_nothing() -> None:
    event = gpu_store(PROMPT)
    short = BlockStored(**{**_fields(event), "extra_keys": [None]})
    assert len(_index_taught(short)) == 0


def test_an_adapter_missing_from_the_extra_keys_makes_them_unknown() -> None:
    """A LoRA adapter is in every block's extra keys; an event that names one
    (or carries only its id) but does not list it is not the whole story."""
    plain = _fields(gpu_store(PROMPT))
    assert len(_index_taught(BlockStored(**{**plain, "lora_name": "sql-adapter"}))) == 0
    assert len(_index_taught(BlockStored(**{**plain, "lora_id": 1}))) == 0
    assert len(_index_taught(gpu_store(PROMPT, **LORA))) == 4


def _fields(event: BlockStored) -> dict:
    return {f: getattr(event, f) for f in event.__struct_fields__}


# --- through the real pipeline: ZMQ, the subscriber, the HTTP API --------------


async def test_tokens_queries_never_cross_tenants_through_the_api() -> None:
    async with LiveApi() as live:
        (publisher,) = await live.add_published(
            "secret", hash_algo="xxhash", block_size=SIZE, blocks_per_chunk=4
        )
        batches = _batches()
        assert all(publisher.publish(b) for b in batches)
        await live.wait_applied("secret", [len(batches) - 1])

        async def ask(tokens: tuple[int, ...], **extras: str) -> tuple[int, int, int]:
            body = {"tokens": list(tokens), **extras}
            response = await live.client.post("/prefix-match", json=body)
            assert response.status_code == 200, response.text
            (rank,) = response.json()["engines"]
            return rank["gpu_blocks"], rank["cpu_blocks"], rank["storage_blocks"]

        assert await ask(PROMPT) == (0, 0, 0)
        assert await ask(PROMPT, cache_salt=SALT_A) == (0, 0, 0)
        assert await ask(PROMPT, **LORA) == (0, 0, 0)
        assert await ask(PROMPT, cache_salt=SALT_B) == (0, 0, 0)  # under-reports, never over
        # Tenant A's chunk, now on CPU only, is reachable through its GPU events' entries.
        assert await ask(PROMPT, **LORA, cache_salt=SALT_A) == (0, 4, 0)
        assert await ask(OTHER_PROMPT) == (4, 0, 0)
