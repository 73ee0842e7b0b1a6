"""What the token guards beyond the registry: routed entries, and the engines' seeds.

A routed entry steers every router's answer for its TTL, so recording one
(``POST /routed``, ``route: "best"``) needs the token as registering an engine
does. A ``hash_seed`` is set only with the token and is shown only to a caller
who presents it, on every path an answer, a page or a log takes. Each test runs
the app on a real port through uvicorn, as ``kvindex serve`` does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from api import ApiSettings
from indexer.cluster.redis_registry import RedisRegistry
from indexer.engine_registry import EngineRegistry
from indexer.stores import MemoryStore
from indexer.stores.redis import RedisStore
from kvindex.wiring import api_app

from .apikit import FakeConsumers, served
from .conftest import redis_config

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SEED = "s33d-that-must-not-leak"
ENGINE = {
    "name": "a",
    "endpoint": "tcp://127.0.0.1:1",
    "block_size": 16,
    "hash_algo": "xxhash",
    "hash_seed": SEED,
}
ROUTED = {"engine": "a", "block_hashes": list(range(1, 25))}


@contextlib.asynccontextmanager
async def api(token: str | None = TOKEN) -> AsyncIterator[httpx.AsyncClient]:
    """A served app over a memory store, with ``token`` (or none) configured."""
    store, settings = MemoryStore(), ApiSettings(auth_token=token)
    app = api_app(store, EngineRegistry(), FakeConsumers(store), settings)
    async with served(app, settings) as client:
        yield client


async def routed_blocks(client: httpx.AsyncClient) -> int:
    answer = await client.post("/prefix-match", json={"block_hashes": ROUTED["block_hashes"]})
    (row,) = answer.json()["engines"]
    assert row["gpu_blocks"] == 0
    return row["routed_blocks"]


# --- routed entries --------------------------------------------------------------


async def test_recording_a_routed_entry_needs_the_token() -> None:
    async with api() as client:
        assert (await client.post("/engines", json=ENGINE, headers=AUTH)).status_code == 201
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = await client.post("/routed", json=ROUTED, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.headers["WWW-Authenticate"] == "Bearer"
            assert "bearer token" in refused.json()["error"]
        assert await routed_blocks(client) == 0  # nothing steered
        recorded = await client.post("/routed", json=ROUTED, headers=AUTH)
        assert recorded.status_code == 200, recorded.text
        assert await routed_blocks(client) == 24


async def test_route_best_needs_the_token_and_plain_queries_do_not() -> None:
    query = {"block_hashes": ROUTED["block_hashes"]}
    async with api() as client:
        assert (await client.post("/engines", json=ENGINE, headers=AUTH)).status_code == 201
        by_post = await client.post("/prefix-match", json=query | {"route": "best"})
        by_get = await client.get("/prefix-match", params={"block_hashes": "1,2", "route": "best"})
        assert (by_post.status_code, by_get.status_code) == (401, 401)
        assert await routed_blocks(client) == 0
        assert (await client.get("/prefix-match", params={"block_hashes": "1"})).status_code == 200
        routed = await client.post("/prefix-match", json=query | {"route": "best"}, headers=AUTH)
        assert routed.json()["routed_to"] == {"engine": "a", "dp_rank": 0}


async def test_the_schema_declares_which_calls_take_the_token() -> None:
    async with api() as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    required, optional = [{"HTTPBearer": []}], [{}, {"HTTPBearer": []}]
    assert paths["/routed"]["post"]["security"] == required
    assert "401" in paths["/routed"]["post"]["responses"]
    for method in ("get", "post"):
        assert paths["/prefix-match"][method]["security"] == optional
    assert paths["/engines"]["get"]["security"] == optional
    assert paths["/engines/{name}"]["get"]["security"] == optional
    assert "security" not in paths["/stats"]["get"]


async def test_a_routed_entry_lives_ten_minutes_at_most_by_default() -> None:
    async with api() as client:
        await client.post("/engines", json=ENGINE, headers=AUTH)
        hour = await client.post("/routed", json=ROUTED | {"ttl_ms": 3_600_000}, headers=AUTH)
        assert hour.status_code == 422 and "10..600000" in hour.json()["error"]
        ten = await client.post("/routed", json=ROUTED | {"ttl_ms": 600_000}, headers=AUTH)
        assert ten.json()["ttl_ms"] == 600_000


# --- the hash seed ---------------------------------------------------------------


async def test_the_seed_is_shown_only_to_a_caller_with_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with api() as client:
        created = await client.post("/engines", json=ENGINE, headers=AUTH)
        assert created.json()["hash_seed"] == SEED and created.json()["hash_seed_set"]
        for path in ("/engines", "/engines/a"):
            anyone, owner = (await client.get(path)).json(), (await client.get(path, headers=AUTH))
            one = anyone[0] if path == "/engines" else anyone
            assert (one["hash_seed"], one["hash_seed_set"]) == (None, True)
            mine = owner.json()[0] if path == "/engines" else owner.json()
            assert mine["hash_seed"] == SEED
        wrong = await client.get("/engines/a", headers={"Authorization": "Bearer nope"})
        assert wrong.json()["hash_seed"] is None
        elsewhere = [
            await client.get(path)
            for path in ("/stats", "/metrics", "/readyz", "/ui/", "/ui/app.js", "/openapi.json")
        ]
        elsewhere.append(await client.post("/engines", json=ENGINE, headers=AUTH))  # a 409
        assert all(SEED not in answer.text for answer in elsewhere)
        removed = await client.delete("/engines/a", headers=AUTH)
        assert removed.json()["hash_seed"] == SEED
    assert SEED not in caplog.text


async def test_without_a_token_nobody_reads_a_seed_back() -> None:
    """An open server (loopback, or --insecure-no-auth) takes a seed but never shows it:
    nobody has proven who they are, not even by removing the engine."""
    async with api(token=None) as client:
        created = await client.post("/engines", json=ENGINE)
        assert (created.json()["hash_seed"], created.json()["hash_seed_set"]) == (None, True)
        assert (await client.get("/engines/a")).json()["hash_seed"] is None
        assert (await client.delete("/engines/a")).json()["hash_seed"] is None


async def test_an_api_replica_over_redis_hides_the_seed_too(redis_server) -> None:
    """The seed is in the shared registry (replicas hash tokens with it); what any
    replica answers from it is redacted alike."""
    config, settings = redis_config(redis_server.url), ApiSettings(auth_token=TOKEN)
    stores = [RedisStore(config), RedisStore(config)]
    registries = [RedisRegistry(store.client) for store in stores]
    apps = [
        api_app(store, registry, FakeConsumers(store), settings)
        for store, registry in zip(stores, registries, strict=True)
    ]
    try:
        async with served(apps[0], settings) as first, served(apps[1], settings) as second:
            assert (await first.post("/engines", json=ENGINE, headers=AUTH)).status_code == 201
            await registries[1].refresh()
            assert registries[1].get("a").hash_seed == SEED
            assert (await second.get("/engines/a")).json()["hash_seed"] is None
            assert (await second.get("/engines/a", headers=AUTH)).json()["hash_seed"] == SEED
    finally:
        for store in stores:
            await store.close()
