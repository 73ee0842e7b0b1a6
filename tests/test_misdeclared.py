"""Engines declared with a configuration their events contradict are caught.

Simulated engines publish over real ZMQ to the real subscriber; each is
declared with one field wrong (block size, a hash seed it runs with but did not
declare, KV groups) beside one declared right, and ``/engines/{name}``, the
log and ``kvindex_engine_misdeclared_total`` must say so within a few batches,
while tokens queries leave the flagged engine out.
"""

from __future__ import annotations

import logging

import pytest

from indexer import metrics
from indexer.core.events import BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.registry import KVGroup
from producer.sim import SimConfig, SimEngine
from producer.workload import Workload, WorkloadConfig

from .apikit import LiveApi
from .test_e2e import until

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
    (publisher,) = await live.add_published("hybrid", kv_groups=groups)
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
    await _publish(live, "e", SimConfig(block_size=32), 2, block_size=32)
    assert (await live.client.get("/engines/e")).json()["misdeclared"] == []
