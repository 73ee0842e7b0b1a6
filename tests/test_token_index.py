"""The learned token index: tokens to hashes for engines kvindex cannot hash for.

The end-to-end proof runs simulated engines that seed xxhash with a random
secret, as vLLM does without PYTHONHASHSEED, and checks every answer by
tokens against what each engine itself holds.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import httpx
import pytest

from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engines.vllm.hashing import MMFeature
from indexer.token_index import TokenIndex
from producer.sim import SimConfig, SimEngine
from producer.workload import Request, Workload, WorkloadConfig

from .apikit import Api, LiveApi, engine

A, B = RankId("a", 0), RankId("a", 1)


def stored(hashes, tokens, parent=None, size=4, **fields) -> EventBatch:
    """A GPU-shaped store: every block's extra keys stated (none, unless given)."""
    hashes = list(hashes)
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=size,
        **{"extra_keys": [None] * len(hashes), **fields},
    )
    return EventBatch(1.0, [event], 0)


def test_walks_what_the_events_described_and_stops_at_the_first_unknown_block() -> None:
    index = TokenIndex(100)
    index.observe(A, stored([11, 12, 13], range(12)))
    index.observe(A, stored([14], range(12, 16), parent=13))
    assert index.walk(A, range(18), 4) == [11, 12, 13, 14]
    assert index.walk(A, [0, 1, 2, 3, 9, 9, 9, 9, *range(8, 16)], 4) == [11]
    assert index.walk(A, range(3), 4) == []


def test_each_rank_has_its_own_entries() -> None:
    index = TokenIndex(100)
    index.observe(A, stored([11], range(4)))
    index.observe(B, stored([21], range(4)))
    assert index.walk(A, range(4), 4) == [11]
    assert index.walk(B, range(4), 4) == [21]
    assert index.walk(RankId("b", 0), range(4), 4) == []
    assert index.ranks("a") == {0, 1}


def test_placeholders_and_partial_stores_teach_nothing() -> None:
    index = TokenIndex(100)
    index.observe(A, stored([99], [], size=0, medium="CPU"))
    index.observe(A, stored([11, 12], range(6)))  # tokens do not cover the blocks
    assert len(index) == 0


def test_extra_keys_match_in_any_order_and_must_all_match() -> None:
    index = TokenIndex(100)
    extra = [["s1", ["img", 2], "sql-adapter"], ["sql-adapter"]]
    index.observe(A, stored([11, 12], range(8), lora_name="sql-adapter", extra_keys=extra))
    query = {"lora_name": "sql-adapter", "mm_features": [MMFeature("img", 2, 2)]}
    assert index.walk(A, range(8), 4, cache_salt="s1", **query) == [11, 12]
    assert index.walk(A, range(8), 4, **query) == []
    assert index.walk(A, range(8), 4, cache_salt="s1") == []


def test_bytes_hashes_chain_and_are_reported() -> None:
    index = TokenIndex(100)
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    index.observe(A, stored([h1, h2], range(8)))
    assert index.walk(A, range(8), 4) == [h1, h2]
    assert index.publishes_bytes("a")
    assert not index.publishes_bytes("other")


def test_engines_it_does_not_learn_still_teach_their_hash_form() -> None:
    index = TokenIndex(100, learns=lambda engine: False)
    index.observe(A, stored([b"\x01" * 16], range(4)))
    assert len(index) == 0
    assert index.publishes_bytes("a")


def test_capacity_evicts_the_least_recently_used_entries() -> None:
    index = TokenIndex(4)
    index.observe(A, stored([1, 2], range(8)))  # chain x
    index.observe(A, stored([3, 4], range(100, 108)))  # chain y
    assert index.walk(A, range(8), 4) == [1, 2]  # x is now the most recent
    index.observe(A, stored([5, 6], range(200, 208)))  # evicts y
    assert len(index) == 4
    assert index.walk(A, range(8), 4) == [1, 2]
    assert index.walk(A, range(100, 108), 4) == []
    assert index.walk(A, range(200, 208), 4) == [5, 6]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        TokenIndex(0)


# --- end to end: engines whose hash seed kvindex is never told -----------------

SECRET = SimConfig(
    hash_algo="xxhash", hash_seed=None, gpu_blocks=96, blocks_per_chunk=4, cpu_chunks=128
)
WORKLOAD = WorkloadConfig(seed=7, system_prompts=4, max_context_tokens=1024, active_conversations=6)
REQUESTS = 40


