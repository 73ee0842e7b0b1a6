"""The HTTP API's operator side and its refusals: registering and inspecting
engines, the bearer token, and the 4xx and 503 answers that must say what is
wrong, since operators and routers act on those words."""

from __future__ import annotations

import pytest

from api import ApiSettings
from indexer.core.events import RankId
from indexer.engine_registry import RankStatus
from indexer.stores import MemoryStore, StoreUnavailable

from .api_cases import ENGINE_BODY, batch, cpu_chunk, gpu
from .apikit import Api, csv, engine


@pytest.fixture
async def api():
    api = Api()
    yield api
    await api.close()


# --- operator REST ---------------------------------------------------------------


async def test_engines_are_registered_inspected_and_removed(api: Api) -> None:
    created = await api.client.post("/engines", json=ENGINE_BODY)
    assert created.status_code == 201
    defaults = {"bind": False, "kv_groups": None, "adapter": "vllm", "events": True}
    defaults |= {"reuse_reports": "capped", "lookahead_tokens": 0, "url": None}
    defaults |= {"snapshot_endpoint": None, "release": None}
    assert created.json() == ENGINE_BODY | defaults | {"gpu_blocks": None, "hash_seed_set": False}
    assert (await api.client.post("/engines", json=ENGINE_BODY)).status_code == 409
    assert [e["name"] for e in (await api.client.get("/engines")).json()] == ["vllm-a"]

    api.consumers.statuses["vllm-a"] = [RankStatus(dp_rank=0, connected=True, last_seq=7)]
    await api.consumers.apply(RankId("vllm-a", 0), 0, batch(gpu([1, 2, 2]), cpu_chunk([3])))
    state = (await api.client.get("/engines/vllm-a")).json()
    assert state["name"] == "vllm-a"
    ranks = {r["dp_rank"]: r for r in state["ranks"]}
    assert ranks[0]["blocks"] == {"GPU": 2, "CPU": 1, "STORAGE": 0}
    assert ranks[0]["last_seq"] == 7
    assert ranks[0]["connected"]
    assert ranks[1]["blocks"] == {"GPU": 0, "CPU": 0, "STORAGE": 0}
    assert not ranks[1]["connected"]
    for key in ("applied_seq", "degraded", "gaps", "replays", "restarts", "lag_batches"):
        assert key in ranks[0]

    stats = (await api.client.get("/stats")).json()
    assert stats["blocks"] == {"GPU": 2, "CPU": 1, "STORAGE": 0}
    assert stats["engines"] == 1

    removed = await api.client.delete("/engines/vllm-a")
    assert removed.status_code == 200
    assert removed.json()["name"] == "vllm-a"
    assert (await api.client.get("/engines/vllm-a")).status_code == 404
    assert (await api.client.delete("/engines/vllm-a")).status_code == 404


async def test_block_residency_lists_every_holder(api: Api) -> None:
    await api.consumers.apply(RankId("a", 0), 0, batch(gpu([9]), gpu([9])))
    await api.consumers.apply(RankId("b", 1), 0, batch(cpu_chunk([9])))
    block = (await api.client.get("/blocks/9")).json()
    assert block["hash"] == "9"
    assert sorted((r["engine"], r["medium"], r["count"]) for r in block["residency"]) == [
        ("a", "GPU", 2),
        ("b", "CPU", 1),
    ]


# --- auth --------------------------------------------------------------------------


async def test_mutating_endpoints_require_the_token_when_configured() -> None:
    api = Api(ApiSettings(auth_token="s3cret"))
    good = {"Authorization": "Bearer s3cret"}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
        refused = await api.client.post("/engines", json=ENGINE_BODY, headers=headers)
        assert refused.status_code == 401
        assert "bearer token" in refused.json()["error"]
        assert refused.headers["www-authenticate"] == "Bearer"
    assert (await api.client.post("/engines", json=ENGINE_BODY, headers=good)).status_code == 201
    assert (await api.client.delete("/engines/vllm-a")).status_code == 401
    assert (await api.client.get("/engines/vllm-a")).status_code == 200  # reads stay open
    assert (await api.client.get("/prefix-match", params={"tokens": "1"})).status_code == 200
    assert (await api.client.delete("/engines/vllm-a", headers=good)).status_code == 200
    schema = api.app.openapi()
    assert schema["paths"]["/engines"]["post"]["security"] == [{"HTTPBearer": []}]
    assert schema["paths"]["/engines"]["get"]["security"] == [{}, {"HTTPBearer": []}]  # optional
    await api.close()


# --- errors --------------------------------------------------------------------

