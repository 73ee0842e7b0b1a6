"""Engines registered by their OpenAI server's URL alone.

A real HTTP server started by the test answers ``/kv_event_sources`` and
``/v1/models`` as vLLM 0.32/0.33's OpenAI server does, and kvindex's
vLLM-wire publisher binds the ports it announces (``tcp://*:PORT``, as vLLM
does). Registration goes through ``POST /engines`` (the app with the real
subscriber), and through ``kvindex serve --engine-url`` and a config file's
``engine_urls`` (the real process), and in scale-out through a worker and an
API replica over Redis. Every test here fails on the code before URL
registrations (no ``url`` body, flag or config key; ``block_size`` could not be
null).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch
from indexer.discovery.served import (
    BadAnswer,
    Unsupported,
    engine_url,
    parse_engine_url,
    recheck,
    spec_of,
)
from indexer.engines import catalog
from indexer.engines.base import Prompt
from kvindex.cli import parse_args
from kvindex.config import ConfigError, load_config
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import free_ports, wait_until
from .test_e2e import until
from .test_scaleout import Process
from .test_serve import Serve

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BLOCK = 32  # the engine's block size, which only its events say
PROMPT = list(range(100, 100 + 3 * BLOCK))


def sources(pub: int, replay: int, ranks: int = 1, **more: Any) -> dict[str, dict]:
    """``/kv_event_sources`` as vLLM 0.33 answers it: each rank's events config."""
    return {
        str(r): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub + r}",
            "replay_endpoint": f"tcp://*:{replay + r}",
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "kv-events",
            **more,
        }
        for r in range(ranks)
    }


MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "parent": None}]}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up mid-answer: nothing to report


