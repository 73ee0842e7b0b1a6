"""Agentic requests as vLLM 0.33.0 renders them: chat ``tools``, ``tool_choice``,
``documents``, reasoning effort and tool-call history, and Responses bodies.

The golden cases (``tests/fixtures/tools/cases.json``) were rendered by
vLLM's own OpenAI front end (``tests/vllm_tier/tool_cases.py``, in the vLLM
tier) for three template families that show tools differently (Llama 3.1's
JSON in the first user turn, Hermes' ``<tools>`` block in the system turn,
Mistral's ``[AVAILABLE_TOOLS]`` before the last user turn, from content
parts; and Hermes' as a tokenizer's ``tool_use`` template beside its
``default`` one), each under four servers' tool flags. Every case goes through the
API's own parse of a ``/prefix-match`` body and must give vLLM's token ids
and block hashes, or a 400 where vLLM answers 400; over HTTP, every case
matches in full the blocks vLLM published for it.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import httpx
import msgspec
import pytest

from api import ApiSettings
from api.errors import ApiError
from api.prefix import to_query
from api.schemas import PrefixMatchBody
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry
from indexer.engines.base import Prompt
from indexer.engines.rendering import ResponsesRequest
from indexer.prompts import ModelTokenizer, Tokenizers
from indexer.stores import MemoryStore
from kvindex.client import AsyncKvindex
from kvindex.wiring import api_app

from .apikit import FakeConsumers, engine
from .prompts_kit import VLLM
from .test_client import serving
from .tool_fixtures import FIXTURES, TOKENIZERS, server_flags, tokenizer_dir

GOLDEN = json.loads((FIXTURES / "cases.json").read_text())
BLOCK = GOLDEN["block_size"]
CASES = GOLDEN["cases"]
ACCEPTED = [c for c in CASES if "expected_error" not in c]
REFUSED = [c for c in CASES if "expected_error" in c]


def _model(case: dict) -> str:
    return f"{case['model']}.{case['server']}"


def _models(scratch: Path) -> dict[str, ModelTokenizer]:
    """One configured model per template and server flags, as an operator writes them
    (the chat template as the file vLLM was given, or none: the tokenizer's own)."""
    models = {}
    for name, spec in GOLDEN["models"].items():
        tokenizer = str(tokenizer_dir(spec, scratch / name))
        path = spec.get("chat_template")
        template = None if path is None else str(FIXTURES / path)
        for server, flags in GOLDEN["servers"].items():
            models[f"{name}.{server}"] = ModelTokenizer(
                tokenizer, chat_template=template, **server_flags(spec, flags)
            )
    return models


_SCRATCH = tempfile.TemporaryDirectory(prefix="kvindex-tool-models-")  # removed at exit
MODELS = _models(Path(_SCRATCH.name))
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
    assert set(GOLDEN["models"]) == {"llama3-json", "hermes", "hermes-named", "mistral-style"}
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
    elif "--tool-call-parser" in vllm_said:  # a tool choice the server's flags do not serve
        assert field == "tool_choice"
        assert "--tool-call-parser" in said and "tool_call_parser" in said
    elif "validation error" in vllm_said:  # the request's shape: the item pydantic named
        item = re.search(r"^0\.\w+\.([\w.]+)$", vllm_said, flags=re.M)
        assert item is not None and field.endswith(item[1]), (field, vllm_said)
    else:  # the template's own refusal, which both render
        assert field in ("messages", "input") and vllm_said in said, (field, vllm_said)


def _stored(case: dict) -> BlockStored:
    """What vLLM publishes for the case's full blocks: their hashes and tokens."""
    hashes = case["block_hashes_u64"]
    tokens = case["token_ids"][: len(hashes) * BLOCK]
    return BlockStored(hashes, None, tokens, BLOCK, extra_keys=[None] * len(hashes))


async def test_every_case_matches_in_full_the_blocks_vllm_published_for_it() -> None:
    """Each model's cases published on one engine serving it; each body then finds
    all of its blocks there, through ``POST /prefix-match``."""
    store, registry = MemoryStore(), EngineRegistry()
    consumers = FakeConsumers(store)
    app = api_app(store, registry, consumers, SETTINGS, tokenizers=POOL)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvindex")
    for name in MODELS:
        await registry.add(engine(name, model=name, hash_algo="sha256"))
    for seq, case in enumerate(ACCEPTED, 1):
        name = _model(case)
        await consumers.apply(RankId(name, 0), seq, EventBatch(1.0, [_stored(case)], 0))
    async with client:
        for case in ACCEPTED:
            answer = await client.post(
                "/prefix-match", json={"model": _model(case), **case["request"]}
            )
            assert answer.status_code == 200, (case["name"], answer.text)
            held = {e["engine"]: e["prefix_blocks"] for e in answer.json()["engines"]}
            assert held == {_model(case): len(case["block_hashes_u64"])}, case["name"]


async def test_the_client_sends_a_chat_with_tools_and_a_responses_request() -> None:
    """A router's client, over a real socket: an agent's chat turn and a Responses
    turn, each as vLLM computed it, found in full on the engine holding them."""
    store, registry = MemoryStore(), EngineRegistry()
    consumers = FakeConsumers(store)
    app = api_app(store, registry, consumers, SETTINGS, tokenizers=POOL)
    chat, responses = (
        next(c for c in ACCEPTED if c["model"] == "hermes" and c["name"] == name)
        for name in ("tools_agent_turns", "resp_agent_items")
    )
    for seq, case in enumerate((chat, responses), 1):
        await registry.add(engine(case["name"], model=_model(case), hash_algo="sha256"))
        await consumers.apply(RankId(case["name"], 0), seq, EventBatch(1.0, [_stored(case)], 0))
    async with serving(app) as (url, _), AsyncKvindex(url) as kv:
        by_chat = await kv.prefix_match(model=_model(chat), **chat["request"])
        by_input = await kv.prefix_match(model=_model(responses), **responses["request"])
    assert [(e.engine, e.prefix_blocks) for e in by_chat.engines] == [
        (chat["name"], len(chat["block_hashes_u64"]))
    ]
    assert [(e.engine, e.prefix_blocks) for e in by_input.engines] == [
        (responses["name"], len(responses["block_hashes_u64"]))
    ]


HERMES = "hermes.auto"
ASK = [{"role": "user", "content": "hi"}]
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id: "),
        ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools[0].type: "),
        ({"input": "hi", "tools": [FUNCTION, {"type": "custom", "name": "g"}]}, 400, "tools[1]"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, 400, "input[0].type: "),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}]},
            422,
            "input[0].arguments: must be a string",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input_image"),
        ({"messages": ASK, "input": "hi"}, 400, "got messages and input"),
        ({"prompt": "hi", "tools": [FUNCTION]}, 400, "tools applies to messages or input only"),
        ({"messages": ASK, "instructions": "x"}, 400, "instructions applies to input only"),
        ({"input": "hi", "documents": []}, 400, "documents applies to messages only"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, 422, "invalid tools or tool_choice"),
        ({"messages": ASK, "tools": [FUNCTION]}, 422, "invalid tools or tool_choice"),
        ({"messages": ASK, "tool_choice": "sometimes"}, 422, "invalid tools or tool_choice"),
    ],
)
async def test_what_kvindex_does_not_render_is_refused_naming_the_field(
    body: dict, status: int, says: str
) -> None:
    """Bodies vLLM may take but kvindex cannot render exactly (a stored history,
    tools vLLM converts by its own rules, items of no chat message), and fields
    sent with a prompt they do not apply to: 4xx, never tokens vLLM did not compute."""
    store, registry = MemoryStore(), EngineRegistry()
    await registry.add(engine("e", model=HERMES, hash_algo="sha256"))
    app = api_app(store, registry, FakeConsumers(store), SETTINGS, tokenizers=POOL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
        answer = await client.post("/prefix-match", json={"model": HERMES, **body})
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]


