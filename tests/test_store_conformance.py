"""One suite, every store: memory, a standalone redis-server, a 3-master Redis Cluster.

A store is done when these pass unchanged: vLLM's fixture traces end in vLLM's
own state and answers, and every residency rule of :mod:`indexer.core` holds. The Redis stores
are also checked against the memory store on random streams of events.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from indexer.core.events import CPU, GPU, STORAGE, AllBlocksCleared, EventBatch, RankId
from indexer.core.matching import PrefixMatch
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.trace import answer_probes, apply_trace, load_expected, load_trace
from indexer.stores import MemoryStore, Store, StoreUnavailable, Watermark
from indexer.stores.redis import RedisConfig, RedisStore

from .conftest import (
    FIXTURES,
    HYBRID_TRACE_NAMES,
    TRACE_NAMES,
    expected_path,
    load_expected_json,
    probe_answers,
    redis_config,
    server_for,
    trace_path,
)
from .events import removed, stored
from .servers import LocalCluster, RedisServer, free_port

RANK = RankId("engine-a", 0)


def batch(*events, ts: float = 1.0) -> EventBatch:
    return EventBatch(ts, list(events), 0)


async def apply(store: Store, seq: int, *events, rank: RankId = RANK, ts: float = 1.0) -> bool:
    return (await store.apply_batch(rank, seq, batch(*events, ts=ts))).applied


async def where(store: Store, h) -> set[tuple]:
    """A block's residencies as comparable tuples."""
    return {
        (r.engine, r.dp_rank, r.medium, r.ownership, r.group_idx, r.locality, r.count)
        for r in await store.block_residency(h)
    }


async def counts(store: Store, h, rank: RankId = RANK) -> dict[str, int]:
    """Reference count of one hash per medium for one rank (all groups and owners)."""
    found: dict[str, int] = {}
    for r in await store.block_residency(h):
        if (r.engine, r.dp_rank) == rank:
            found[r.medium] = found.get(r.medium, 0) + r.count
    return found


# --- vLLM's fixture traces ------------------------------------------------------


async def check_trace_state(store: Store, name: str) -> None:
    expected = load_expected_json(name)
    gpu, cpu = expected["expected"]["gpu_refcounts"], expected["expected"]["cpu_refcounts"]
    assert await store.block_counts(RANK) == {GPU: len(gpu), CPU: len(cpu), STORAGE: 0}
    for h in {*gpu, *cpu}:
        want = {m: table[h] for m, table in ((GPU, gpu), (CPU, cpu)) if h in table}
        assert await counts(store, int(h)) == want, h
    probes = load_expected(expected_path(name))
    answers = await answer_probes(store, RANK, probes.engine, probes.probes)
    assert answers == probe_answers(expected)
    assert await store.anomalies(RANK) == {"unknown_removals": 0}
    for group, table in expected["expected"].get("gpu_refcounts_by_group", {}).items():
        for h, n in table.items():
            rows = await store.block_residency(int(h))
            assert [r.count for r in rows if r.group_idx == int(group)] == [n], (group, h)


@pytest.mark.parametrize("name", TRACE_NAMES + HYBRID_TRACE_NAMES)
async def test_trace_ends_in_vllms_state_and_answers(store: Store, name: str) -> None:
    trace = load_trace(trace_path(name))
    stats = await apply_trace(store, RANK, trace)
    assert stats.batches == len(trace) and stats.block_ops > 0
    await check_trace_state(store, name)
    assert await store.watermark(RANK) == Watermark(trace[-1][0], decode_batch(trace[-1][1]).ts)


async def test_replaying_a_trace_twice_changes_nothing(store: Store) -> None:
    trace = load_trace(trace_path("chat-clear"))
    await apply_trace(store, RANK, trace)
    again = [await store.apply_batch(RANK, seq, decode_batch(p)) for seq, p in trace]
    assert not any(result.applied for result in again)
    await check_trace_state(store, "chat-clear")


@pytest.mark.parametrize("name", ["chat-sha256", "hybrid-mamba"])
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_replay_command_reports_with_redis_what_it_does_in_memory(
    request: pytest.FixtureRequest, kind: str, name: str
) -> None:
    server = server_for(request, kind)

    def replay(*flags: str) -> dict:
        command = [sys.executable, "-m", "kvindex.cli", "replay", str(trace_path(name))]
        command += ["--probe", str(expected_path(name)), *flags]
        return json.loads(subprocess.run(command, capture_output=True, check=True).stdout)

    flags = ["--redis-url", server.url, "--redis-prefix", redis_config(server.url).prefix]
    flags += ["--redis-cluster"] if kind == "cluster" else []
    in_memory = replay()
    assert in_memory["probes"] and in_memory["blocks"]["GPU"] > 0
    assert replay(*flags) == in_memory
    assert replay(*flags) == in_memory  # a second replay into the same prefix starts afresh


