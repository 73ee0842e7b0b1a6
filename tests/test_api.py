"""The HTTP API against vLLM's own answers, its contract, auth and errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httpx
import pytest
import uvicorn

from api import ApiSettings, create_app
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.core.matching import TierWeights
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.ingest.trace import load_trace
from indexer.registry import EngineRegistry, RankStatus
from indexer.stores import MemoryStore, StoreUnavailable

from .apikit import Api, FakeConsumers, LiveApi, csv, engine
from .conftest import (
    FIXTURES,
    TRACE_NAMES,
    free_ports,
    load_expected_json,
    trace_batches,
    trace_path,
)

HASH_CASES = json.loads((FIXTURES / "hash_vectors.json").read_text())


def batch(*events) -> EventBatch:
    return EventBatch(1.0, list(events), 0)


def gpu(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, medium="GPU")


def cpu_chunk(hashes) -> BlockStored:
    """A self-describing CPU chunk (token ids elided: the store only needs the hashes)."""
    return BlockStored(
        block_hashes=list(hashes), token_ids=[0] * 16 * len(hashes), block_size=16, medium="CPU"
    )


@pytest.fixture
async def api():
    api = Api()
    yield api
    await api.close()


# --- vLLM's own answers --------------------------------------------------------


async def _trace_api(name: str) -> tuple[Api, dict]:
    expected = load_expected_json(name)
    cfg = expected["engine"]
    api = Api()
    await api.add(
        engine(
            "vllm-a",
            model="m",
            block_size=cfg["block_size"],
            blocks_per_chunk=cfg["blocks_per_chunk"],
        )
    )
    await api.consumers.apply_trace(RankId("vllm-a", 0), load_trace(trace_path(name)))
    return api, expected


def _tier_tokens(answer: dict) -> dict[str, int]:
    (entry,) = answer["engines"]
    size = answer["block_size"]
    return {
        "gpu_tokens": entry["gpu_blocks"] * size,
        "cpu_prefix_tokens": entry["cpu_blocks"] * size,
    }


@pytest.mark.parametrize("name", TRACE_NAMES)
async def test_every_probe_answers_like_vllm_by_tokens_and_by_hashes(name: str) -> None:
    api, expected = await _trace_api(name)
    for probe in expected["probes"]:
        want = {k: probe[k] for k in ("gpu_tokens", "cpu_prefix_tokens")}
        answers = [
            await api.client.get("/prefix-match", params={"tokens": csv(probe["tokens"])}),
            await api.client.get("/prefix-match", params={"block_hashes": csv(probe["hashes"])}),
            await api.client.post("/prefix-match", json={"tokens": probe["tokens"]}),
            await api.client.post("/prefix-match", json={"block_hashes": probe["hashes"]}),
        ]
        assert [r.status_code for r in answers] == [200] * 4
        assert all(_tier_tokens(r.json()) == want for r in answers), probe
        by_tokens, by_hashes = answers[0].json(), answers[1].json()
        assert answers[2].json() == by_tokens  # GET and POST agree
        assert answers[3].json() == by_hashes
        assert by_tokens["engines"] == by_hashes["engines"]
    await api.close()


# --- hashing: every golden vector, each engine with its own spec ---------------


def _case_id(case: dict) -> str:
    return f"{case['algo']}-{case['PYTHONHASHSEED']}-{case['block_size']}-{case['case']}"


@pytest.mark.parametrize("case", HASH_CASES, ids=_case_id)
async def test_tokens_are_hashed_exactly_as_vllm_did(api: Api, case: dict) -> None:
    """Int- and bytes-publishing engines both match every hash vector by tokens."""
    spec = {
        "block_size": case["block_size"],
        "hash_algo": case["algo"],
        "hash_seed": case["PYTHONHASHSEED"],
    }
    ints = case["block_hashes_int64"]
    digests = [bytes.fromhex(h) for h in case["block_hashes_hex"]]
    for name, hashes in (("ints", ints), ("bytes", digests)):
        await api.add(engine(name, **spec))
        await api.consumers.apply(RankId(name, 0), 0, batch(gpu(hashes)))
    body = {
        "tokens": case["tokens"],
        "lora_name": case["lora_name"],
        "lora_path": case["lora_path"],
        "cache_salt": case["cache_salt"],
        "mm_features": case["mm"],
    }
    answer = (await api.client.post("/prefix-match", json=body)).json()
    assert {e["engine"]: e["gpu_blocks"] for e in answer["engines"]} == {
        "ints": len(ints),
        "bytes": len(digests),
    }
    if not case["mm"]:  # GET has no multimodal items
        params = {k: v for k, v in body.items() if v and k != "mm_features"}
        params["tokens"] = csv(case["tokens"])
        assert (await api.client.get("/prefix-match", params=params)).json() == answer


SPECS = [
    ("sha256", None),
    ("sha256", "0"),
    ("sha256_cbor", None),
    ("sha256_cbor", "0"),
    ("xxhash", "0"),
    ("xxhash", "12345"),
    ("xxhash_cbor", "0"),
    ("xxhash_cbor", "12345"),
]


async def test_engines_with_different_algorithms_are_each_matched_with_their_own(
    api: Api,
) -> None:
    tokens = list(range(1000, 1000 + 16 * 9))
    for i, (algo, seed) in enumerate(SPECS):
        name = f"e{i}"
        await api.add(engine(name, hash_algo=algo, hash_seed=seed))
        chain = block_hashes(HashSpec(algo, seed, 16), tokens)
        await api.consumers.apply(RankId(name, 0), 0, batch(gpu(chain[: i + 1])))
    answer = (await api.client.get("/prefix-match", params={"tokens": csv(tokens)})).json()
    assert {e["engine"]: e["gpu_blocks"] for e in answer["engines"]} == {
        f"e{i}": i + 1 for i in range(len(SPECS))
    }


async def test_query_overrides_replace_the_declared_hashing(api: Api) -> None:
    tokens = list(range(64))
    await api.add(engine("a", hash_algo="sha256"))
    chain = block_hashes(HashSpec("xxhash", "7", 8), tokens)
    await api.consumers.apply(RankId("a", 0), 0, batch(gpu(chain)))
    params = {"tokens": csv(tokens)}
    assert (await api.client.get("/prefix-match", params=params)).json()["engines"][0][
        "gpu_blocks"
    ] == 0
    params |= {"block_size": 8, "hash_algo": "xxhash", "hash_seed": "7"}
    answer = (await api.client.get("/prefix-match", params=params)).json()
    assert answer["block_size"] == 8
    assert answer["num_blocks"] == 8
    assert answer["engines"][0]["prefix_tokens"] == 64


# --- the answer's shape: tiers, score, order, filters, degraded ----------------


async def test_answer_reports_tiers_score_and_sorts_best_first(api: Api) -> None:
    chain = list(range(1, 38))
    await api.add(engine("vllm-a", model="m", blocks_per_chunk=4))
    await api.add(engine("vllm-b", model="m", blocks_per_chunk=4))
    await api.add(engine("vllm-c", model="other"))
    chunks = [cpu_chunk(chain[j : j + 4]) for j in range(0, 24, 4)]
    await api.consumers.apply(RankId("vllm-a", 0), 0, batch(gpu(chain[:12]), *chunks))
    await api.consumers.apply(RankId("vllm-b", 0), 0, batch(gpu(chain[:30])))
    answer = (await api.client.get("/prefix-match", params={"block_hashes": csv(chain)})).json()
    assert answer["block_size"] == 16
    assert answer["num_blocks"] == 37
    assert answer["engines"][1] == {
        "engine": "vllm-a",
        "dp_rank": 0,
        "model": "m",
        "block_size": 16,
        "gpu_blocks": 12,
        "cpu_blocks": 24,
        "storage_blocks": 0,
        "prefix_blocks": 24,
        "prefix_tokens": 384,
        "score": 21.6,
        "degraded": False,
        "gpu_blocks_full_attention": 12,
        "routed_blocks": 12,  # nothing routed: the exact GPU run
        "approximate": False,
    }
    assert [(e["engine"], e["score"]) for e in answer["engines"]] == [
        ("vllm-b", 30.0),
        ("vllm-a", 21.6),
        ("vllm-c", 0.0),
    ]
    only_m = {"block_hashes": csv(chain), "model": "m", "engines": "vllm-c,vllm-a"}
    answer = (await api.client.get("/prefix-match", params=only_m)).json()
    assert [e["engine"] for e in answer["engines"]] == ["vllm-a"]


async def test_tier_weights_are_configurable() -> None:
    api = Api(ApiSettings(weights=TierWeights(gpu=2.0, cpu=0.25, storage=0.0)))
    await api.add(engine("a", blocks_per_chunk=4))
    await api.consumers.apply(RankId("a", 0), 0, batch(gpu([1, 2]), cpu_chunk([1, 2, 3, 4])))
    answer = (await api.client.get("/prefix-match", params={"block_hashes": "1,2,3,4"})).json()
    assert answer["engines"][0]["score"] == 2 * 2.0 + 2 * 0.25
    await api.close()


async def test_every_rank_appears_and_degraded_follows_the_consumer(api: Api) -> None:
    await api.add(engine("a", dp_ranks=3))
    api.consumers.statuses["a"] = [
        RankStatus(dp_rank=0, connected=True),
        RankStatus(dp_rank=1, connected=True, degraded=True),
    ]  # rank 2: no status at all
    await api.consumers.apply(RankId("a", 2), 0, batch(gpu([5])))
    answer = (await api.client.get("/prefix-match", params={"block_hashes": "5"})).json()
    assert [(e["dp_rank"], e["gpu_blocks"], e["degraded"]) for e in answer["engines"]] == [
        (2, 1, True),
        (0, 0, False),
        (1, 0, True),
    ]


async def test_bytes_hashes_are_queried_in_hex(api: Api) -> None:
    digests = [bytes([i]) * 32 for i in range(3)]
    await api.add(engine("a"))
    await api.consumers.apply(RankId("a", 0), 0, batch(gpu(digests[:2])))
    hexes = ["0x" + d.hex() for d in digests]
    answer = (await api.client.get("/prefix-match", params={"block_hashes": csv(hexes)})).json()
    assert answer["engines"][0]["gpu_blocks"] == 2
    block = (await api.client.get(f"/blocks/{hexes[0]}")).json()
    assert block["hash"] == hexes[0]
    assert block["residency"] == [
        {
            "engine": "a",
            "dp_rank": 0,
            "medium": "GPU",
            "ownership": None,
            "group_idx": 0,
            "locality": None,
            "count": 1,
        }
    ]


async def test_no_engines_answers_an_empty_list(api: Api) -> None:
    answer = (await api.client.post("/prefix-match", json={"tokens": list(range(40))})).json()
    empty = {"block_size": None, "num_blocks": None, "engines": [], "routed_to": None}
    assert answer == {**empty, "route_costs": None}


# --- operator REST ---------------------------------------------------------------

ENGINE_BODY = {
    "name": "vllm-a",
    "model": "m",
    "endpoint": "tcp://10.0.0.1:5557",
    "replay_endpoint": "tcp://10.0.0.1:5558",
    "dp_ranks": 2,
    "topic": "",
    "block_size": 16,
    "hash_algo": "sha256",
    "hash_seed": None,
    "blocks_per_chunk": None,
}


async def test_engines_are_registered_inspected_and_removed(api: Api) -> None:
    created = await api.client.post("/engines", json=ENGINE_BODY)
    assert created.status_code == 201
    defaults = {"bind": False, "kv_groups": None, "adapter": "vllm", "events": True}
    defaults |= {"reuse_reports": "capped", "lookahead_tokens": 0, "url": None}
    defaults |= {"snapshot_endpoint": None}
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


# --- a real server ---------------------------------------------------------------


@contextlib.contextmanager
def _listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


async def test_a_real_uvicorn_server_answers_long_get_prompts() -> None:
    """Over real HTTP: 8k-token GET query strings must fit (h11's line limit is raised)."""
    store, registry = MemoryStore(), EngineRegistry()
    consumers = FakeConsumers(store)
    app = create_app(store, registry, consumers, ApiSettings())
    await registry.add(engine("a"))
    tokens = list(range(100_000, 108_192))
    chain = block_hashes(HashSpec("sha256", None, 16), tokens)
    await consumers.apply(RankId("a", 0), 0, batch(gpu(chain[:100])))
    port = free_ports()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", h11_max_incomplete_event_size=1 << 20
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            got = await client.get(f"/prefix-match?tokens={csv(tokens)}")  # commas unescaped
            assert got.status_code == 200, got.text
            assert got.json()["engines"][0]["gpu_blocks"] == 100
            posted = await client.post("/prefix-match", json={"block_hashes": chain})
            assert posted.json()["engines"][0]["gpu_blocks"] == 100
    finally:
        server.should_exit = True
        await task


# --- through the real subscriber -------------------------------------------------


@pytest.mark.parametrize("name", TRACE_NAMES)
async def test_traces_fed_through_the_subscriber_answer_like_vllm(name: str) -> None:
    """Publisher -> ZMQ -> subscriber -> store and token index -> HTTP, by tokens and hashes."""
    expected = load_expected_json(name)
    cfg = expected["engine"]
    batches = trace_batches(name)
    last = len(batches) - 1  # the publisher numbers them 0.., as the trace does
    async with LiveApi() as live:
        (publisher,) = await live.add_published(
            "vllm-a", block_size=cfg["block_size"], blocks_per_chunk=cfg["blocks_per_chunk"]
        )
        assert all(publisher.publish(batch) for batch in batches)
        await live.wait_applied("vllm-a", [last])
        for probe in expected["probes"]:
            want = {k: probe[k] for k in ("gpu_tokens", "cpu_prefix_tokens")}
            for params in (
                {"tokens": csv(probe["tokens"])},
                {"block_hashes": csv(probe["hashes"])},
            ):
                answer = (await live.client.get("/prefix-match", params=params)).json()
                assert _tier_tokens(answer) == want, probe
                assert not answer["engines"][0]["degraded"]
        state = (await live.client.get("/engines/vllm-a")).json()
        assert state["ranks"][0]["applied_seq"] == last
        assert state["ranks"][0]["blocks"] == {
            "GPU": len(expected["expected"]["gpu_refcounts"]),
            "CPU": len(expected["expected"]["cpu_refcounts"]),
            "STORAGE": 0,
        }
        assert (await live.client.get("/readyz")).status_code == 200
        assert (await live.client.delete("/engines/vllm-a")).status_code == 200
        assert await live.store.ranks() == []  # the subscriber forgot the engine


async def test_an_engine_the_subscriber_cannot_consume_is_refused() -> None:
    """The subscriber must bind this endpoint, but the port is taken."""
    with _listening() as port:
        async with LiveApi() as live:
            endpoint = f"tcp://127.0.0.1:{port}"
            body = ENGINE_BODY | {"endpoint": endpoint, "replay_endpoint": None, "bind": True}
            refused = await live.client.post("/engines", json=body)
            assert refused.status_code == 422
            assert "cannot consume engine 'vllm-a'" in refused.json()["error"]
            assert (await live.client.get("/engines")).json() == []