def _requests(dp_rank: int) -> Iterator[Request]:
    """Each simulated rank serves its own stream of the workload."""
    return itertools.islice(Workload(WORKLOAD, stream=dp_rank), REQUESTS)


def _serve(sim: SimEngine) -> Iterator[EventBatch]:
    """Drive a simulated rank through its requests; its batches."""
    for request in _requests(sim.dp_rank):
        sim.submit(request.prompt, request.output)
        while not sim.idle:
            if (batch := sim.step()) is not None:
                yield batch


async def _feed(api: Api, sim: SimEngine, name: str) -> None:
    rank = RankId(name, sim.dp_rank)
    for seq, batch in enumerate(_serve(sim)):
        await api.consumers.apply(rank, seq, batch)


def _probes(sims: list[SimEngine]) -> list[tuple]:
    """Recent (GPU) and older (CPU) prompts, partial prefixes, an unseen prompt."""
    rng = random.Random(3)
    served = [t for sim in sims for t in sim.recently_served]
    older = [r.prompt for sim in sims for r in _requests(sim.dp_rank)]
    unseen = tuple(rng.randrange(32000) for _ in range(300))
    partial = [t[: rng.randrange(1, len(t))] for t in served]
    return [*served, *rng.sample(older, 30), *partial, unseen]


async def _assert_matches_ground_truth(client: httpx.AsyncClient, sims: list[SimEngine]) -> None:
    """Every rank's answer by tokens is what the engine itself holds, on both tiers."""
    gpu_hits = cpu_hits = 0
    for tokens in _probes(sims):
        answer = (await client.post("/prefix-match", json={"tokens": list(tokens)})).json()
        by_rank = {e["dp_rank"]: e for e in answer["engines"]}
        assert set(by_rank) == {sim.dp_rank for sim in sims}
        for sim in sims:
            got = by_rank[sim.dp_rank]
            assert got["gpu_blocks"] == sim.gpu_prefix_blocks(tokens)
            assert got["cpu_blocks"] == sim.cpu_prefix_blocks(tokens)
            gpu_hits += got["gpu_blocks"] > 0
            cpu_hits += got["cpu_blocks"] > got["gpu_blocks"]
    assert gpu_hits and cpu_hits  # the probes exercised both tiers


def _secret_ranks(n: int) -> list[SimEngine]:
    sims = [SimEngine(SECRET, dp_rank=r) for r in range(n)]
    assert len({sim.hash_spec for sim in sims}) == n  # each rank its own secret
    return sims


async def test_tokens_match_engines_whose_hash_seed_is_secret() -> None:
    api = Api()
    sims = _secret_ranks(2)
    await api.add(engine("secret", hash_algo="xxhash", dp_ranks=2, blocks_per_chunk=4))
    for sim in sims:
        await _feed(api, sim, "secret")
    await _assert_matches_ground_truth(api.client, sims)
    await api.close()


async def test_secret_seed_engines_through_the_real_subscriber() -> None:
    """Simulated ranks publish over ZMQ; kvindex learns their hashes from what it receives."""
    sims = _secret_ranks(2)
    async with LiveApi() as live:
        publishers = await live.add_published(
            "secret", dp_ranks=2, hash_algo="xxhash", blocks_per_chunk=4
        )
        last = []
        for sim, publisher in zip(sims, publishers, strict=True):
            batches = list(_serve(sim))
            assert all(publisher.publish(b) for b in batches)
            last.append(len(batches) - 1)
        await live.wait_applied("secret", last)
        await _assert_matches_ground_truth(live.client, sims)


async def test_declaring_the_secret_engine_reproducible_would_miss() -> None:
    """The control: hashing with a guessed seed finds nothing, so the match above is learned."""
    api = Api()
    sim = SimEngine(SECRET)
    await api.add(engine("guessed", hash_algo="xxhash", hash_seed="0", blocks_per_chunk=4))
    await _feed(api, sim, "guessed")
    tokens = sim.recently_served[-1]
    answer = (await api.client.post("/prefix-match", json={"tokens": list(tokens)})).json()
    assert sim.gpu_prefix_blocks(tokens) > 0
    assert answer["engines"][0]["gpu_blocks"] == 0
    await api.close()
