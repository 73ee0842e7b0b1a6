"""Engines registered by URL in the real processes: ``kvindex serve`` with
``--engine-url`` and a config's ``engine_urls``, and in scale-out a worker and
an API replica over Redis, since retries, restarts and shared findings only
show between processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import free_ports
from .engine_url_kit import BLOCK, PROMPT, EngineServer
from .test_e2e import until
from .test_scaleout import Process
from .test_serve import Serve


@pytest.fixture
def server() -> Iterator[EngineServer]:
    engine = EngineServer()
    yield engine
    engine.close()


# --- kvindex serve and kvindex indexer -------------------------------------------------


@pytest.mark.slow
def test_serve_registers_flag_and_config_urls_once_their_servers_answer(tmp_path: Path) -> None:
    """Started before either server is up: both are retried, then followed."""
    flag, config = EngineServer(), EngineServer()
    for engine in (flag, config):  # not up yet
        engine.down()
    path = tmp_path / "kvindex.yaml"
    path.write_text(f"engine_urls:\n  - {{url: '{config.url}', name: cfg}}\n")
    serve = Serve(tmp_path / "serve.log", "--config", str(path), "--engine-url", flag.url)
    try:
        serve.until(lambda: serve.logs().count("retrying") >= 2, "both retried")
        assert serve.get("/engines") == []
        for engine in (flag, config):
            engine.up(int(engine.url.rsplit(":", 1)[1]))
        for name in (flag.name, "cfg"):
            serve.until(lambda n=name: serve.get(f"/engines/{n}") is not None, f"{name} registered")
        flag.publish()
        config.publish()
        for name in (flag.name, "cfg"):
            serve.until(
                lambda n=name: serve.rank(n).get("applied_seq") == 0, f"{name} to apply its batch"
            )
            state = serve.get(f"/engines/{name}")
            assert (state["url"], state["learned_block_size"]) == (
                flag.url if name == flag.name else config.url,
                BLOCK,
            )
        answer = serve.http.post("/prefix-match", json={"tokens": PROMPT}).json()
        assert [row["gpu_blocks"] for row in answer["engines"]] == [3, 3]
        logs = serve.stop()
    finally:
        flag.close()
        config.close()
    registered = [e for e in logs if e["event"] == "engine registered by its URL"]
    assert sorted(e["engine"] for e in registered) == sorted(["cfg", flag.name])


@pytest.mark.slow
async def test_in_scale_out_the_replicas_use_the_block_size_the_worker_learned(
    redis_server, tmp_path, server
):
    redis = ("--redis-url", redis_server.url, "--redis-prefix", f"url-{uuid.uuid4().hex[:8]}")
    port = free_ports()
    worker = Process(tmp_path / "w.log", "indexer", *redis, "--engine-url", server.url)
    api = Process(tmp_path / "api.log", "api", *redis, "--port", str(port))
    name = server.name
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def state() -> dict | None:
                try:
                    answer = await client.get(f"/engines/{name}")
                except httpx.TransportError:
                    return None
                return answer.json() if answer.status_code == 200 else None

            async def registered() -> bool:
                return await state() is not None

            await until(registered, 30, "the worker to register the engine")
            server.publish()

            async def learned() -> bool:
                return ((await state()) or {}).get("learned_block_size") == BLOCK

            await until(learned, 30, "the replica to read the block size the worker learned")
            answer = (await client.post("/prefix-match", json={"tokens": PROMPT})).json()
        assert answer["engines"][0]["gpu_blocks"] == 3
    finally:
        api.stop()
        worker.stop()


async def test_a_worker_taking_an_engine_over_keeps_what_its_predecessor_found(redis_server):
    """The next owner learns the block size again before it has checked the hashes:
    its first publication must not clear the contradiction found before."""
    from indexer.cluster.misdeclared_board import RedisMisdeclared
    from indexer.cluster.redis_registry import RedisRegistry
    from indexer.engine_registry import EngineSpec
    from indexer.stores.redis import RedisConfig, RedisStore

    store = RedisStore(RedisConfig(redis_server.url, prefix=f"over-{uuid.uuid4().hex[:8]}"))
    try:
        registry = RedisRegistry(store.client)
        spec = await registry.add(EngineSpec("e", "tcp://127.0.0.1:1", block_size=None))
        replica = RedisMisdeclared(store.client, registry)
        RedisMisdeclared(store.client, registry).publish(spec, {"hash": "hash: differ"}, BLOCK)

        async def has(reasons: list[str], size: int) -> bool:
            await replica.refresh()
            return (replica.reasons("e"), replica.block_size("e")) == (reasons, size)

        await until(lambda: has(["hash: differ"], BLOCK), 5, "the first owner's finding")
        after = RedisMisdeclared(store.client, registry)  # the next owner: learns, then finds
        after.publish(spec, {}, BLOCK)
        after.publish(spec, {"kv_groups": "kv_groups: differ"}, BLOCK)
        both = ["hash: differ", "kv_groups: differ"]
        await until(lambda: has(both, BLOCK), 5, "both owners' findings")
        assert replica.excluded("e")
    finally:
        await store.close()