# --- watermark, clear, forget -----------------------------------------------------


async def test_watermark_admits_each_seq_once_and_allows_holes(store: Store) -> None:
    assert await store.watermark(RANK) is None
    assert await apply(store, 5, stored([1]), ts=10.0)
    assert await store.watermark(RANK) == Watermark(5, 10.0)
    assert not await apply(store, 5, stored([1]), ts=11.0)
    assert not await apply(store, 3, stored([1]))
    assert await counts(store, 1) == {GPU: 1}
    assert await apply(store, 9, removed([1]), ts=12.0)  # a permanent hole: 6..8
    assert await store.watermark(RANK) == Watermark(9, 12.0)
    assert await counts(store, 1) == {}


async def test_empty_batch_advances_the_watermark(store: Store) -> None:
    assert await apply(store, 0)
    assert await store.watermark(RANK) == Watermark(0, 1.0)
    assert await store.ranks() == [RANK]


async def test_clear_drops_only_the_given_media(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([2], "CPU"), stored([3], "STORAGE"))
    await store.clear(RANK, [GPU, CPU])
    assert await store.block_counts(RANK) == {GPU: 0, CPU: 0, STORAGE: 1}
    assert await store.watermark(RANK) == Watermark(0, 1.0)
    assert not await apply(store, 0, stored([1]))
    assert await apply(store, 1, stored([2]))
    assert await counts(store, 2) == {GPU: 1}  # a fresh count, nothing resurrected


async def test_reset_seq_takes_a_restarted_engines_stream_from_zero(store: Store) -> None:
    for seq in range(3):
        await apply(store, seq, stored([10 + seq]), stored([20 + seq], "STORAGE"))
    await store.clear(RANK, [GPU, CPU], reset_seq=True)
    assert await store.watermark(RANK) is None
    assert await apply(store, 0, stored([10]), stored([20], "STORAGE"), ts=5.0)
    assert await store.watermark(RANK) == Watermark(0, 5.0)
    assert await counts(store, 10) == {GPU: 1}
    assert await counts(store, 20) == {STORAGE: 2}  # kept through the restart, then +1
    assert await store.block_counts(RANK) == {GPU: 1, CPU: 0, STORAGE: 3}


async def test_forget_drops_everything_about_the_rank(store: Store) -> None:
    other = RankId("engine-b", 0)
    await apply(store, 4, stored([1, 2]), stored([2], "CPU"), removed([9]))
    await apply(store, 0, stored([1]), rank=other)
    await store.forget(RANK)
    assert await store.ranks() == [other]
    assert await store.watermark(RANK) is None
    assert await where(store, 1) == {("engine-b", 0, GPU, None, 0, None, 1)}
    assert await store.block_counts(RANK) == {GPU: 0, CPU: 0, STORAGE: 0}
    assert await store.anomalies(RANK) == {"unknown_removals": 0}
    assert set(await store.prefix_match([1, 2], {"engine-a": None})) == set()
    assert await apply(store, 0, stored([2]))  # registered again: starts from nothing
    assert await counts(store, 2) == {GPU: 1}


# --- residency rules --------------------------------------------------------------


async def test_all_blocks_cleared_mid_batch_clears_gpu_only(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([7], "CPU"))
    events = [stored([3]), stored([8], "CPU"), AllBlocksCleared(), stored([2]), removed([1])]
    assert await apply(store, 1, *events)
    assert await store.block_counts(RANK) == {GPU: 1, CPU: 2, STORAGE: 0}
    assert await counts(store, 2) == {GPU: 1}
    assert await counts(store, 3) == {}
    assert await counts(store, 7) == {CPU: 1}
    assert await store.anomalies(RANK) == {"unknown_removals": 1}  # 1 was cleared first


async def test_unknown_removals_are_counted_and_counts_never_go_negative(store: Store) -> None:
    await apply(store, 0, removed([5]), stored([1]), removed([1, 1]), removed([6], "CPU"))
    assert await store.anomalies(RANK) == {"unknown_removals": 3}
    assert await counts(store, 1) == {}
    await apply(store, 1, stored([1]))
    assert await counts(store, 1) == {GPU: 1}