async def test_a_responses_tool_list_and_a_chat_tool_list_render_alike() -> None:
    """The same function, flat in a Responses request or nested in a chat's: one
    serialisation, so one prompt for the same conversation."""
    chat_tool = {"type": "function", "function": {k: v for k, v in FUNCTION.items() if k != "type"}}
    by_chat = await _tokens(
        {"model": "hermes", "server": "auto", "request": {"messages": ASK, "tools": [chat_tool]}}
    )
    by_input = await _tokens(
        {"model": "hermes", "server": "auto", "request": {"input": "hi", "tools": [FUNCTION]}}
    )
    # A Responses request is tokenized with the special tokens: chatmlish adds none.
    assert by_chat == by_input and len(by_chat) > 30


def _readme_bodies() -> list[dict]:
    """The tool-using and Responses bodies the README and docs/prompts.md show."""
    root = Path(__file__).resolve().parents[1]
    texts = [(root / name).read_text() for name in ("README.md", "docs/prompts.md")]
    blocks = [b for t in texts for b in re.findall(r"```json\n(.*?)```", t, flags=re.S)]
    return [json.loads(b) for b in blocks if '"tools"' in b]


async def test_the_readmes_tool_and_responses_examples_are_answered() -> None:
    bodies = _readme_bodies()
    assert {"messages" in b for b in bodies} == {True, False} and len(bodies) == 4
    hermes = GOLDEN["models"]["hermes"]
    agent = ModelTokenizer(
        str(TOKENIZERS / hermes["tokenizer"]),
        chat_template=str(FIXTURES / hermes["chat_template"]),
        enable_auto_tool_choice=True,
        tool_call_parser="pythonic",
    )
    settings = ApiSettings(models={"qwen-agent": agent})
    store, registry = MemoryStore(), EngineRegistry()
    await registry.add(engine("e", model="qwen-agent", hash_algo="sha256"))
    app = api_app(store, registry, FakeConsumers(store), settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
        for body in bodies:
            answer = await client.post("/prefix-match", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["num_blocks"] > 5


def test_a_responses_request_renders_alike_every_time() -> None:
    """Items are copied, not filled in place: a request rendered twice (as one with
    tools is, when the tokenizer has a tool template) gives the same tokens."""
    called = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    items = [{"role": "user", "content": "hi"}, {"role": "assistant"}, called]
    request = ResponsesRequest(input=items, tools=[FUNCTION])
    first = POOL.tokens_now("hermes-named.plain", responses=request)
    assert POOL.tokens_now("hermes-named.plain", responses=request) == first
    assert items[1] == {"role": "assistant"}


async def test_an_empty_tool_list_is_no_tools_for_vllm_0_34_and_refused_for_0_33() -> None:
    """vLLM 0.34 serves a chat's ``tools: []`` as none (``"auto"`` and ``"required"`` as
    ``"none"``); 0.33 refuses it. The engines a query selects decide: served only when
    all are vLLM engines announcing no older release."""
    new, unsaid = engine("new", release="0.34.0"), engine("unsaid")
    old = engine("old", release="0.33.0")

    async def tokens(specs: tuple, **fields) -> list[int]:
        body = msgspec.convert({"model": HERMES, "messages": ASK, **fields}, PrefixMatchBody)
        query = await to_query(body, SETTINGS, POOL, lambda: specs)
        assert query.prompt is not None
        return list(query.prompt.tokens)

    plain = await tokens((new,))
    for choice in (None, "auto", "required", "none"):
        assert await tokens((new,), tools=[], tool_choice=choice) == plain, choice
    assert await tokens((new, unsaid), tools=[]) == plain
    for specs in ((old,), (new, old), ()):
        with pytest.raises(ApiError) as refused:
            await tokens(specs, tools=[])
        assert refused.value.status == 400 and refused.value.message.startswith("tools: ")