LIMITS = ApiSettings(max_prompt_tokens=64, max_prompt_blocks=4, max_body_bytes=2048)
BAD_REQUESTS = [
    ("GET", "/prefix-match?tokens=1,2&block_hashes=3", None, 400, "exactly one"),
    ("GET", "/prefix-match", None, 400, "exactly one"),
    ("POST", "/prefix-match", {"tokens": [1], "block_hashes": [2]}, 400, "exactly one"),
    ("GET", "/prefix-match?tokens=1,x,3", None, 422, "tokens[1]"),
    ("GET", "/prefix-match?tokens=1,,3", None, 422, "tokens[1]"),
    ("GET", "/prefix-match?tokens=1.5", None, 422, "tokens[0]"),
    ("GET", "/prefix-match?tokens=-1", None, 422, "tokens[0]"),
    ("GET", "/prefix-match?tokens=9223372036854775808", None, 422, "out of range"),
    ("POST", "/prefix-match", {"tokens": [1, "2"]}, 422, "$.tokens[1]"),
    ("POST", "/prefix-match", {"tokens": [1.5]}, 422, "$.tokens[0]"),
    ("POST", "/prefix-match", {"tokens": [1], "extra": 1}, 422, "extra"),
    ("GET", "/prefix-match?block_hashes=18446744073709551616", None, 422, "out of range"),
    ("GET", "/prefix-match?block_hashes=0x1", None, 422, "block_hashes[0]"),
    ("GET", "/prefix-match?block_hashes=1,abc", None, 422, "block_hashes[1]"),
    ("POST", "/prefix-match", {"block_hashes": [2**64]}, 422, "out of range"),
    ("POST", "/prefix-match", {"block_hashes": [-1]}, 422, "$.block_hashes[0]"),
    ("GET", "/prefix-match?tokens=1&engines=nope", None, 404, "unknown engine 'nope'"),
    ("GET", "/prefix-match?tokens=1&block_size=0", None, 422, "block_size"),
    ("GET", "/prefix-match?tokens=1&hash_algo=md5", None, 422, "hash_algo"),
    ("POST", "/prefix-match", {"tokens": [1] * 16, "lora_name": "x"}, 422, "lora_path"),
    ("GET", f"/prefix-match?tokens={csv(range(65))}", None, 413, "65 tokens"),
    ("POST", "/prefix-match", {"tokens": list(range(65))}, 413, "65 tokens"),
    ("GET", "/prefix-match?block_hashes=1,2,3,4,5", None, 413, "5 blocks"),
    ("POST", "/prefix-match", {"tokens": [1] * 60, "cache_salt": "x" * 2000}, 413, "2048"),
    ("GET", "/engines/nope", None, 404, "unknown engine"),
    ("GET", "/blocks/12ab", None, 422, "decimal uint64"),
    ("POST", "/engines", {"name": "x"}, 422, "endpoint"),
    ("POST", "/engines", ENGINE_BODY | {"dp_ranks": 0}, 422, "dp_ranks"),
    ("POST", "/engines", ENGINE_BODY | {"hash_algo": "md5"}, 422, "hash_algo"),
    ("POST", "/engines", ENGINE_BODY | {"lookahead_tokens": -1}, 422, "lookahead_tokens"),
]


@pytest.mark.parametrize(("method", "url", "body", "status", "says"), BAD_REQUESTS)
async def test_bad_input_gets_a_4xx_that_says_what_is_wrong(method, url, body, status, says):
    api = Api(LIMITS)
    await api.add(engine("a"))
    response = await api.client.request(method, url, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert says in response.json()["error"]
    assert set(response.json()) == {"error"}
    await api.close()


async def test_bodies_that_are_not_json_or_stream_past_the_limit_are_refused() -> None:
    api = Api(LIMITS)
    bad = await api.client.post("/prefix-match", content=b"{nope")
    assert (bad.status_code, "not JSON" in bad.json()["error"]) == (400, True)

    async def chunks():
        for _ in range(5):
            yield b" " * 1000

    streamed = await api.client.post("/prefix-match", content=chunks())
    assert streamed.status_code == 413
    assert "over the maximum of 2048" in streamed.json()["error"]
    await api.close()


@pytest.mark.parametrize("path", ["/prefix-match", "/engines/announce"])
async def test_a_client_that_hangs_up_before_its_body_is_answered_not_raised(path) -> None:
    """A client's own timeout closes its connection while its body is on the way: the
    request ends with a 400 sent to no one, never an exception from the app."""
    api = Api(LIMITS)
    sent: list[dict] = []
    body = iter([{"type": "http.request", "body": b"{", "more_body": True}])

    async def receive() -> dict:
        return next(body, {"type": "http.disconnect"})

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b""}
    await api.app({**scope, "headers": headers, "asgi": {"version": "3.0"}}, receive, send)
    assert sent[0]["status"] == 400, sent
    await api.close()


class BrokenStore(MemoryStore):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def _fail(self, *args, **kwargs):
        raise self.error

    prefix_match = block_residency = ranks = ping = _fail


@pytest.mark.parametrize("error", [StoreUnavailable("redis down"), ConnectionError("reset")])
async def test_an_unreachable_store_is_a_503(error: Exception) -> None:
    api = Api(store=BrokenStore(error))
    await api.add(engine("a"))
    for url in (
        f"/prefix-match?tokens={csv(range(32))}",
        "/blocks/1",
        "/stats",
        "/readyz",
        "/engines/a",
    ):
        response = await api.client.get(url)
        assert response.status_code == 503, url
        assert response.json()["error"].startswith("store unreachable")
    await api.close()


async def test_readiness_needs_running_subscribers(api: Api) -> None:
    assert (await api.client.get("/readyz")).status_code == 200
    api.consumers.is_running = False
    response = await api.client.get("/readyz")
    assert response.status_code == 503
    assert "subscribers" in response.json()["error"]
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}


async def test_metrics_expose_query_latency(api: Api) -> None:
    await api.client.get("/prefix-match", params={"tokens": "1,2"})
    text = (await api.client.get("/metrics")).text
    assert 'kvindex_query_seconds_count{by="tokens"}' in text
    assert "kvindex_api_store_errors_total" in text
