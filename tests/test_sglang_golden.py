"""kvindex against SGLang 0.5.23's own golden traces (tests/fixtures/sglang-0.5.23).

Each trace is the frames SGLang's ZMQ publisher sent for a chat workload on its
radix cache, recorded by the SGLang tier (tests/sglang_tier, which checks
SGLang still records them so). Here SGLang's payloads go onto a real ZMQ
socket, half before kvindex follows the engine (replay brings them) and half
after, into each store; every probe's GPU prefix, asked by tokens (hashed
here as SGLang hashes) and by SGLang's own page hashes, must be the hit
SGLang's radix cache computed, and the resident pages SGLang's tree.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from indexer.core.events import GPU, RankId
from indexer.engine_registry import EngineSpec
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.sglang.wire import signed, unsigned
from indexer.ingest.trace import load_trace
from indexer.stores.redis import RedisStore
from producer.publisher import Publisher

from .apikit import LiveApi, csv
from .conftest import free_ports, redis_config, server_for, wait_until

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23"
TRACES = ("page1", "page4-salted-dp1", "page2-reset", "page2-eagle")
SGLANG = catalog.adapter("sglang")


def load(name: str) -> tuple[list[tuple[int, bytes]], dict]:
    expected = json.loads((GOLDEN / f"{name}.expected.json").read_text())
    return load_trace(GOLDEN / f"{name}.frames.msgpack"), expected


def test_kvindex_hashes_prompts_as_sglang_does() -> None:
    """SGLang's own hashes of seeded prompts: page sizes, salts, bigrams, wide tokens."""
    vectors = json.loads((GOLDEN / "hash_vectors.json").read_text())
    assert any(max(v["tokens"]) >= 1 << 32 for v in vectors)
    for v in vectors:
        hasher = SGLANG.hasher("sha256", None, v["page_size"], int(v["eagle"]))
        digests = hasher.digests(Prompt(tuple(v["tokens"]), cache_salt=v["cache_salt"]))
        assert list(map(signed, hasher.published(digests))) == v["hashes"], v


@pytest.mark.parametrize("name", TRACES)
def test_sglang_payloads_decode_to_its_hashes_and_ranks(name: str) -> None:
    trace, expected = load(name)
    batches = [SGLANG.decode(payload) for _, payload in trace]
    assert [seq for seq, _ in trace] == list(range(expected["batches"]))
    assert {b.data_parallel_rank for b in batches} == {expected["engine"]["dp_rank"]}
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    assert {e.block_size for e in stored} == {expected["engine"]["page_size"]}
    announced = {h for e in stored for h in e.block_hashes}
    assert {unsigned(h) for h in expected["gpu_hashes"]} <= announced
    for payload in (p for _, p in trace):  # encoding gives SGLang's bytes back
        assert SGLANG.encode(SGLANG.decode(payload)) == payload


async def _follow(
    live: LiveApi, trace: list[tuple[int, bytes]], engine: dict, hash_algo: str | None
) -> int:
    """Register the engine between the trace's halves, as SGLang names it; its rank."""
    rank, ranks = engine["dp_rank"], engine["dp_rank"] + 1
    base = free_ports(2 * ranks)
    spec = EngineSpec(
        name="sgl",
        endpoint=f"tcp://127.0.0.1:{base}",
        replay_endpoint=f"tcp://127.0.0.1:{base + ranks}",
        dp_ranks=ranks,
        topic=engine["topic"],
        block_size=engine["page_size"],
        lookahead_tokens=int(engine["eagle"]),
        hash_algo=hash_algo,
        adapter="sglang",
    )
    publisher = Publisher(
        spec.endpoint,
        spec.replay_endpoint,
        data_parallel_rank=rank,
        topic=engine["topic"],
        bind=True,
        adapter=SGLANG,
    )
    live.publishers.append(publisher)
    half = len(trace) // 2
    for _, payload in trace[:half]:
        assert publisher.publish_encoded(payload)
    assert await asyncio.to_thread(publisher.flush)
    await live.registry.add(spec)
    for _, payload in trace[half:]:
        assert publisher.publish_encoded(payload)

    def applied() -> bool:
        status = live.subscriber.rank_status("sgl")[rank]
        return status.applied_seq == len(trace) - 1

    await wait_until(applied, timeout=30.0, what="the trace to be applied")
    assert live.subscriber.rank_status("sgl")[rank].replays >= 1
    return rank


#: sha256: tokens hashed here as SGLang hashes them; None: matched through the token
#: index learned from its events, as for an engine whose hashes are not computed.
@pytest.mark.parametrize("hash_algo", ["sha256", None])
@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("name", TRACES)
async def test_kvindex_answers_sglangs_probes(
    request: pytest.FixtureRequest, name: str, kind: str, hash_algo: str | None
) -> None:
    trace, expected = load(name)
    store = None if kind == "memory" else RedisStore(redis_config(server_for(request, kind).url))
    try:
        await _check_probes(LiveApi(store=store), trace, expected, hash_algo)
    finally:
        if store is not None:
            await store.close()


async def _check_probes(
    api: LiveApi, trace: list[tuple[int, bytes]], expected: dict, hash_algo: str | None
) -> None:
    engine = expected["engine"]
    async with api as live:
        rank = await _follow(live, trace, engine, hash_algo)
        counts = await live.store.block_counts(RankId("sgl", rank))
        assert counts[GPU] == len(expected["gpu_hashes"])
        for block_hash in expected["gpu_hashes"][:: max(1, len(expected["gpu_hashes"]) // 40)]:
            rows = await live.store.block_residency(unsigned(block_hash))
            assert [(r.engine, r.dp_rank, r.medium, r.count) for r in rows] == [
                ("sgl", rank, GPU, 1)
            ]
        for probe in expected["probes"]:
            salt = {"cache_salt": probe["cache_salt"]} if probe["cache_salt"] else {}
            for params in (
                {"tokens": csv(probe["tokens"]), **salt},
                {"block_hashes": csv(map(unsigned, probe["hashes"]))},
            ):
                answer = (await live.client.get("/prefix-match", params=params)).json()
                hits = {e["dp_rank"]: e["gpu_blocks"] for e in answer["engines"]}
                got = hits.get(rank, 0) * engine["page_size"]
                assert got == probe["device_prefix_len"], (params.keys(), probe)