async def test_repeated_stores_are_reference_counted(store: Store) -> None:
    await apply(store, 0, stored([1, 2]), stored([1]), stored([1], "CPU"), stored([1], "CPU"))
    await apply(store, 1, removed([1]), removed([1], "CPU"))
    assert await counts(store, 1) == {GPU: 1, CPU: 1}
    assert await store.block_counts(RANK) == {GPU: 2, CPU: 1, STORAGE: 0}


async def test_storage_tiers_with_ownership_are_separate_residencies(store: Store) -> None:
    await apply(
        store,
        0,
        stored([21, 22], "STORAGE", owner="kvcr", locality="REMOTE"),
        stored([21], "STORAGE", locality="LOCAL"),
        stored([21], "cpu"),
    )
    assert await where(store, 21) == {
        ("engine-a", 0, STORAGE, "kvcr", 0, "REMOTE", 1),
        ("engine-a", 0, STORAGE, None, 0, "LOCAL", 1),
        ("engine-a", 0, CPU, None, 0, None, 1),
    }
    assert await store.block_counts(RANK) == {GPU: 0, CPU: 1, STORAGE: 2}  # distinct hashes
    await apply(store, 1, removed([21, 22], "STORAGE", owner="kvcr"))
    assert await where(store, 22) == set()
    assert await store.block_counts(RANK) == {GPU: 0, CPU: 1, STORAGE: 1}


async def test_distinct_counts_span_groups_of_a_medium(store: Store) -> None:
    await apply(store, 0, stored([1, 2], group=0), stored([1, 3], group=1, kind="sliding_window"))
    assert await store.block_counts(RANK) == {GPU: 3, CPU: 0, STORAGE: 0}
    await apply(store, 1, removed([1], group=0))
    assert await store.block_counts(RANK) == {GPU: 3, CPU: 0, STORAGE: 0}
    await apply(store, 2, removed([1, 3], group=1))
    assert await store.block_counts(RANK) == {GPU: 1, CPU: 0, STORAGE: 0}


async def test_locality_is_forgotten_with_a_cleared_tier(store: Store) -> None:
    await apply(store, 0, stored([1], "CPU", locality="LOCAL"))
    await apply(store, 1, stored([2], "CPU"))
    assert await where(store, 2) == {("engine-a", 0, CPU, None, 0, "LOCAL", 1)}
    await store.clear(RANK, [CPU])
    await apply(store, 2, stored([2], "CPU"))
    assert await where(store, 2) == {("engine-a", 0, CPU, None, 0, None, 1)}


async def test_a_sliding_window_group_limits_the_hit_to_what_its_window_holds(
    store: Store,
) -> None:
    payload = (FIXTURES / "wire" / "sliding_window_group.msgpack").read_bytes()
    await store.apply_batch(RANK, 0, decode_batch(payload))  # 31 in group 1, window 128
    assert await where(store, 31) == {("engine-a", 0, GPU, None, 1, None, 1)}
    chain = [31, *range(101, 111)]  # 11 blocks, all held by full attention (group 0)
    await apply(store, 1, stored(chain), stored(chain[1:3], group=1, kind="sliding_window"))

    async def hit() -> PrefixMatch:
        return (await store.prefix_match(chain, {"engine-a": None}))[RANK]

    # a window of 128 tokens needs cdiv(127, 16) = 8 blocks: none end at or below 11,
    # so the hit is the run held from block 0
    assert await hit() == PrefixMatch(3, prefix_blocks=3, full_attention_blocks=11)
    await apply(store, 2, stored(chain[3:10], group=1, kind="sliding_window"))
    assert (await hit()).gpu_blocks == 10  # blocks 2..9 end the rightmost window
    await apply(store, 3, removed([chain[5]], group=1))  # a removal carries no kind
    assert await hit() == PrefixMatch(5, prefix_blocks=5, full_attention_blocks=11)
    assert (await store.prefix_match(chain[:5], {"engine-a": None}))[RANK] == PrefixMatch(
        5, prefix_blocks=5
    )


async def test_a_mamba_group_hits_at_its_rightmost_state(store: Store) -> None:
    chain = list(range(1, 12))
    await apply(store, 0, stored(chain[:9]), stored([chain[3], chain[7]], group=1, kind="mamba"))
    match = await store.prefix_match(chain, {"engine-a": None})
    assert match[RANK] == PrefixMatch(8, prefix_blocks=8, full_attention_blocks=9)
    assert (await store.prefix_match(chain[:7], {"engine-a": None}))[RANK].gpu_blocks == 4
    await apply(store, 1, removed([chain[3]], group=1), removed([chain[7]], group=1))
    assert (await store.prefix_match(chain, {"engine-a": None}))[RANK] == PrefixMatch(
        full_attention_blocks=9
    )


