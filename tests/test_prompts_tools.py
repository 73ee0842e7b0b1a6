"""Agentic requests as vLLM 0.33.0 renders them: chat ``tools``, ``tool_choice``,
``documents``, reasoning effort and tool-call history, and Responses bodies.

The golden cases (``tests/fixtures/tools/cases.json``) were rendered by
vLLM's own OpenAI front end (``tests/vllm_tier/tool_cases.py``, in the vLLM
tier) for two template families that show tools differently (Llama 3.1's
JSON in the first user turn, Hermes' ``<tools>`` block in the system
turn), each under four servers' tool flags. Every case goes through the
API's own parse of a ``/prefix-match`` body and must give vLLM's token ids
and block hashes, or a 400 where vLLM answers 400; over HTTP, every case
matches in full the blocks vLLM published for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import msgspec
import pytest

from api import ApiSettings, create_app
from api.errors import ApiError
from api.prefix import to_query
from api.schemas import PrefixMatchBody
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engines.base import Prompt
from indexer.prompts import ModelTokenizer, Tokenizers
from indexer.registry import EngineRegistry
from indexer.stores import MemoryStore

from .apikit import FakeConsumers, engine
from .prompts_kit import VLLM

HERE = Path(__file__).resolve().parent / "fixtures" / "tools"
GOLDEN = json.loads((HERE / "cases.json").read_text())
ROOT = Path(__file__).resolve().parents[2]
BLOCK = GOLDEN["block_size"]
CASES = GOLDEN["cases"]
ACCEPTED = [c for c in CASES if "expected_error" not in c]
REFUSED = [c for c in CASES if "expected_error" in c]


def _model(case: dict) -> str:
    return f"{case['model']}.{case['server']}"


def _models() -> dict[str, ModelTokenizer]:
    """One configured model per template and server flags, as an operator writes them."""
    models = {}
    for name, spec in GOLDEN["models"].items():
        for server, flags in GOLDEN["servers"].items():
            flags = {k: spec["tool_call_parser"] if v == "PARSER" else v for k, v in flags.items()}
            models[f"{name}.{server}"] = ModelTokenizer(
                str(ROOT / spec["tokenizer"]),
                chat_template=str(HERE / spec["chat_template"]),
                **flags,
            )
    return models


MODELS = _models()
POOL = Tokenizers(MODELS)
SETTINGS = ApiSettings(models=MODELS)


def _id(case: dict) -> str:
    return f"{case['model']}-{case['name']}"


async def _tokens(case: dict) -> list[int]:
    body = msgspec.json.encode({"model": _model(case), **case["request"]})
    query = await to_query(msgspec.json.decode(body, type=PrefixMatchBody), SETTINGS, POOL)
    assert query.prompt is not None
    return list(query.prompt.tokens)


def test_the_golden_tool_cases_are_all_here() -> None:
    assert GOLDEN["vllm_version"] == "0.33.0" and GOLDEN["hash_algo"] == "sha256"
    assert set(GOLDEN["models"]) == {"llama3-json", "hermes"}
    assert {(c["model"], c["kind"]) for c in ACCEPTED} == {
        (m, k) for m in GOLDEN["models"] for k in ("chat", "responses")
    }
    assert len(ACCEPTED) >= 60 and len(REFUSED) >= 10


@pytest.mark.parametrize("case", ACCEPTED, ids=_id)
async def test_each_case_gives_vllms_token_ids_and_block_hashes(case: dict) -> None:
    tokens = await _tokens(case)
    assert tokens == case["token_ids"]
    hasher = VLLM.hasher("sha256", None, BLOCK)
    digests = hasher.digests(Prompt(tuple(tokens)))
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    assert hasher.published(digests) == case["block_hashes_u64"]


@pytest.mark.parametrize("case", REFUSED, ids=_id)
async def test_each_request_vllm_refuses_is_a_400_naming_the_field(case: dict) -> None:
    with pytest.raises(ApiError) as refused:
        await _tokens(case)
    assert refused.value.status == case["expected_error"]["status"] == 400
    field, _, said = refused.value.message.partition(": ")
    vllm_said = case["expected_error"]["message"]
    named = re.search(r"\(parameter=([\w.]+)\)", vllm_said)
    if named is not None:  # the field vLLM names, or an item of it
        assert re.sub(r"\[\d+\]", "", field).startswith(named[1]), refused.value.message
    else:  # vLLM's refusals of a tool choice its server's flags do not serve
        assert field == "tool_choice" and "--tool-call-parser" in vllm_said
        assert "--tool-call-parser" in said and "tool_call_parser" in said


async def test_every_case_matches_in_full_the_blocks_vllm_published_for_it() -> None:
    """Each model's cases published on one engine serving it; each body then finds
    all of its blocks there, through ``POST /prefix-match``."""
    store, registry = MemoryStore(), EngineRegistry()
    consumers = FakeConsumers(store)
    app = create_app(store, registry, consumers, SETTINGS, tokenizers=POOL)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvindex")
    for name in MODELS:
        await registry.add(engine(name, model=name, hash_algo="sha256"))
    for seq, case in enumerate(ACCEPTED, 1):
        name = _model(case)
        full = len(case["block_hashes_u64"]) * BLOCK
        stored = BlockStored(
            case["block_hashes_u64"],
            None,
            case["token_ids"][:full],
            BLOCK,
            extra_keys=[None] * len(case["block_hashes_u64"]),
        )
        await consumers.apply(RankId(name, 0), seq, EventBatch(1.0, [stored], 0))
    async with client:
        for case in ACCEPTED:
            answer = await client.post(
                "/prefix-match", json={"model": _model(case), **case["request"]}
            )
            assert answer.status_code == 200, (case["name"], answer.text)
            held = {e["engine"]: e["prefix_blocks"] for e in answer.json()["engines"]}
            assert held == {_model(case): len(case["block_hashes_u64"])}, case["name"]
