"""The HTTP API against vLLM's own answers, its contract, auth and errors."""

from __future__ import annotations

import json

import pytest

from api import ApiSettings
from indexer.core.events import RankId
from indexer.core.matching import TierWeights
from indexer.engine_registry import RankStatus
from indexer.engines.vllm.hashing import HashSpec, block_hashes

from .api_cases import _tier_tokens, batch, cpu_chunk, gpu, trace_api
from .apikit import Api, csv, engine
from .conftest import FIXTURES, TRACE_NAMES

HASH_CASES = json.loads((FIXTURES / "hash_vectors.json").read_text())


@pytest.fixture
async def api():
    api = Api()
    yield api
    await api.close()


# --- vLLM's own answers --------------------------------------------------------


@pytest.mark.parametrize("name", TRACE_NAMES)
async def test_every_probe_answers_like_vllm_by_tokens_and_by_hashes(name: str) -> None:
    api, expected = await trace_api(name)
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
    await api.add(engine("a", blocks_per_chunk=2))  # 2 blocks from the CPU: a whole chunk
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