class EngineServer:
    """A real HTTP server answering an engine's description (path -> JSON, or a
    status code), and its ranks' publishers on the announced ports."""

    def __init__(self, answers: dict[str, Any] | None = None, ranks: int = 1) -> None:
        self.pub, self.replay = free_ports(ranks), free_ports(ranks)
        self.answers = answers or {
            "/kv_event_sources": sources(self.pub, self.replay, ranks),
            "/v1/models": MODELS,
        }
        served = self.answers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer = served.get(self.path, 404)
                status = answer if isinstance(answer, int) else 200
                body = json.dumps({"detail": "Not Found"} if status != 200 else answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self.up()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.name = self.url.removeprefix("http://")
        self.publishers: dict[int, Publisher] = {}

    def up(self, port: int = 0) -> None:
        """Serve (again) on ``port`` (0: any free one)."""
        self.http = _Server(("127.0.0.1", port), self._handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def publish(self, algo: str = "sha256", rank: int = 0) -> None:
        """One batch storing PROMPT's blocks on ``rank``'s GPU, hashed as an engine running
        ``algo``."""
        publisher = self.publishers.get(rank)
        if publisher is None:
            publisher = self.publishers[rank] = Publisher(
                f"tcp://*:{self.pub}",
                f"tcp://*:{self.replay}",
                topic="kv-events",
                data_parallel_rank=rank,
                bind=True,
            )
        hasher = catalog.adapter("vllm").hasher(algo, None, BLOCK)
        stored = BlockStored(
            block_hashes=hasher.published(hasher.digests(Prompt(tuple(PROMPT)))),
            token_ids=PROMPT,
            block_size=BLOCK,
            extra_keys=[None] * 3,
            medium="GPU",
        )
        assert publisher.publish(EventBatch(ts=1.0, events=[stored]))
        assert publisher.flush()

    def close(self) -> None:
        self.down()
        for publisher in self.publishers.values():
            publisher.close()


@pytest.fixture
def server() -> Iterator[EngineServer]:
    engine = EngineServer()
    yield engine
    engine.close()


@pytest.fixture
async def live() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(auth_token=TOKEN)) as api:
        yield api


# --- the description -----------------------------------------------------------------


def test_a_description_becomes_a_spec_at_the_servers_host() -> None:
    target = parse_engine_url("http://10.0.0.5:8100,hash_algo=sha256_cbor")
    spec = spec_of(target, sources(5600, 5610, ranks=2), MODELS)
    assert (spec.name, spec.url, spec.model) == ("10.0.0.5:8100", "http://10.0.0.5:8100", "tiny")
    assert (spec.endpoint, spec.replay_endpoint) == ("tcp://10.0.0.5:5600", "tcp://10.0.0.5:5610")
    assert (spec.dp_ranks, spec.topic, spec.block_size, spec.hash_algo) == (
        2,
        "kv-events",
        None,
        "sha256_cbor",
    )
    nulls = engine_url("http://h:8000/", {"name": None, "model": None, "hash_seed": None})
    spec = spec_of(nulls, sources(5600, 5610), MODELS)  # null: the default, or None if it may be
    assert (spec.name, spec.model, spec.hash_seed) == ("h:8000", "tiny", None)
    later = [{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.9:5557", "topic": ""}]
    lora = {"data": [{"id": "adapter", "parent": "base"}, {"id": "base"}]}
    spec = spec_of(engine_url("http://h:8000", {"name": "a", "block_size": 16}), later, lora)
    assert (spec.name, spec.endpoint, spec.replay_endpoint, spec.model, spec.block_size) == (
        "a",
        "tcp://10.0.0.9:5557",
        None,
        "base",
        16,
    )


def test_what_cannot_be_followed_is_said() -> None:
    target = engine_url("http://h:8000")
    odd = sources(5600, 5610, ranks=2)
    odd["1"]["endpoint"] = "tcp://*:5700"
    with pytest.raises(Unsupported, match=r"rank 1's endpoint is tcp://\*:5700, not rank 0's port"):
        spec_of(target, odd, MODELS)
    with pytest.raises(Unsupported, match="publishes no KV events"):
        spec_of(target, sources(1, 2, enable_kv_cache_events=False), MODELS)
    with pytest.raises(Unsupported, match="zmq publishers only"):
        spec_of(target, sources(1, 2, publisher="null"), MODELS)
    with pytest.raises(Unsupported, match="no KV event sources"):
        spec_of(target, {}, MODELS)
    with pytest.raises(BadAnswer, match="names no served model"):
        spec_of(target, sources(1, 2), {"data": []})
    for bad, why in [
        ("ftp://h", "expected http://HOST"),
        ("http://h,endpoint=tcp://h:1", "set by the engine's server"),
        ("http://h,colour=red", "unknown field"),
        ("http://h,block_size=x", "block_size"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_engine_url(bad)


def test_the_flag_its_variable_and_the_config_key(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVINDEX_ENGINE_URL", "http://a:8100 http://b:8100,name=b,hash_algo=xxhash")
    urls = parse_args(["serve"]).engine_url
    assert [(u.url, u.name, dict(u.fields)) for u in urls] == [
        ("http://a:8100", "a:8100", {}),
        ("http://b:8100", "b", {"name": "b", "hash_algo": "xxhash"}),
    ]
    config = tmp_path / "kvindex.yaml"
    config.write_text(
        "engine_urls:\n  - http://a:8100\n  - {url: 'http://c:8100', name: c, block_size: 32}\n"
    )
    loaded = load_config(config).url_engines(urls[1:])
    assert [(u.url, u.name) for u in loaded] == [
        ("http://a:8100", "a:8100"),
        ("http://c:8100", "c"),
        ("http://b:8100", "b"),
    ]
    config.write_text("engine_urls:\n  - {url: 'http://c:8100', dp_ranks: 2}\n")
    with pytest.raises(ConfigError, match=r"engine_urls: .*dp_ranks: set by the engine.s server"):
        load_config(config).url_engines()


# --- POST /engines ---------------------------------------------------------------------


async def test_post_engines_by_url_learns_the_block_size_then_matches(live, server):
    refused = await live.client.post("/engines", json={"url": server.url})
    assert refused.status_code == 401  # the token POST /engines always needed
    created = await live.client.post("/engines", json={"url": server.url}, headers=AUTH)
    assert created.status_code == 201, created.text
    spec = created.json()
    assert (spec["name"], spec["url"], spec["model"], spec["block_size"]) == (
        server.name,
        server.url,
        "tiny",
        None,
    )
    assert spec["endpoint"] == f"tcp://127.0.0.1:{server.pub}"  # "*" is the server's host
    assert (spec["replay_endpoint"], spec["topic"]) == (
        f"tcp://127.0.0.1:{server.replay}",
        "kv-events",
    )
    state = (await live.client.get(f"/engines/{server.name}")).json()
    assert state["unmatched"].startswith("block size not known yet")
    before = (await live.client.post("/prefix-match", json={"tokens": PROMPT})).json()
    assert before["engines"][0]["prefix_blocks"] == 0 and before["block_size"] is None
    server.publish()
    await live.wait_applied(server.name, [0])
    state = (await live.client.get(f"/engines/{server.name}")).json()
    assert (state["learned_block_size"], state["unmatched"], state["misdeclared"]) == (
        BLOCK,
        None,
        [],
    )
    answer = (
        await live.client.post("/prefix-match", json={"tokens": PROMPT, "model": "tiny"})
    ).json()
    row = answer["engines"][0]
    assert (answer["block_size"], row["gpu_blocks"], row["prefix_tokens"]) == (BLOCK, 3, 3 * BLOCK)


async def test_each_data_parallel_rank_is_followed_at_its_port(live):
    server = EngineServer(ranks=2)
    try:
        created = await live.client.post("/engines", json={"url": server.url}, headers=AUTH)
        assert created.status_code == 201, created.text
        assert created.json()["dp_ranks"] == 2
        server.publish(rank=1)  # rank 0 publishes nothing

        def applied() -> bool:
            return live.subscriber.rank_status(server.name)[1].applied_seq == 0

        await wait_until(applied, 30, "rank 1 to apply its batch")
    finally:
        server.close()
    answer = (await live.client.post("/prefix-match", json={"tokens": PROMPT})).json()
    assert [(row["dp_rank"], row["gpu_blocks"]) for row in answer["engines"]] == [(1, 3), (0, 0)]


async def test_an_engine_restarted_on_other_ports_is_followed_there(live, server):
    created = await live.client.post("/engines", json={"url": server.url}, headers=AUTH)
    assert created.status_code == 201, created.text
    server.pub, server.replay = free_ports(), free_ports()  # restarted elsewhere
    server.answers["/kv_event_sources"] = sources(server.pub, server.replay)
    server.publish()

    def connected(engine: str) -> bool:
        return any(s.connected for s in live.subscriber.rank_status(engine))

    await recheck(live.registry, connected)
    spec = live.registry.get(server.name)
    assert (spec.endpoint, spec.url) == (f"tcp://127.0.0.1:{server.pub}", server.url)
    await live.wait_applied(server.name, [0])
    answer = (await live.client.post("/prefix-match", json={"tokens": PROMPT})).json()
    assert answer["engines"][0]["gpu_blocks"] == 3
    await recheck(live.registry, connected)  # connected now: left alone
    assert live.registry.get(server.name) is spec


async def test_a_hash_algorithm_the_events_contradict_is_flagged(live, server):
    body = {"url": server.url, "name": "cbor", "hash_algo": "sha256_cbor"}
    created = await live.client.post("/engines", json=body, headers=AUTH)
    assert created.status_code == 201, created.text
    server.publish("sha256")  # the engine runs vLLM's default, not what was declared
    await live.wait_applied("cbor", [0])
    state = (await live.client.get("/engines/cbor")).json()
    assert state["learned_block_size"] == BLOCK
    assert len(state["misdeclared"]) == 1 and state["misdeclared"][0].startswith("hash: ")
    assert "sha256_cbor" in state["misdeclared"][0]
    assert state["unmatched"].startswith("its events contradict")
    answer = (await live.client.post("/prefix-match", json={"tokens": PROMPT})).json()
    assert answer["engines"][0]["gpu_blocks"] == 0


async def test_a_server_that_cannot_be_asked_is_a_clear_error(live):
    down = f"http://127.0.0.1:{free_ports()}"
    answer = await live.client.post("/engines", json={"url": down}, headers=AUTH)
    assert answer.status_code == 503
    assert answer.json()["error"].startswith(f"engine server {down}: cannot reach {down}")
    old = EngineServer({"/v1/models": MODELS})  # a server without /kv_event_sources
    try:
        answer = await live.client.post("/engines", json={"url": old.url}, headers=AUTH)
    finally:
        old.close()
    assert answer.status_code == 502
    assert f"{old.url}/kv_event_sources answered 404" in answer.json()["error"]
    bad = await live.client.post("/engines", json={"url": "tcp://h:1"}, headers=AUTH)
    assert bad.status_code == 422 and "expected http://HOST" in bad.json()["error"]
    assert live.registry.all() == []


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
    from indexer.cluster.registry import RedisRegistry
    from indexer.registry import EngineSpec
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
