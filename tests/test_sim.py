"""The simulated engine and workload: vLLM's cache mechanics, seen through their events."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from indexer.core.events import BlockRemoved, BlockStored, EventBatch, RankId
from indexer.core.matching import PrefixMatch
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.vllm.wire import encode_batch
from indexer.stores import MemoryStore, apply_events
from producer.sim import SimConfig, SimEngine
from producer.workload import Workload, WorkloadConfig

BLOCK = 4
RANK = RankId("sim", 0)


def small(**kw) -> SimConfig:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("gpu_blocks", 8)
    kw.setdefault("blocks_per_chunk", 2)
    kw.setdefault("cpu_chunks", 0)
    return SimConfig(**kw)


def prompt(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BLOCK))


def drain(engine: SimEngine) -> list[EventBatch]:
    """Step until every submitted request has finished; the batches published."""
    batches = []
    for _ in range(10_000):
        if engine.idle:
            return batches
        batch = engine.step()
        if batch is not None:
            batches.append(batch)
    raise AssertionError("engine never went idle")


def events(batches: list[EventBatch], kind: type, medium: str = "GPU") -> list:
    return [e for b in batches for e in b.events if type(e) is kind and e.medium == medium]


def removed_hashes(batches: list[EventBatch], medium: str = "GPU") -> list[int]:
    return [h for e in events(batches, BlockRemoved, medium) for h in e.block_hashes]


async def replay(batches: list[EventBatch], adapter: str = "vllm") -> MemoryStore:
    """What kvindex learns from the engine's batches, through the real wire encoding of
    the engine type simulated."""
    wire, store = catalog.adapter(adapter), MemoryStore()
    for seq, batch in enumerate(batches):
        await apply_events(store, RANK, seq, wire.decode(wire.encode(batch)))
    return store


# --- GPU prefix cache --------------------------------------------------------


def test_gpu_store_event_matches_vllm_shape():
    engine = SimEngine(small(), clock=lambda: 12.5)
    tokens = [*prompt(1, 2), 99]
    engine.submit(tokens, output=[7, 8, 9])

    first = engine.step()
    chain = engine.chain([*tokens, 7, 8, 9])
    assert first is not None and first.ts == 12.5 and first.data_parallel_rank == 0
    assert first.events == [
        BlockStored(
            block_hashes=chain[:2],
            parent_block_hash=None,
            token_ids=tokens[:8],
            block_size=BLOCK,
            medium="GPU",
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    # Decoding fills the third block: published alone, chained to the second.
    [decoded] = drain(engine)[0].events
    assert (decoded.block_hashes, decoded.parent_block_hash) == (chain[2:], chain[1])
    assert decoded.token_ids == [*tokens[8:], 7, 8, 9]


def test_eviction_takes_least_recently_freed_blocks_and_publishes_removals():
    engine = SimEngine(small())
    old, recent = prompt(1, 3), prompt(100, 3)
    for tokens in (old, recent):
        engine.submit(tokens)
        drain(engine)
    free_uncached = 8 - 6
    engine.submit(prompt(200, free_uncached + 2))

    batches = drain(engine)

    # The never-cached blocks go first, then ``old``'s, last block first.
    old_chain = engine.chain(old)
    assert removed_hashes(batches) == [old_chain[2], old_chain[1]]
    assert engine.gpu_prefix_blocks(old) == 1
    assert engine.gpu_prefix_blocks(recent) == 3


def test_a_cache_hit_refreshes_the_prefix_in_the_lru():
    engine = SimEngine(small())
    old, recent = prompt(1, 3), prompt(100, 3)
    for tokens in (old, recent, [*old, 0]):  # the last one hits ``old``
        engine.submit(tokens)
        drain(engine)
    engine.submit(prompt(200, 4))

    removed = removed_hashes(drain(engine))

    assert removed == engine.chain(recent)[::-1]
    assert engine.gpu_prefix_blocks(old) == 3


def test_the_last_prompt_token_is_always_computed():
    engine = SimEngine(small())
    tokens = prompt(1, 3)
    engine.submit(tokens)
    drain(engine)
    engine.submit(tokens)

    [again] = events(drain(engine), BlockStored)

    # As in vLLM: a fully cached prompt hits all but its last block, which is recomputed.
    assert engine.hit_blocks == {"GPU": 2}
    assert engine.prompt_blocks == 6
    assert (again.block_hashes, again.parent_block_hash) == (
        engine.chain(tokens)[2:],
        engine.chain(tokens)[1],
    )


def test_running_requests_hold_their_blocks():
    engine = SimEngine(small(max_running=4, decode_tokens_per_step=BLOCK))
    engine.submit(prompt(1, 4), output=prompt(500, 2))  # 6 blocks, runs 3 steps
    engine.submit(prompt(100, 4))  # needs 4 of the 2 left: must wait

    assert [type(e) for e in engine.step().events] == [BlockStored]
    engine.step()
    assert engine.gpu_prefix_blocks(prompt(100, 4)) == 0
    batches = drain(engine)

    # Admitted once the first finished: its last blocks were the first to go.
    first = engine.chain(prompt(1, 4) + prompt(500, 2))
    assert removed_hashes(batches) == [first[5], first[4]]
    assert engine.gpu_prefix_blocks(prompt(100, 4)) == 4


def test_concurrent_requests_publish_two_copies_of_a_block():
    engine = SimEngine(small(gpu_blocks=6, max_running=2))
    shared = prompt(1, 2)
    engine.submit([*shared, 50])
    engine.submit([*shared, 60])

    [batch] = drain(engine)

    stored = Counter(h for e in events([batch], BlockStored) for h in e.block_hashes)
    assert set(stored.values()) == {2}


async def test_duplicate_copies_keep_a_block_resident_until_both_are_evicted():
    engine = SimEngine(small(gpu_blocks=6, max_running=2))
    shared = prompt(1, 2)
    engine.submit([*shared, 50])
    engine.submit([*shared, 60])
    batches = drain(engine)
    engine.submit(prompt(100, 3))  # evicts one copy of each shared block
    batches += drain(engine)
    store = await replay(batches)

    chain = engine.chain(shared)
    match = (await store.prefix_match(chain, {"sim": None}))[RANK]
    assert engine.gpu_prefix_blocks(shared) == match.gpu_blocks == 2
    assert removed_hashes(batches) == engine.chain(shared)[::-1]


def test_a_request_larger_than_the_gpu_is_refused():
    engine = SimEngine(small())
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit(prompt(1, 9))
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit([])


# --- offload tiers -----------------------------------------------------------


def test_offloaded_chunks_are_aligned_to_the_prompt_start():
    engine = SimEngine(small(gpu_blocks=16, cpu_chunks=8, blocks_per_chunk=2))
    tokens = [*prompt(1, 5), 1, 2]  # 5 full blocks: chunks 0 and 1, block 4 left over
    engine.submit(tokens)

    cpu = events(drain(engine), BlockStored, "CPU")

    chain = engine.chain(tokens)
    assert [(e.block_hashes, e.parent_block_hash) for e in cpu] == [
        (chain[0:2], None),
        (chain[2:4], chain[1]),
    ]
    assert [e.token_ids for e in cpu] == [tokens[0:8], tokens[8:16]]
    assert {(e.block_size, e.locality, e.ownership) for e in cpu} == {(BLOCK, "LOCAL", None)}
    assert engine.cpu_prefix_blocks(tokens) == 4


def test_placeholders_carry_only_the_chunk_end():
    engine = SimEngine(small(gpu_blocks=16, cpu_chunks=8, self_describing=False))
    tokens = prompt(1, 4)
    engine.submit(tokens)

    cpu = events(drain(engine), BlockStored, "CPU")

    chain = engine.chain(tokens)
    assert [(e.block_hashes, e.block_size, e.token_ids) for e in cpu] == [
        ([chain[1]], 0, []),
        ([chain[3]], 0, []),
    ]


def test_a_cpu_load_is_a_hit_refreshes_the_chunk_and_caches_it_on_gpu():
    engine = SimEngine(small(gpu_blocks=8, cpu_chunks=5, blocks_per_chunk=2))
    a, b = prompt(1, 2), prompt(100, 2)
    for tokens in (a, b, prompt(200, 6)):  # the third pushes a off the GPU
        engine.submit(tokens)
        drain(engine)
    assert (engine.gpu_prefix_blocks(a), engine.cpu_prefix_blocks(a)) == (0, 2)

    engine.submit([*a, 0])
    loaded = drain(engine)
    assert engine.hit_blocks == {"GPU": 0, "CPU": 2}
    assert events(loaded, BlockStored, "CPU") == []  # already there: touched, not stored
    assert engine.gpu_prefix_blocks(a) == 2
    engine.submit(prompt(300, 2))
    batches = drain(engine)

    # The load made b's chunk the least recently used one.
    assert removed_hashes(batches, "CPU") == engine.chain(b)
    assert engine.cpu_prefix_blocks(a) == 2


def test_lower_tiers_serve_nothing_that_adds_less_than_a_chunk_after_the_gpu_hit():
    engine = SimEngine(small(gpu_blocks=8, cpu_chunks=5, blocks_per_chunk=2))
    a = prompt(1, 2)
    for tokens in (a, prompt(100, 2), prompt(200, 5)):  # the third evicts a's last block
        engine.submit(tokens)
        drain(engine)
    assert (engine.gpu_prefix_blocks(a), engine.cpu_prefix_blocks(a)) == (1, 2)

    engine.submit([*a, 0])
    drain(engine)
    assert engine.hit_blocks == {"GPU": 1}  # one block more from the CPU: not loaded


def test_storage_tier_is_owned_write_through_and_outlives_cpu():
    config = small(gpu_blocks=8, cpu_chunks=1, storage_chunks=8, blocks_per_chunk=2)
    engine = SimEngine(config)
    a, b = prompt(1, 2), prompt(100, 2)
    for tokens in (a, b):
        engine.submit(tokens)
    batches = drain(engine)

    storage = events(batches, BlockStored, "STORAGE")
    assert {(e.ownership, e.locality) for e in storage} == {("kvcr", "REMOTE")}
    assert (engine.cpu_prefix_blocks(a), engine.storage_prefix_blocks(a)) == (0, 2)
    assert (engine.cpu_prefix_blocks(b), engine.storage_prefix_blocks(b)) == (2, 2)
    assert removed_hashes(batches, "CPU") == engine.chain(a)

    engine.submit(prompt(200, 6))  # pushes a and b off the GPU
    drain(engine)
    engine.submit([*a, 0])
    drain(engine)
    assert engine.hit_blocks == {"GPU": 0, "STORAGE": 2}
    assert engine.cpu_prefix_blocks(a) == 2  # brought back to CPU by the load


def test_storage_needs_a_cpu_tier():
    with pytest.raises(ValueError, match="CPU tier"):
        small(cpu_chunks=0, storage_chunks=4)


# --- ground truth against the index ------------------------------------------

PRESSURE = {
    "self-describing": SimConfig(gpu_blocks=160, cpu_chunks=48, blocks_per_chunk=4),
    "placeholders": SimConfig(gpu_blocks=160, cpu_chunks=48, self_describing=False),
    "gpu-only": SimConfig(gpu_blocks=160, cpu_chunks=0),
    "storage": SimConfig(gpu_blocks=160, cpu_chunks=48, storage_chunks=96),
    "storage-0.34": SimConfig(
        gpu_blocks=160, cpu_chunks=48, storage_chunks=96, offload_events="0.34"
    ),
    "placeholders-0.34": SimConfig(
        gpu_blocks=160, cpu_chunks=48, self_describing=False, offload_events="0.34"
    ),
    "sglang": SimConfig(gpu_blocks=160, cpu_chunks=0, adapter="sglang"),
}
WORKLOAD = WorkloadConfig(seed=3, system_prompt_tokens=(64, 320), max_context_tokens=1024)


def serve(engine: SimEngine, n: int, workload: WorkloadConfig = WORKLOAD) -> list[EventBatch]:
    """Submit ``n`` requests, one step apart, then let them finish."""
    batches = []
    for request in itertools.islice(Workload(workload), n):
        engine.submit(request.prompt, request.output)
        if (batch := engine.step()) is not None:
            batches.append(batch)
    return batches + drain(engine)


@pytest.mark.parametrize("name", PRESSURE)
async def test_ground_truth_equals_what_the_index_learns_from_the_events(name):
    config = PRESSURE[name]
    engine = SimEngine(config)
    batches = serve(engine, 150)
    store = await replay(batches, config.adapter)

    probes = [*Workload(WORKLOAD).system_prompts, *engine.recently_served]
    probes += [r.prompt for r in itertools.islice(Workload(WORKLOAD), 150)][::10]
    truths, answers = [], []
    for tokens in probes:
        chain = engine.chain(tokens)
        found = await store.prefix_match(chain, {"sim": config.blocks_per_chunk})
        match = found.get(RANK, PrefixMatch())  # a rank matching nothing is left out
        answers.append((match.gpu_blocks, match.cpu_blocks, match.storage_blocks))
        truths.append(
            (
                engine.gpu_prefix_blocks(tokens),
                engine.cpu_prefix_blocks(tokens),
                engine.storage_prefix_blocks(tokens),
            )
        )

    assert answers == truths
    assert (await store.anomalies(RANK)) == {"unknown_removals": 0}
    # The comparison covered eviction and hits on every tier the engine has.
    assert removed_hashes(batches, "GPU")
    assert any(t[0] for t in truths) and any(t[0] == 0 for t in truths)
    if config.cpu_chunks:
        assert removed_hashes(batches, "CPU")
        assert any(t[1] > t[0] for t in truths)  # CPU holds what the GPU evicted
    if config.storage_chunks:
        assert any(t[2] > t[1] for t in truths)


async def test_resident_counts_equal_the_index_block_counts():
    engine = SimEngine(PRESSURE["placeholders"])  # one CPU hash per chunk
    store = await replay(serve(engine, 60))

    assert await store.block_counts(RANK) == engine.resident()


# --- determinism and hashing -------------------------------------------------


def test_same_seed_same_batches():
    def run() -> list[bytes]:
        engine = SimEngine(PRESSURE["self-describing"], clock=lambda: 1.0)
        return [encode_batch(b) for b in serve(engine, 40)]

    assert run() == run()


def test_a_simulated_sglang_engine_speaks_sglang():
    """Its pages hash as SGLang's (unseeded SHA-256 chains), and it has no lower tiers."""
    config = small(adapter="sglang")
    tokens, hasher = prompt(1, 2), catalog.adapter("sglang").hasher("sha256", None, BLOCK)
    chain = SimEngine(config).chain(tokens)
    assert chain == hasher.published(hasher.digests(Prompt(tuple(tokens))))
    assert chain != SimEngine(small()).chain(tokens)  # vLLM's
    for refused in ({"cpu_chunks": 4}, {"hash_seed": "1"}, {"adapter": "trtllm"}):
        with pytest.raises(ValueError):
            small(**{"adapter": "sglang", **refused})


def test_secret_xxhash_seed_differs_per_engine_but_tokens_agree():
    config = small(hash_algo="xxhash")
    engines = [SimEngine(config), SimEngine(config)]
    stored = []
    for engine in engines:
        engine.submit(prompt(1, 2))
        stored.append(events(drain(engine), BlockStored)[0])

    assert stored[0].block_hashes != stored[1].block_hashes
    assert stored[0].token_ids == stored[1].token_ids
    seeded = small(hash_algo="xxhash", hash_seed="42")
    assert SimEngine(seeded).hash_spec == catalog.adapter("vllm").hasher("xxhash", "42", BLOCK)