async def test_an_unclassified_group_counts_for_matching(store: Store) -> None:
    await apply(store, 0, stored([1, 2], kind=None))
    match = await store.prefix_match([1, 2, 3], {"engine-a": None})
    assert match[RANK].gpu_blocks == 2


async def test_ranks_are_independent(store: Store) -> None:
    ranks = [RankId("engine-a", 0), RankId("engine-a", 1), RankId("engine-b", 0)]
    for i, rank in enumerate(ranks):
        await apply(store, 0, stored([1, 2][: i + 1]), rank=rank, ts=float(i))
    await store.clear(ranks[0], [GPU], reset_seq=True)
    assert await store.watermark(ranks[0]) is None
    assert await store.watermark(ranks[1]) == Watermark(0, 1.0)
    assert await store.ranks() == sorted(ranks)
    match = await store.prefix_match([1, 2], {"engine-a": None})
    assert match == {
        ranks[0]: PrefixMatch(),
        ranks[1]: PrefixMatch(gpu_blocks=2, prefix_blocks=2),
    }
    assert await counts(store, 1, ranks[2]) == {GPU: 1}


async def test_bytes_hashes_are_their_own_keys(store: Store) -> None:
    payload = (FIXTURES / "wire" / "bytes_hashes_lora_extra_keys.msgpack").read_bytes()
    event = decode_batch(payload).events[0]
    first, second = event.block_hashes
    await store.apply_batch(RANK, 0, decode_batch(payload))
    number = int.from_bytes(first, "big")
    await apply(store, 1, stored([number], group=1))
    assert await where(store, first) == {("engine-a", 0, GPU, None, 1, None, 1)}
    assert await counts(store, number) == {GPU: 1}
    match = await store.prefix_match([first, second], {"engine-a": None})
    assert match[RANK].gpu_blocks == 2


# --- prefix matching --------------------------------------------------------------


async def test_prefix_combines_gpu_blocks_with_lower_tier_chunks(store: Store) -> None:
    chain = list(range(100, 116))  # 4 chunks of 4
    await apply(
        store,
        0,
        stored(chain[:6]),
        stored(chain[:4], "CPU"),  # self-describing: teaches 4 blocks per chunk
        stored(chain[4:8], "CPU"),
        stored([chain[11]], "STORAGE", block_size=0),  # placeholder: chunk 2's end hash
    )
    match = await store.prefix_match(chain, {"engine-a": None})
    assert match[RANK] == PrefixMatch(6, 8, 0, 12, 2, 4)
    declared = await store.prefix_match(chain, {"engine-a": 2})  # declared size wins
    assert declared[RANK] == PrefixMatch(6, 8, 0, 8, 2, 0)
    assert await store.prefix_match(chain, {"engine-b": None}) == {}


async def test_prefix_extends_past_the_gpu_run_when_lower_runs_end_inside_it(
    store: Store,
) -> None:
    chain = list(range(200, 216))  # 4 chunks of 4; chunks 0-1 on GPU only
    await apply(
        store, 0, stored(chain[:8]), stored(chain[8:12], "STORAGE"), stored(chain[12:], "CPU")
    )
    match = await store.prefix_match(chain, {"engine-a": 4})
    assert match[RANK] == PrefixMatch(8, 0, 0, 16, 4, 4)


async def test_long_chains_match_to_their_end(store: Store) -> None:
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(600)]
    await apply(store, 0, stored(chain[:530]), stored(chain[:600], "CPU"))
    await apply(store, 0, stored([1]), rank=RankId("engine-b", 0))
    await apply(store, 0, stored(chain[:10]), stored(chain[:400], "CPU"), rank=RankId("c", 0))
    match = await store.prefix_match(chain, {"engine-a": None, "engine-b": None, "c": 4})
    assert match[RANK] == PrefixMatch(530, 600, 0, 600, 70, 0)
    assert match[RankId("engine-b", 0)] == PrefixMatch()
    assert match[RankId("c", 0)] == PrefixMatch(10, 400, 0, 400, 390, 0)
    assert await store.prefix_match([], {"engine-a": None}) == {RANK: PrefixMatch()}


# --- differential: random streams agree with the memory store ----------------------


