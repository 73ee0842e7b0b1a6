"""Engines declared with a configuration their events contradict are caught.

Simulated engines publish over real ZMQ to the real subscriber; each is
declared with one field wrong (block size, a hash seed it runs with but did not
declare, KV groups) beside one declared right, and ``/engines/{name}``, the
log and ``kvindex_engine_misdeclared_total`` must say so within a few batches,
while tokens queries leave the flagged engine out.
"""

from __future__ import annotations

import logging
import uuid

import httpx
import pytest

from indexer import metrics
from indexer.core.events import BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.kv_groups import KVGroup
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.workload import Workload, WorkloadConfig

from .apikit import LiveApi
from .conftest import free_ports
from .test_e2e import until
from .test_scaleout import Process

WORKLOAD = WorkloadConfig(seed=7, rate=50.0)


@pytest.fixture
async def live() -> LiveApi:
    async with LiveApi() as api:
        yield api


async def _publish(live: LiveApi, name: str, config: SimConfig, batches: int, **declared):
    """Run a simulated engine ``batches`` steps, declared as ``declared`` says."""
    (publisher,) = await live.add_published(name, **declared)
    engine = SimEngine(config, 0)
    requests = Workload(WORKLOAD, stream=0)
    served: list[tuple[int, ...]] = []
    seq = -1
    for step in range(batches * 4):
        request = next(requests)
        if step % 2 == 0:
            engine.submit(request.prompt, request.output)
            served.append(tuple(request.prompt))
        batch = engine.step()
        if batch is not None:
            publisher.publish(batch)
            seq += 1
        if seq + 1 >= batches:
            break
    await live.wait_applied(name, [seq])
    return served


def _count(name: str, kind: str) -> float:
    return metrics.MISDECLARED.labels(name, kind)._value.get()


async def test_a_wrong_block_size_is_caught_and_left_out_of_tokens_matching(live, caplog):
    caplog.set_level(logging.WARNING, "kvindex.misdeclared")
    served = await _publish(live, "wrong", SimConfig(block_size=32), 4, block_size=16)
    await _publish(live, "right", SimConfig(block_size=32), 4, block_size=32)
    wrong = (await live.client.get("/engines/wrong")).json()
    assert wrong["misdeclared"] == ["block_size: declared 16, events show 32"]
    assert (await live.client.get("/engines/right")).json()["misdeclared"] == []
    assert _count("wrong", "block_size") == 1 and _count("right", "block_size") == 0
    assert any(
        r.message.startswith("engine misdeclared") and r.engine == "wrong" for r in caplog.records
    )
    answer = (await live.client.post("/prefix-match", json={"tokens": list(served[0])})).json()
    rows = {row["engine"]: row for row in answer["engines"]}
    assert rows["wrong"]["prefix_blocks"] == 0  # listed, matched by nothing
    assert rows["right"]["gpu_blocks"] > 0


async def test_a_seed_in_force_but_not_declared_is_caught(live):
    seeded = SimConfig(hash_algo="sha256", hash_seed="42")
    served = await _publish(live, "unseeded", seeded, 4, hash_algo="sha256")
    await _publish(live, "declared", seeded, 4, hash_algo="sha256", hash_seed="42")
    reasons = (await live.client.get("/engines/unseeded")).json()["misdeclared"]
    assert len(reasons) == 1 and reasons[0].startswith("hash: ") and "no hash_seed" in reasons[0]
    assert (await live.client.get("/engines/declared")).json()["misdeclared"] == []
    assert _count("unseeded", "hash") == 1
    metrics_text = (await live.client.get("/metrics")).text
    assert 'kvindex_engine_misdeclared_total{engine="unseeded",reason="hash"} 1.0' in metrics_text
    answer = (await live.client.post("/prefix-match", json={"tokens": list(served[0])})).json()
    rows = {row["engine"]: row for row in answer["engines"]}
    assert rows["unseeded"]["gpu_blocks"] == 0 and rows["declared"]["gpu_blocks"] > 0


