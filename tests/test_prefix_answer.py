"""GET /prefix-match as parsed in one pass, and answer rows of ranks that match nothing.

The GET route reads its query parameters into one struct (not FastAPI's
parameter-by-parameter parse), and the rows of ranks the store does not
answer are encoded once and reused: both must answer exactly as every row
built afresh would, through every change of the state those rows show.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineSpec, RankStatus

from .apikit import Api, csv, engine

GET_PARAMETERS = {
    "block_hashes",
    "tokens",
    "model",
    "engines",
    "lora_name",
    "lora_path",
    "cache_salt",
    "block_size",
    "hash_algo",
    "hash_seed",
    "weights",
    "route",
    "ttl_ms",
}


def row(engine: str, dp_rank: int, model: str = "m", block_size: int = 16, **fields) -> dict:
    """An answer entry: zeros unless ``fields`` say otherwise (gpu_blocks also sets the
    prefix, score and routed run it implies on GPU alone)."""
    gpu = fields.pop("gpu_blocks", 0)
    entry = {
        "engine": engine,
        "dp_rank": dp_rank,
        "model": model,
        "block_size": block_size,
        "gpu_blocks": gpu,
        "cpu_blocks": 0,
        "storage_blocks": 0,
        "prefix_blocks": gpu,
        "prefix_tokens": gpu * block_size,
        "score": float(gpu),
        "degraded": False,
        "gpu_blocks_full_attention": gpu,
        "routed_blocks": gpu,
        "approximate": False,
    }
    return entry | fields


@pytest.fixture
async def fleet() -> AsyncIterator[Api]:
    """``a`` (2 ranks, rank 1 holding block 5), ``b`` without events, ``c``."""
    api = Api()
    await api.add(engine("a", model="m", dp_ranks=2))
    await api.add(EngineSpec(name="b", model="m", events=False, gpu_blocks=64, block_size=16))
    await api.add(engine("c", model="m"))
    gpu = BlockStored(block_hashes=[5], parent_block_hash=None, medium="GPU")
    await api.consumers.apply(RankId("a", 1), 0, EventBatch(1.0, [gpu], 0))
    yield api
    await api.close()


async def _rows(api: Api, **params) -> list[dict]:
    answer = await api.client.get("/prefix-match", params={"block_hashes": "5"} | params)
    assert answer.status_code == 200, answer.text
    return answer.json()["engines"]


async def test_rows_of_ranks_matching_nothing_follow_every_change(fleet: Api) -> None:
    # Rank a/0 has no status (not connected: degraded); b publishes no events.
    fleet.consumers.statuses["a"] = [RankStatus(dp_rank=1, connected=True)]
    assert await _rows(fleet) == [
        row("a", 1, gpu_blocks=1),
        row("a", 0, degraded=True),
        row("b", 0, approximate=True),
        row("c", 0),
    ]
    fleet.consumers.statuses["a"] = [
        RankStatus(dp_rank=0, connected=True),
        RankStatus(dp_rank=1, connected=True, degraded=True),
    ]
    fleet.consumers.statuses["c"] = [RankStatus(dp_rank=0, connected=False)]
    assert await _rows(fleet, block_size="8") == [
        row("a", 1, block_size=8, gpu_blocks=1, degraded=True),
        row("a", 0, block_size=8),
        row("b", 0, block_size=8, approximate=True),
        row("c", 0, block_size=8, degraded=True),
    ]
    await fleet.registry.remove("c")
    await fleet.add(engine("c", model="m2", block_size=32))
    assert (await _rows(fleet))[-1] == row("c", 0, model="m2", block_size=32, degraded=True)


async def test_a_rank_whose_store_lost_data_matches_nothing_and_others_are_answered(
    fleet: Api,
) -> None:
    fleet.consumers.statuses["a"] = [
        RankStatus(dp_rank=0, connected=True),
        RankStatus(dp_rank=1, connected=True, degraded=True, store_loss="flushed"),
    ]
    gpu = BlockStored(block_hashes=[5], parent_block_hash=None, medium="GPU")
    await fleet.consumers.apply(RankId("a", 3), 0, EventBatch(1.0, [gpu], 0))  # not declared
    assert await _rows(fleet) == [
        row("a", 3, gpu_blocks=1, degraded=True),  # no status: not connected
        row("a", 0),
        row("a", 1, degraded=True),  # holds block 5, but may hold older state
        row("b", 0, approximate=True),
        row("c", 0),
    ]


async def test_get_and_post_answer_alike(fleet: Api) -> None:
    for params in ({}, {"engines": "c,a"}, {"block_size": "4", "model": "m"}):
        got = await fleet.client.get("/prefix-match", params={"block_hashes": "5,6"} | params)
        body = {"block_hashes": [5, 6]} | {
            k: v.split(",") if k == "engines" else int(v) if k == "block_size" else v
            for k, v in params.items()
        }
        posted = await fleet.client.post("/prefix-match", json=body)
        assert got.status_code == posted.status_code == 200
        assert got.content == posted.content


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("block_size=1e3", "block_size"),  # msgspec alone would take these three
        ("block_size=null", "block_size"),
        ("block_size=16.0", "block_size"),
        ("block_size=%2016", "block_size"),
        ("block_size=", "block_size"),
        ("block_size=0", "block_size"),
        ("ttl_ms=1.5", "ttl_ms"),
        ("route=null", "route"),
        ("route=worst", "route"),
        ("hash_algo=md5", "hash_algo"),
    ],
)
async def test_a_malformed_query_parameter_is_a_422_naming_it(
    fleet: Api, query: str, named: str
) -> None:
    answer = await fleet.client.get(f"/prefix-match?tokens=1&{query}")
    assert answer.status_code == 422, answer.text
    assert set(answer.json()) == {"error"}
    assert f"$.{named}" in answer.json()["error"]


async def test_a_repeated_parameter_is_a_422_naming_it(fleet: Api) -> None:
    answer = await fleet.client.get("/prefix-match?block_hashes=5&block_size=8&block_size=4")
    assert answer.status_code == 422
    assert answer.json()["error"] == "query parameter 'block_size' is given more than once"


async def test_a_prompt_over_the_limit_is_a_413_whatever_its_items() -> None:
    api = Api(ApiSettings(max_prompt_tokens=4, max_prompt_blocks=4))
    for query, says in (("tokens=1,2,3,x,5", "5 tokens"), ("block_hashes=1,2,3,4,x", "5 blocks")):
        answer = await api.client.get(f"/prefix-match?{query}")
        assert (answer.status_code, says in answer.json()["error"]) == (413, True), query
    await api.close()


@pytest.mark.parametrize("bad", ["18446744073709551616", "9" * 30])
async def test_a_decimal_hash_beyond_uint64_is_named(fleet: Api, bad: str) -> None:
    answer = await fleet.client.get(f"/prefix-match?block_hashes={csv([1, bad])}")
    assert answer.status_code == 422
    assert answer.json()["error"].startswith("block_hashes[1] is ")


async def test_the_schema_lists_every_parameter_the_route_takes(fleet: Api) -> None:
    operation = fleet.app.openapi()["paths"]["/prefix-match"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert set(parameters) == GET_PARAMETERS
    assert all(p["in"] == "query" and not p["required"] for p in parameters.values())
    block_size = parameters["block_size"]["schema"]["anyOf"][0]
    assert (block_size["minimum"], block_size["maximum"]) == (1, 1 << 16)
    assert parameters["tokens"]["schema"]["pattern"].startswith("^([0-9]{1,19}")
    for name in GET_PARAMETERS:  # each is taken: refused, if at all, for its value
        answer = await fleet.client.get(f"/prefix-match?block_hashes=5&{name}=1")
        assert "unknown query parameter" not in answer.text, name