def random_stream(rng: random.Random, batches: int) -> list[EventBatch]:
    pool = list(range(1, 13))
    out = []
    for i in range(batches):
        events: list = []
        for _ in range(rng.randint(0, 6)):
            if rng.random() < 0.05:
                events.append(AllBlocksCleared())
                continue
            medium = rng.choice(["GPU", "GPU", "CPU", "STORAGE"])
            owner, group = rng.choice([None, None, "kvcr"]), rng.choice([0, 0, 1])
            hashes = rng.sample(pool, rng.randint(1, 4))
            if rng.random() < 0.55:
                kind = rng.choice(["full_attention", None, "sliding_window"])
                events.append(stored(hashes, medium, group, kind, owner, rng.choice([None, "L"])))
            else:
                events.append(removed(hashes, medium, group, owner))
        out.append(EventBatch(float(i), events, 0))
    return out


async def snapshot(store: Store, ranks: list[RankId]) -> dict:
    chains = [list(range(1, 13)), list(range(12, 0, -1)), [1, 2, 3, 4, 5, 6]]
    engines = {r.engine: None for r in ranks}
    return {
        "blocks": {h: await where(store, h) for h in range(1, 13)},
        "counts": [await store.block_counts(r) for r in ranks],
        "anomalies": [await store.anomalies(r) for r in ranks],
        "marks": [await store.watermark(r) for r in ranks],
        "ranks": await store.ranks(),
        "matches": [await store.prefix_match(c, engines) for c in chains],
    }


@pytest.mark.parametrize("seed", range(3))
async def test_random_streams_agree_with_the_memory_store(store: Store, seed: int) -> None:
    rng = random.Random(seed)
    reference = MemoryStore()
    ranks = [RankId("engine-a", 0), RankId("engine-a", 1)]
    streams = {r: random_stream(rng, 40) for r in ranks}
    for i in range(40):
        for rank in ranks:
            for s in (store, reference):
                await s.apply_batch(rank, i, streams[rank][i])
        if i % 13 == 12:  # an operator clear, an engine restart
            for s in (store, reference):
                await s.clear(ranks[0], [CPU])
                await s.clear(ranks[1], [GPU, CPU], reset_seq=True)
    assert await snapshot(store, ranks) == await snapshot(reference, ranks)


# --- Redis only: configuration and layout ------------------------------------------


def test_a_prefix_cannot_hold_a_hash_tag_or_a_glob() -> None:
    for prefix in ("", "a{b}", "idx*", "x[1]"):
        with pytest.raises(ValueError, match="prefix"):
            RedisConfig(prefix=prefix)


async def test_indexes_with_other_prefixes_share_a_server_independently(
    redis_server: RedisServer,
) -> None:
    stores = [RedisStore(redis_config(redis_server.url)) for _ in range(2)]
    try:
        for i, store in enumerate(stores):
            await apply(store, 0, stored([1, 2 + i]))
        await stores[0].forget(RANK)
        await stores[0].sweep()
        assert await stores[0].ranks() == []
        assert await stores[1].block_counts(RANK) == {GPU: 2, CPU: 0, STORAGE: 0}
        assert await counts(stores[1], 3) == {GPU: 1}
    finally:
        for store in stores:
            await store.close()


async def test_buckets_spread_evenly_over_the_cluster(redis_cluster: LocalCluster) -> None:
    """Masters own slot ranges; every one of them should get its share of buckets."""
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    try:
        await store.ping()  # learns the slot map
        owners = [store._client.get_node_from_key(key).name for key in store._bucket_keys]
    finally:
        await store.close()
    shares = sorted(owners.count(node) for node in set(owners))
    assert len(shares) == len(redis_cluster.nodes)
    assert shares[-1] - shares[0] <= 1


@pytest.mark.parametrize("via", ["acl-user", "unix-socket"])
async def test_urls_with_an_acl_user_or_a_unix_socket(tmp_path, via: str) -> None:
    socket = tmp_path / "redis.sock"
    acl = ("--user", "indexer", "on", ">s3cret", "~*", "&*", "+@all", "--user", "default", "off")
    extra = acl if via == "acl-user" else ("--unixsocket", str(socket), "--unixsocketperm", "700")
    auth = ("indexer", "s3cret") if via == "acl-user" else None
    server = RedisServer(tmp_path / "redis", free_port(), extra, auth).start()
    url = server.url if via == "acl-user" else f"unix://{socket}?db=0"
    bad_url = url.replace("s3cret", "badpass")
    stores = [RedisStore(redis_config(url)), RedisStore(redis_config(bad_url))]
    try:
        await apply(stores[0], 0, stored([1]))
        assert await counts(stores[0], 1) == {GPU: 1}
        if via == "acl-user":
            with pytest.raises(StoreUnavailable) as refused:
                await stores[1].ping()
            assert "badpass" not in str(refused.value)  # no password in messages
    finally:
        for store in stores:
            await store.close()
        server.stop()
