"""Engines registered by their OpenAI server's URL alone.

A real HTTP server started by the test answers ``/kv_event_sources`` and
``/v1/models`` as vLLM 0.32/0.33's OpenAI server does, and kvindex's
vLLM-wire publisher binds the ports it announces (``tcp://*:PORT``, as vLLM
does). Registration goes through ``POST /engines`` (the app with the real
subscriber), and through ``kvindex serve --engine-url`` and a config file's
``engine_urls`` (the real process), and in scale-out through a worker and an
API replica over Redis (those two in ``test_engine_url_processes.py``). Every
test here fails on the code before URL registrations (no ``url`` body, flag or
config key; ``block_size`` could not be null).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from api import ApiSettings
from indexer.discovery.served import (
    BadAnswer,
    Unsupported,
    engine_url,
    parse_engine_url,
    recheck,
    spec_of,
)
from kvindex.cli import parse_args
from kvindex.config import ConfigError, load_config

from .apikit import LiveApi
from .conftest import free_ports, wait_until
from .engine_url_kit import AUTH, BLOCK, MODELS, PROMPT, TOKEN, EngineServer, sources


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
