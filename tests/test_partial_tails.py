"""Partial tails (issue 35 item 5): a hybrid Mamba model with blocks of 64 tokens hashed
every 16 (``--prefix-match-unit 16``) and the offloading connector at one block per
chunk, in vLLM's own traces (``mamba-partial-tail``, 0.34.0's and 0.33.0's).

What vLLM publishes is pinned here, then kvindex's answers to vLLM's probes: the rule of
:mod:`indexer.core.large_blocks` alone, and the whole read path by tokens and by hashes.
"""

from __future__ import annotations

from collections import Counter

import pytest

from indexer.core.events import CPU, GPU, AllBlocksCleared, BlockStored, RankId
from indexer.core.large_blocks import LargeBlocks, large_block_match
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.ingest.trace import load_trace
from indexer.kv_groups import KVGroup
from indexer.stores.redis import RedisStore

from .api_cases import check_trace_probes
from .apikit import Api, engine
from .conftest import (
    TAIL_TRACE_NAMES,
    load_expected_json,
    redis_config,
    trace_batches,
    trace_path,
)
from .servers import RedisServer

UNIT, BLOCK = 16, 64  # tokens per hash, per KV cache block (and per CPU chunk)


def stores(name: str, medium: str, group: int) -> list[BlockStored]:
    return [
        e
        for batch in trace_batches(name)
        for e in batch.events
        if type(e) is BlockStored and e.medium == medium and (e.group_idx or 0) == group
    ]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_the_engine_hashes_every_16_tokens_in_blocks_of_64(name: str) -> None:
    engine = load_expected_json(name)["engine"]
    assert engine["block_size"] == UNIT and engine["blocks_per_chunk"] == 1
    assert [g["block_size"] for g in engine["groups"]] == [BLOCK, BLOCK]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_one_group_publishes_blocks_of_64_and_of_16_on_the_gpu(name: str) -> None:
    """A full block: one hash per 64 tokens, the 16-token chain's hash at the block's
    end. A prompt ending inside a block: one hash and the last 16 tokens (a partial
    entry of the block, removed when the block fills)."""
    spec = HashSpec("sha256", None, UNIT)
    full = [e for e in stores(name, GPU, 0) if e.block_size == BLOCK]
    partial = [e for e in stores(name, GPU, 0) if e.block_size == UNIT]
    assert len(full) > 20 and len(partial) > 20
    assert {len(e.block_hashes) for e in partial} == {1}
    assert {len(e.token_ids) for e in partial} == {UNIT}
    for event in full:
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        if event.parent_block_hash is None:
            chain = block_hashes(spec, event.token_ids)
            assert event.block_hashes == chain[BLOCK // UNIT - 1 :: BLOCK // UNIT]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_a_partial_tail_on_the_cpu_lists_the_hashes_up_to_its_boundary(name: str) -> None:
    """Full attention: a tail of n 16-token units is one store of ``block_size`` 16, n
    hashes and 16n tokens (n < 4); a whole chunk one of ``block_size`` 64. Mamba: one
    checkpoint, the boundary's hash (0.34: ``block_size`` 16 or 64; 0.33: 0)."""
    sizes = {(e.block_size, len(e.block_hashes), len(e.token_ids)) for e in stores(name, CPU, 0)}
    assert sizes == {(UNIT, 1, 16), (UNIT, 2, 32), (UNIT, 3, 48), (BLOCK, 1, 64)}
    mamba = {(e.block_size, len(e.block_hashes), len(e.token_ids)) for e in stores(name, CPU, 1)}
    assert mamba == ({(UNIT, 1, 0), (BLOCK, 1, 0)} if name.startswith("0.34") else {(0, 1, 0)})


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_vllm_loads_partial_tails_from_the_cpu(name: str) -> None:
    """Probes whose CPU hit ends inside a block (vLLM's own lookup), and GPU hits that
    do (the partial entries)."""
    probes = load_expected_json(name)["probes"]
    assert sum(p["cpu_prefix_tokens"] % BLOCK != 0 for p in probes) >= 10
    assert sum(p["gpu_tokens"] % BLOCK != 0 for p in probes) >= 10


# --- vLLM's rules, walked on the trace's final residency ---------------------------


def final_residency(name: str) -> dict:
    """Each (medium, group)'s hashes held when the trace ends, counting copies."""
    counts: dict = {}
    for batch in trace_batches(name):
        for event in batch.events:
            assert type(event) is not AllBlocksCleared
            table = counts.setdefault((event.medium, event.group_idx or 0), Counter())
            table.update({h: 1 if type(event) is BlockStored else -1 for h in event.block_hashes})
    return {where: {h for h, n in table.items() if n > 0} for where, table in counts.items()}


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_the_cores_rule_gives_vllms_answers_on_what_the_trace_left(name: str) -> None:
    """Every probe: the GPU hit, the CPU lookup from token 0 and after the GPU hit (the
    load asks for the prompt's whole blocks and one token more), by the rule alone."""
    held, expected = final_residency(name), load_expected_json(name)
    shape = LargeBlocks(BLOCK // UNIT, 1, (0,), (1,), name.startswith("0.34"))
    for probe in expected["probes"]:
        match = large_block_match(probe["hashes"], held, shape)
        got = {
            "gpu_tokens": match.gpu_blocks,
            "cpu_prefix_tokens": match.cpu_blocks,
            "prefix_tokens": match.prefix_blocks,
        }
        assert got == {k: probe[k] // UNIT for k in got}, probe["tokens"]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
async def test_partial_tail_traces_answer_like_vllm_by_tokens_and_by_hashes(name: str) -> None:
    """vLLM's GPU hit and its own CPU lookup, from token 0 and after the GPU hit, with the
    engine declared as the plugin announces it (groups of 64, hash unit 16, release)."""
    await check_trace_probes(name)


async def test_a_partial_tail_trace_answers_like_vllm_over_a_redis_cluster(
    redis_cluster: RedisServer,
) -> None:
    """The same read path over a Redis Cluster: what ranks hold of a chain, read there."""
    store = RedisStore(redis_config(redis_cluster.url, True))
    try:
        await check_trace_probes(TAIL_TRACE_NAMES[0], store)
    finally:
        await store.close()


@pytest.mark.parametrize("seed", [None, "another"])
async def test_blocks_of_64_and_partial_entries_contradict_nothing_declared(seed) -> None:
    """The misdeclared checks take both sizes the groups publish, and still hash the
    64-token blocks' tokens (their last unit's hash): a wrong seed is found."""
    api = Api()
    groups = [KVGroup("full_attention", None, BLOCK), KVGroup("mamba", None, BLOCK)]
    spec = engine("vllm-a", block_size=UNIT, blocks_per_chunk=1, kv_groups=groups, hash_seed=seed)
    try:
        await api.add(spec)
        await api.consumers.apply_trace(
            RankId("vllm-a", 0), load_trace(trace_path(TAIL_TRACE_NAMES[0]))
        )
        found = (await api.client.get("/engines/vllm-a")).json()["misdeclared"]
        assert [reason.split(":")[0] for reason in found] == ([] if seed is None else ["hash"])
    finally:
        await api.close()