async def test_a_kv_group_the_declaration_lacks_is_caught(live):
    groups = [KVGroup(kind="full_attention")]
    (publisher,) = await live.add_published("hybrid", kv_groups=groups, block_size=16)
    hasher = catalog.adapter("vllm").hasher("sha256", None, 16)
    stored = BlockStored(
        block_hashes=hasher.published(hasher.digests(Prompt(tuple(range(16))))),
        token_ids=list(range(16)),
        block_size=16,
        extra_keys=[None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        medium="GPU",
    )
    publisher.publish(EventBatch(ts=1.0, events=[stored]))
    await live.wait_applied("hybrid", [0])
    await until(lambda: _flagged(live, "hybrid"), 5, "the group mismatch to be reported")
    reasons = (await live.client.get("/engines/hybrid")).json()["misdeclared"]
    assert reasons == ["kv_groups: events show group_idx 1, 1 group(s) declared"]
    assert _count("hybrid", "kv_groups") == 1


async def _flagged(live: LiveApi, name: str) -> bool:
    return bool((await live.client.get(f"/engines/{name}")).json()["misdeclared"])


async def test_a_new_registration_is_checked_afresh(live):
    await _publish(live, "e", SimConfig(block_size=32), 2, block_size=16)
    assert (await live.client.get("/engines/e")).json()["misdeclared"]
    assert (await live.client.delete("/engines/e")).status_code == 200
    for publisher in live.publishers:
        publisher.close()
    served = await _publish(live, "e", SimConfig(block_size=32), 2, block_size=32)
    assert (await live.client.get("/engines/e")).json()["misdeclared"] == []
    answer = (await live.client.post("/prefix-match", json={"tokens": list(served[0])})).json()
    assert answer["engines"][0]["gpu_blocks"] > 0  # no longer left out of tokens matching


@pytest.mark.slow
async def test_in_scale_out_the_worker_finds_it_and_every_replica_reports_it(
    redis_server, tmp_path
):
    redis = ("--redis-url", redis_server.url, "--redis-prefix", f"mis-{uuid.uuid4().hex[:8]}")
    port, base = free_ports(), free_ports(2)
    worker = Process(tmp_path / "worker.log", "indexer", *redis, "--worker-id", "w1")
    api = Process(tmp_path / "api.log", "api", *redis, "--port", str(port))
    publisher = Publisher(f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}", bind=True)
    spec = {
        "name": "wrong",
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "block_size": 16,
    }
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await until(lambda: _up(client), 30, "the API replica")
            assert (await client.post("/engines", json=spec)).status_code == 201
            await until(lambda: _connected(client), 30, "the worker to consume the engine")
            engine, requests = SimEngine(SimConfig(block_size=32), 0), Workload(WORKLOAD, 0)
            for _ in range(40):
                request = next(requests)
                engine.submit(request.prompt, request.output)
                if (batch := engine.step()) is not None:
                    publisher.publish(batch)
            await until(lambda: _reported(client), 30, "the replica to report the worker's find")
            state = (await client.get("/engines/wrong")).json()
        assert state["misdeclared"] == ["block_size: declared 16, events show 32"]
        assert "engine misdeclared" in worker.log.read_text()
    finally:
        publisher.close()
        api.stop()
        worker.stop()


async def _up(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


async def _connected(client: httpx.AsyncClient) -> bool:
    return (await client.get("/stats")).json()["connected_ranks"] == 1


async def _reported(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/engines/wrong")).json()["misdeclared"])


async def test_an_engine_without_a_block_size_learns_it_from_its_first_store(live):
    """Fails before the URL registrations: EngineSpec refused ``block_size: null``."""
    (publisher,) = await live.add_published("unsized", block_size=None)
    before = (await live.client.get("/engines/unsized")).json()
    assert before["block_size"] is None and before["learned_block_size"] is None
    assert before["unmatched"].startswith("block size not known yet")
    prompt = list(range(64))
    answer = (await live.client.post("/prefix-match", json={"tokens": prompt})).json()
    assert answer["block_size"] is None and answer["engines"][0]["prefix_blocks"] == 0
    hasher = catalog.adapter("vllm").hasher("sha256", None, 32)
    stored = BlockStored(
        block_hashes=hasher.published(hasher.digests(Prompt(tuple(prompt)))),
        token_ids=prompt,
        block_size=32,
        extra_keys=[None, None],
        medium="GPU",
    )
    publisher.publish(EventBatch(ts=1.0, events=[stored]))
    await live.wait_applied("unsized", [0])
    after = (await live.client.get("/engines/unsized")).json()
    assert (after["learned_block_size"], after["unmatched"], after["misdeclared"]) == (32, None, [])
    answer = (await live.client.post("/prefix-match", json={"tokens": prompt})).json()
    row = answer["engines"][0]
    assert (answer["block_size"], row["gpu_blocks"], row["prefix_tokens"]) == (32, 2, 64)
