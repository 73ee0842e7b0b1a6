"""Every refusal is a JSON answer that names its cause, and nothing is taken silently.

Over real sockets against the server ``kvindex serve`` runs: a GET head too long
for the server, a connection beyond the limit, a parameter or key given twice,
an engine whose topic or replay endpoint cannot work, a Redis that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from api import ApiSettings
from indexer.engine_registry import EngineRegistry
from indexer.stores import MemoryStore
from indexer.stores.redis import RedisConfig, RedisStore
from kvindex.wiring import api_app

from .apikit import FakeConsumers, served
from .conftest import free_ports
from .servers import RedisServer, free_port

ENGINE = {"name": "a", "endpoint": "tcp://127.0.0.1:1"}


@contextlib.asynccontextmanager
async def api(**settings) -> AsyncIterator[httpx.AsyncClient]:
    store, config = MemoryStore(), ApiSettings(**settings)
    app = api_app(store, EngineRegistry(), FakeConsumers(store), config)
    async with served(app, config) as client:
        yield client


def port_of(client: httpx.AsyncClient) -> int:
    return client.base_url.port


async def raw_answer(port: int, request: bytes) -> tuple[bytes, dict]:
    """Send ``request`` whole on a new connection; the status line and JSON body answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


def refusal(answer: httpx.Response, status: int, *named: str) -> str:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    message = answer.json()["error"]
    assert all(name in message for name in named), message
    return message


# --- the HTTP server's own refusals ----------------------------------------------


async def test_a_get_head_over_the_limit_is_a_json_431_that_says_to_post() -> None:
    async with api(max_body_bytes=1 << 20) as client:
        tokens = ",".join(["123456"] * 200_000)  # 1.4 MB of URL
        request = f"GET /prefix-match?tokens={tokens} HTTP/1.1\r\nHost: k\r\n\r\n".encode()
        status, body = await raw_answer(port_of(client), request)
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
        assert "POST /prefix-match" in body["error"] and "1048576 bytes" in body["error"]
        assert (await client.get("/healthz")).status_code == 200


async def test_a_malformed_head_is_a_json_400() -> None:
    async with api() as client:
        status, body = await raw_answer(port_of(client), b"GET / HTTP/1.1\r\nno colon\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and body["error"]


async def test_connections_beyond_the_limit_are_a_json_503() -> None:
    async with api(max_connections=2, header_timeout=5.0) as client:
        held = [await asyncio.open_connection("127.0.0.1", port_of(client)) for _ in range(2)]
        try:
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(base_url=str(client.base_url)) as third:
                message = refusal(await third.get("/healthz"), 503, "api.max_connections")
            assert "2 open connections" in message
        finally:
            for _, writer in held:
                writer.close()
        for _ in range(100):  # until the server has seen them close
            if (await client.get("/healthz")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert (await client.get("/healthz")).status_code == 200


# --- nothing given twice ---------------------------------------------------------


async def test_a_query_parameter_given_twice_is_named() -> None:
    async with api() as client:
        twice = await client.get("/prefix-match?block_hashes=1&model=m&block_hashes=2")
        refusal(twice, 422, "'block_hashes'", "more than once")
        assert (await client.get("/prefix-match?block_hashes=1&model=m")).status_code == 404


@pytest.mark.parametrize(
    "body, key",
    [
        ('{"block_hashes": [1], "block_hashes": [2]}', "block_hashes"),
        ('{"tokens": [1], "weights": {"gpu": 1, "gpu": 0}}', "gpu"),
        ('{"tokens": [1], "tok\\u0065ns": [2]}', "tokens"),
        ('{"messages": [{"role": "user", "content": "a", "role": "system"}]}', "role"),
    ],
)
async def test_a_json_key_given_twice_is_named(body: str, key: str) -> None:
    """Twice in one object; in two objects (a chat's messages, features) a key is fine."""
    features = [{"identifier": "x", "offset": 0, "length": 1}] * 2
    async with api() as client:
        headers = {"Content-Type": "application/json"}
        answer = await client.post("/prefix-match", content=body, headers=headers)
        refusal(answer, 422, repr(key), "more than once")
        across = await client.post("/prefix-match", json={"tokens": [1], "mm_features": features})
        assert across.status_code == 200, across.text


# --- engines that cannot work ----------------------------------------------------


async def test_a_topic_holding_nul_is_refused() -> None:
    async with api() as client:
        answer = await client.post("/engines", json=ENGINE | {"topic": "kv\u0000events"})
        refusal(answer, 422, "topic", "NUL")
        assert (await client.get("/engines")).json() == []


@pytest.mark.parametrize("bind", [True, False])
async def test_a_replay_endpoint_that_is_the_endpoint_is_refused(bind: bool) -> None:
    endpoint = f"tcp://127.0.0.1:{free_ports()}"
    async with api() as client:
        same = {"name": "a", "endpoint": endpoint, "replay_endpoint": endpoint, "bind": bind}
        message = refusal(await client.post("/engines", json=same), 422, "replay_endpoint")
        assert ("kvindex's own SUB" in message) == bind
        assert (await client.get("/engines")).json() == []


# --- a store known to be down ----------------------------------------------------


async def timed(client: httpx.AsyncClient, path: str) -> tuple[int, float]:
    started = time.monotonic()
    answer = await client.get(path)
    return answer.status_code, time.monotonic() - started


async def test_requests_fail_fast_while_the_store_is_down_and_never_once_it_is_up(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "redis", free_port()).start()
    config = RedisConfig(server.url, prefix="t", socket_timeout=2.0, sweep_interval=None)
    store, settings = RedisStore(config), ApiSettings()
    app = api_app(store, EngineRegistry(), FakeConsumers(store), settings)
    try:
        async with served(app, settings) as client:
            assert (await client.get("/blocks/1")).status_code == 200
            server.proc.send_signal(signal.SIGSTOP)  # Redis hangs: connections stay open
            status, took = await timed(client, "/blocks/1")
            assert status == 503 and took >= 1.5  # the first one finds out
            for path in ("/blocks/1", "/stats", "/readyz", "/engines"):
                status, took = await timed(client, path)
                assert (status, took < 0.5) == (503, True), (path, took)
            answer = await client.get("/blocks/1")
            assert "failing fast until the store answers" in answer.json()["error"]
            server.proc.send_signal(signal.SIGCONT)
            for _ in range(20):  # up again: no request is refused on old news
                assert (await client.get("/blocks/1")).status_code == 200
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await store.close()
        server.stop()
