"""Hybrid models: vLLM's hit over KV groups of several attention kinds.

The model's reference walk (:meth:`RankResidency.match`) is held to a
brute-force statement of vLLM 0.33.0's rule on random residency; every store
is held to the reference on random hybrid streams; vLLM's own hybrid traces
are answered over ZMQ, by tokens and by hashes, with either store.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, LOWER_TIERS, STORAGE, AllBlocksCleared, EventBatch, RankId
from indexer.core.large_blocks import LargeBlocks
from indexer.core.matching import PrefixMatch
from indexer.core.residency import RankResidency, plan_batch
from indexer.engine_registry import EngineSpec
from indexer.kv_groups import KVGroup
from indexer.stores import Store, apply_events
from indexer.stores.redis import RedisStore
from producer.publisher import Publisher

from .apikit import Api, LiveApi, csv
from .conftest import (
    HYBRID_TRACE_NAMES,
    free_ports,
    load_expected_json,
    redis_config,
    server_for,
    trace_batches,
)
from .events import removed, stored

CHAIN = list(range(101, 125))  # 24 blocks: 6 chunks of 4, 4 of 6
BLOCK = 4  # tokens per block in these tests


# --- the rule, stated without vLLM's scans -------------------------------------
#
# Every group's manager returns, for a cap, the largest hit at or below it that
# the group can serve: full attention when it holds every block before the
# hit's end, a sliding window when it holds the need blocks before it (all of
# them, for a hit shorter than that), Mamba when it holds the block ending it.
# The fixed point is then the largest hit every group can serve. A lower tier
# extends it by whole chunks, and only by a chunk's worth of blocks or more.


def serves(need: int, held: set[int], start: int, end: int) -> bool:
    """Whether a group holding units ``held`` serves a hit ending at ``end`` (from ``start``)."""
    if end == start:
        return True
    first = start if need == 0 else max(start, end - need)
    return all(i in held for i in range(first, end))


def best(groups: list[tuple[int, set[int]]], start: int, cap: int) -> int:
    return max(e for e in range(start, cap + 1) if all(serves(n, h, start, e) for n, h in groups))


def units(table: set, keys: list) -> set[int]:
    return {i for i, k in enumerate(keys) if k in table}


# (kind, window tokens) of group 1; group 0 is full attention
KINDS = [("sliding_window", 8), ("sliding_window", 13), ("sliding_window", 40), ("mamba", None)]


def need_of(kind: str, window: int | None, chunk: int | None = None) -> int:
    """Blocks (``chunk`` None) or chunks a group needs before a hit's end."""
    if kind == "mamba":
        return 1
    if chunk is None:  # blocks: the window minus the token itself
        return max(1, -(-(window - 1) // BLOCK))
    return -(-window // (chunk * BLOCK))


def brute_force(held: dict, kind: str, window: int | None, chunk: int | None) -> PrefixMatch:
    """vLLM's answers from the statement above; ``held[(medium, group)]``: sets of hashes."""
    rules = [(0, 0), (1, need_of(kind, window))]
    gpu_groups = [(n, units(held[GPU, g], CHAIN)) for g, n in rules]
    full = best(gpu_groups[:1], 0, len(CHAIN))
    gpu = best(gpu_groups, 0, full)
    if not chunk:
        return PrefixMatch(gpu, prefix_blocks=gpu, full_attention_blocks=_differs(full, gpu))
    ends = CHAIN[chunk - 1 :: chunk]

    def lower(media, start: int) -> int:
        groups = [
            (0 if g == 0 else need_of(kind, window, chunk), units(set().union(*sets), ends))
            for g in (0, 1)
            for sets in [[held[m, g] for m in media]]
        ]
        return best(groups, start, len(ends))

    end = lower(LOWER_TIERS, gpu // chunk)
    if end * chunk - gpu < chunk:  # vLLM loads a chunk's worth of blocks or nothing
        end = 0
    prefix = max(gpu, end * chunk)
    from_cpu = sum(
        (j + 1) * chunk - max(gpu, j * chunk)
        for j in range(gpu // chunk, end)
        if ends[j] in held[CPU, 0]
    )
    return PrefixMatch(
        gpu,
        lower((CPU,), 0) * chunk,
        lower((STORAGE,), 0) * chunk,
        prefix,
        from_cpu,
        prefix - gpu - from_cpu,
        _differs(full, gpu),
    )


def _differs(full: int, gpu: int) -> int | None:
    return full if full != gpu else None


#: a set of the chain's hashes, each in or out (dense and sparse runs alike)
_subsets = st.lists(st.booleans(), min_size=len(CHAIN), max_size=len(CHAIN)).map(
    lambda flags: {h for h, held in zip(CHAIN, flags, strict=True) if held}
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries({(m, g): _subsets for m in (GPU, CPU, STORAGE) for g in (0, 1)}),
    st.sampled_from(KINDS),
    st.sampled_from([None, 1, 4, 6]),
    st.booleans(),
)
def test_the_reference_walk_is_vllms_rule(held, spec, chunk, long_prefix) -> None:
    kind, window = spec
    if long_prefix:  # most real residency: full attention holds a long leading run
        held[GPU, 0] = held[GPU, 0] | set(CHAIN[:18])
    state = RankResidency()
    events = [
        stored(sorted(hs), m, 0, "full_attention", block_size=BLOCK)
        for (m, g), hs in held.items()
        if g == 0 and hs
    ]
    events += [
        stored(sorted(hs), m, 1, kind, block_size=BLOCK, window=window)
        for (m, g), hs in held.items()
        if g == 1 and hs
    ]
    # both groups known, whatever they hold: hashes outside the chain
    events.append(stored([998], GPU, 0, "full_attention", block_size=BLOCK))
    events.append(stored([999], GPU, 1, kind, block_size=BLOCK, window=window))
    state.apply(plan_batch(EventBatch(1.0, events)))
    assert state.match(CHAIN, chunk) == brute_force(held, kind, window, chunk)


def test_lower_tiers_need_the_whole_window_in_chunks() -> None:
    """A window of 13 tokens needs cdiv(12, 4) = 3 blocks on GPU but cdiv(13, 4) = 4
    chunks of one block on CPU: vLLM's connector counts the token itself."""
    state = RankResidency()
    events = [stored(CHAIN[:10], block_size=BLOCK), stored(CHAIN, CPU, block_size=BLOCK)]
    window = {"kind": "sliding_window", "block_size": BLOCK, "window": 13}
    events += [stored(CHAIN[7:10], group=1, **window), stored(CHAIN[21:], CPU, 1, **window)]
    state.apply(plan_batch(EventBatch(1.0, events)))
    assert state.match(CHAIN, 1) == PrefixMatch(10, 0, 0, 10, 0, 0, None)
    state.apply(plan_batch(EventBatch(2.0, [stored([CHAIN[20]], CPU, 1, **window)])))
    assert state.match(CHAIN, 1) == PrefixMatch(10, 24, 0, 24, 14, 0, None)


def test_several_groups_of_one_kind_each_need_the_window() -> None:
    """vLLM looks groups of one spec up together: a block counts where all hold it."""
    state = RankResidency()
    events = [stored(CHAIN, kind="full_attention", block_size=BLOCK)]
    events += [stored(CHAIN[:8], group=1, kind="sliding_window", block_size=BLOCK, window=8)]
    events += [stored(CHAIN[4:12], group=2, kind="sliding_window", block_size=BLOCK, window=8)]
    state.apply(plan_batch(EventBatch(1.0, events)))
    # group 1 alone: 8; group 2 alone: 12; together only blocks 4..7 serve both windows
    assert state.match(CHAIN, None) == PrefixMatch(8, prefix_blocks=8, full_attention_blocks=24)
    state.apply(plan_batch(EventBatch(2.0, [removed([CHAIN[7]], group=2)])))
    assert state.match(CHAIN, None).gpu_blocks == 7  # blocks 5, 6 end a window of both


# --- every store equals the reference on random hybrid streams -----------------


def hybrid_stream(rng: random.Random, batches: int, kind: str, window: int | None) -> list:
    """Batches of a two-group engine: group 0 full attention, group 1 ``kind``.

    Prefix-shaped stores (a leading run, then the group-1 tail), scattered
    removals of either group (without a kind, as vLLM sends them), clears.
    """
    out = []
    for i in range(batches):
        events: list = []
        for _ in range(rng.randint(0, 4)):
            medium = rng.choice([GPU, GPU, CPU, STORAGE])
            end = rng.randint(1, len(CHAIN))
            if rng.random() < 0.05:
                events.append(AllBlocksCleared())
            elif rng.random() < 0.6:
                events.append(stored(CHAIN[:end], medium, block_size=BLOCK))
                tail = CHAIN[max(0, end - rng.randint(1, 10)) : end]
                events.append(stored(tail, medium, 1, kind, block_size=BLOCK, window=window))
            else:
                hashes = rng.sample(CHAIN, rng.randint(1, 4))
                events.append(removed(hashes, medium, rng.choice([0, 1, 1])))
        out.append(EventBatch(float(i), events, 0))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
async def test_every_store_answers_like_the_reference_on_random_hybrid_streams(
    store: Store, seed: int
) -> None:
    rng = random.Random(seed)
    kind, window = KINDS[seed % len(KINDS)]
    ranks = [RankId("engine-a", 0), RankId("engine-a", 1)]
    reference = {rank: RankResidency() for rank in ranks}
    chains = [CHAIN, CHAIN[:13], CHAIN[3:]]
    for rank in ranks:
        for seq, batch in enumerate(hybrid_stream(rng, 30, kind, window)):
            await apply_events(store, rank, seq, batch)
            reference[rank].apply(plan_batch(batch))
    for declared in (None, 1, 4, 6):
        for chain in chains:
            found = await store.prefix_match(chain, {"engine-a": declared})
            want = {
                rank: state.match(chain, declared or state.chunk_blocks)
                for rank, state in reference.items()
            }
            assert found == want, (declared, chain)


async def test_a_window_past_the_bound_limits_no_hit_and_every_store_still_answers(
    store: Store,
) -> None:
    """A sliding window of 2**63 tokens (a number from the wire) made the memory store's
    every prefix match fail; past MAX_RULE_WINDOW the group is tracked, not matched."""
    rank, chain = RankId("engine-a", 0), CHAIN[:4]
    windowed = stored(chain[:2], group=1, kind="sliding_window", block_size=BLOCK, window=2**63)
    batch = EventBatch(1.0, [stored(chain, block_size=BLOCK), windowed], 0)
    await apply_events(store, rank, 0, batch)
    reference = RankResidency()
    reference.apply(plan_batch(batch))
    found = await store.prefix_match(chain, {"engine-a": None})
    assert found == {rank: reference.match(chain, None)} and found[rank].gpu_blocks == 4


# --- vLLM's traces, over ZMQ, joined late --------------------------------------


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("name", HYBRID_TRACE_NAMES)
async def test_hybrid_traces_joined_late_answer_like_vllm(
    request: pytest.FixtureRequest, name: str, kind: str
) -> None:
    """Half the trace is published before kvindex follows the engine: replay brings it."""
    expected = load_expected_json(name)
    cfg = expected["engine"]
    batches = trace_batches(name)
    base = free_ports(2)
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    publisher = Publisher(endpoint, replay, bind=True)
    store = None if kind == "memory" else RedisStore(redis_config(server_for(request, kind).url))
    try:
        for batch in batches[: len(batches) // 2]:
            assert publisher.publish(batch)
        assert await asyncio.to_thread(publisher.flush)
        async with LiveApi(store=store) as live:
            await live.registry.add(live_spec(endpoint, replay, cfg))
            for batch in batches[len(batches) // 2 :]:
                assert publisher.publish(batch)
            await live.wait_applied("vllm-a", [len(batches) - 1])
            assert live.subscriber.rank_status("vllm-a")[0].replays >= 1
            for probe in expected["probes"]:
                full_attention = probe["gpu_tokens_by_group"][0]
                for params in (
                    {"tokens": csv(probe["tokens"])},
                    {"block_hashes": csv(probe["hashes"])},
                ):
                    answer = (await live.client.get("/prefix-match", params=params)).json()
                    (entry,) = answer["engines"]
                    got = entry["gpu_blocks"] * 16, entry["gpu_blocks_full_attention"] * 16
                    assert got == (probe["gpu_tokens"], full_attention), (params.keys(), probe)
    finally:
        publisher.close()
        if store is not None:
            await store.close()


def live_spec(endpoint: str, replay: str, cfg: dict) -> EngineSpec:
    return EngineSpec(
        name="vllm-a",
        endpoint=endpoint,
        replay_endpoint=replay,
        block_size=cfg["block_size"],
        blocks_per_chunk=cfg["blocks_per_chunk"],
        reuse_reports="counted",  # vLLM's traces: every GPU store a copy, no reports
    )


# --- declared groups ----------------------------------------------------------

SLIDING = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 64}]


def test_groups_of_another_block_size_are_refused_naming_the_limit() -> None:
    body = {"name": "a", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16}
    groups = [{"kind": "full_attention"}, {"kind": "mamba", "block_size": 32}]
    with pytest.raises(msgspec.ValidationError, match="one block size only"):
        msgspec.convert(body | {"kv_groups": groups}, EngineSpec)
    with pytest.raises(msgspec.ValidationError, match="needs its sliding_window"):
        msgspec.convert(body | {"kv_groups": [{"kind": "sliding_window"}]}, EngineSpec)
    spec = msgspec.convert(body | {"kv_groups": SLIDING}, EngineSpec)
    assert spec.kv_groups[1] == KVGroup("sliding_window", 64)
    assert spec.large_blocks is None


def test_blocks_a_multiple_of_the_hash_unit_are_taken_for_full_attention_and_mamba() -> None:
    """A hybrid Mamba model's blocks of 64 hashed every 16: matched by the rules of
    blocks larger than the hash block, anchored as the announced release does."""
    body = {"name": "a", "endpoint": "tcp://127.0.0.1:5557", "block_size": 16}
    groups = [{"kind": "full_attention", "block_size": 64}, {"kind": "mamba", "block_size": 64}]
    spec = msgspec.convert(body | {"kv_groups": groups, "blocks_per_chunk": 1}, EngineSpec)
    assert spec.large_blocks == LargeBlocks(4, 1, (0,), (1,), anchor_at_full_attention=True)
    older = msgspec.convert(body | {"kv_groups": groups, "release": "0.33.0"}, EngineSpec)
    assert older.large_blocks == LargeBlocks(4, None, (0,), (1,), anchor_at_full_attention=False)
    for refused in (
        [{"kind": "mamba", "block_size": 24}],
        [{"kind": "sliding_window", "sliding_window": 64, "block_size": 32}],
    ):
        with pytest.raises(msgspec.ValidationError, match="only as a multiple of it"):
            msgspec.convert(body | {"kv_groups": refused}, EngineSpec)
    with pytest.raises(msgspec.ValidationError, match="release"):
        msgspec.convert(body | {"release": "latest"}, EngineSpec)


async def test_registering_groups_kvindex_cannot_match_is_a_422() -> None:
    api = Api()
    body = {"name": "a", "endpoint": "tcp://10.0.0.1:5557", "block_size": 16}
    body["kv_groups"] = [{"kind": "full_attention"}, {"kind": "mamba", "block_size": 32}]
    refused = await api.client.post("/engines", json=body)
    assert refused.status_code == 422
    assert "one block size only" in refused.json()["error"]
    assert (await api.client.get("/engines")).json() == []
    await api.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("declared", [None, SLIDING])
async def test_a_group_seen_only_by_its_removals_is_matched_by_its_declaration(
    request: pytest.FixtureRequest, declared, kind: str
) -> None:
    """Joined late: the sliding-window group's stores were missed, its removals are not."""
    chain = list(range(1, 9))
    groups = None if declared is None else [msgspec.convert(g, KVGroup) for g in declared]
    store = None if kind == "memory" else RedisStore(redis_config(server_for(request, kind).url))
    async with LiveApi(store=store) as live:
        (publisher,) = await live.add_published("vllm-a", kv_groups=groups)
        assert publisher.publish(EventBatch(1.0, [stored(chain), removed([chain[0]], group=1)]))
        await live.wait_applied("vllm-a", [0])
        answer = await live.client.get("/prefix-match", params={"block_hashes": csv(chain)})
        (entry,) = answer.json()["engines"]
        # declared: the window group holds none of the blocks a hit would end with
        assert entry["gpu_blocks"] == (8 if declared is None else 0)
        assert entry["gpu_blocks_full_attention"] == 8
    if store is not None:
        await store.close()


async def test_events_contradicting_the_declaration_are_counted_and_logged(caplog) -> None:
    chain = list(range(1, 9))
    groups = [msgspec.convert(g, KVGroup) for g in SLIDING]
    async with LiveApi() as live:
        (publisher,) = await live.add_published("vllm-a", kv_groups=groups)
        events = [stored(chain), stored(chain, group=1, kind="mamba"), stored(chain, group=2)]
        for seq in range(2):  # the same contradiction again is not counted again
            assert publisher.publish(EventBatch(float(seq), events))
        await live.wait_applied("vllm-a", [1])
        (rank,) = (await live.client.get("/engines/vllm-a")).json()["ranks"]
        assert rank["kv_group_mismatches"] == 2  # group 1 is no Mamba group, group 2 undeclared
        metrics = (await live.client.get("/metrics")).text
        assert (
            'kvindex_ingest_kv_group_mismatches_total{dp_rank="0",engine="vllm-a"} 2.0' in metrics
        )
    logged = [
        r for r in caplog.records if r.getMessage() == "kv group differs from its declaration"
    ]
    assert {(r.group_idx, r.seen, r.declared) for r in logged} == {
        (1, "mamba", "sliding_window:64:16"),
        (2, "full_attention", None),
    }
