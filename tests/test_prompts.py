"""``prompt`` and ``messages`` queries: vLLM 0.33.0's exact tokens, hashes and answers.

The golden cases (``shared/fixtures/vllm-0.33.0/tokenize``) were rendered by
vLLM's own OpenAI front end for two small tokenizers. Each must give vLLM's
token ids and block hashes, and answer a prefix match in full on an engine
holding exactly the blocks vLLM published for it: one hashing with sha256
(kvindex recomputes its hashes), one with xxhash and a seed kvindex is
never told (matched through the token index learned from its events). The
cases vLLM refuses are refused with a 4xx that names the field.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry
from indexer.engines.base import Prompt
from indexer.engines.vllm.render import PromptRefused
from indexer.prompts import ModelTokenizer
from indexer.stores import MemoryStore
from kvindex.wiring import api_app

from .apikit import FakeConsumers, engine
from .prompts_kit import (
    ACCEPTED,
    BLOCK,
    CASES,
    FIXTURES,
    GOLDEN,
    MODELS,
    POOL,
    REFUSED,
    VLLM,
    _id,
    _tokens,
)


def test_the_golden_cases_are_all_here() -> None:
    assert GOLDEN["vllm_version"] == "0.33.0" and GOLDEN["hash_algo"] == "sha256"
    assert len(CASES) == 74 and {c["tokenizer"] for c in CASES} == set(MODELS)
    assert {c["kind"] for c in ACCEPTED} == {"completion", "chat"} and len(REFUSED) == 4


@pytest.mark.parametrize("case", ACCEPTED, ids=_id)
def test_each_case_gives_vllms_token_ids_and_block_hashes(case: dict) -> None:
    tokens = _tokens(case)
    assert tokens == case["token_ids"]
    digests = VLLM.hasher("sha256", None, BLOCK).digests(Prompt(tuple(tokens)))
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    assert VLLM.hasher("sha256", None, BLOCK).published(digests) == case["block_hashes_u64"]


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_each_request_vllm_refuses_is_refused_naming_the_field(case: dict) -> None:
    with pytest.raises(PromptRefused) as refused:
        _tokens(case)
    assert refused.value.status == case["expected_error"]["status"] == 400
    field = "prompt" if case["kind"] == "completion" else "continue_final_message"
    assert refused.value.field == field and str(refused.value).startswith(f"{field}: ")


# --- through the API: prefix-match answers, sha256 and the learned token index ----------


class PromptApi:
    """An app over a memory store with the golden tokenizers, a fake subscriber
    feeding the token index, and per tokenizer two engines serving it."""

    def __init__(self, models: dict[str, ModelTokenizer] | None = None) -> None:
        self.store = MemoryStore()
        self.registry = EngineRegistry()
        self.consumers = FakeConsumers(self.store)
        settings = ApiSettings(models=MODELS if models is None else models)
        pool = POOL if models is None else None
        app = api_app(self.store, self.registry, self.consumers, settings, tokenizers=pool)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://kvindex"
        )
        self.seq = 0

    async def add_engines(self, model: str) -> None:
        await self.registry.add(engine(f"{model}-sha", model=model, hash_algo="sha256"))
        await self.registry.add(engine(f"{model}-xx", model=model, hash_algo="xxhash"))

    async def publish(self, name: str, tokens: list[int], hashes: list[int]) -> None:
        """What vLLM publishes for a prompt's full blocks: their hashes and tokens."""
        full = len(hashes) * BLOCK
        event = BlockStored(hashes, None, tokens[:full], BLOCK, extra_keys=[None] * len(hashes))
        self.seq += 1
        await self.consumers.apply(RankId(name, 0), self.seq, EventBatch(1.0, [event], 0))

    async def match(self, body: dict) -> httpx.Response:
        return await self.client.post("/prefix-match", json=body)


def _xxhash_chain(tokens: list[int]) -> list[int]:
    """The hashes an engine seeded with a secret publishes (kvindex is not told it)."""
    hasher = VLLM.hasher("xxhash", "a secret kvindex never sees", BLOCK)
    return hasher.published(hasher.digests(Prompt(tuple(tokens))))


@pytest.mark.parametrize("tokenizer", sorted(MODELS))
async def test_prefix_match_by_prompt_and_messages_answers_every_case_in_full(
    tokenizer: str,
) -> None:
    """Every case's blocks are published on both engines; each query by its body
    then finds them all, on both engines, and nothing more."""
    api = PromptApi()
    await api.add_engines(tokenizer)
    cases = [c for c in ACCEPTED if c["tokenizer"] == tokenizer]
    for case in cases:
        await api.publish(f"{tokenizer}-sha", case["token_ids"], case["block_hashes_u64"])
        await api.publish(f"{tokenizer}-xx", case["token_ids"], _xxhash_chain(case["token_ids"]))
    for case in cases:
        answer = await api.match({"model": tokenizer, **case["request"]})
        assert answer.status_code == 200, (case["name"], answer.text)
        body = answer.json()
        full = case["num_full_blocks"]
        assert body["num_blocks"] == full, case["name"]
        held = {e["engine"]: e["prefix_blocks"] for e in body["engines"]}
        assert held == {f"{tokenizer}-sha": full, f"{tokenizer}-xx": full}, case["name"]


async def test_a_flag_that_changes_the_tokens_changes_the_answer() -> None:
    """The answer follows the tokens: without vLLM's default BOS the same text
    is another chain, and no published block matches it."""
    api = PromptApi()
    await api.add_engines("llama3ish")
    case = next(
        c for c in ACCEPTED if c["tokenizer"] == "llama3ish" and c["name"] == "cmpl_numbers"
    )
    await api.publish("llama3ish-sha", case["token_ids"], case["block_hashes_u64"])
    await api.publish("llama3ish-xx", case["token_ids"], _xxhash_chain(case["token_ids"]))
    body = {"model": "llama3ish", **case["request"], "add_special_tokens": False}
    answer = (await api.match(body)).json()
    assert [e["prefix_blocks"] for e in answer["engines"]] == [0, 0]
    by_tokens = (await api.match({"model": "llama3ish", "tokens": case["token_ids"]})).json()
    assert [e["prefix_blocks"] for e in by_tokens["engines"]] == [3, 3]


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"model": "nope", "prompt": "hi"}, 400, "model"),
        ({"prompt": "hi"}, 400, "model"),
        ({"model": "llama3ish", "prompt": ""}, 400, "prompt"),
        ({"model": "llama3ish", "prompt": "hi", "tokens": [1]}, 400, "tokens and prompt"),
        ({"model": "llama3ish", "messages": [], "tokens": [1]}, 400, "tokens and messages"),
        ({"model": "llama3ish", "prompt": "hi", "add_generation_prompt": True}, 400, "messages"),
        ({"tokens": [1, 2], "add_special_tokens": True}, 400, "add_special_tokens"),
        (
            {
                "model": "chatmlish",
                "messages": [{"role": "user", "content": "a"}],
                "continue_final_message": True,
            },
            400,
            "continue_final_message",
        ),
        (
            {
                "model": "chatmlish",
                "messages": [{"role": "user", "content": "a"}],
                "chat_template_kwargs": {"tokenize": True},
            },
            400,
            "chat_template_kwargs",
        ),
        (
            {"model": "chatmlish", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "messages[0].content[0].type",
        ),
        (
            {
                "model": "chatmlish",
                "messages": [{"role": "user", "content": ["a", {"image_url": {"url": "x"}}]}],
            },
            400,
            "messages[0].content[1].type",
        ),
        ({"model": "chatmlish", "messages": [{"content": "no role"}]}, 422, "role"),
        ({"model": "chatmlish", "messages": [], "tools": [{"type": "function"}]}, 422, "tools"),
    ],
)
async def test_bad_prompt_fields_are_4xx_naming_the_field(
    body: dict, status: int, names: str
) -> None:
    api = PromptApi()
    await api.add_engines("llama3ish")
    await api.add_engines("chatmlish")
    answer = await api.match(body)
    assert answer.status_code == status, answer.text
    assert names in answer.json()["error"]


async def test_template_errors_and_missing_templates_are_400s_naming_messages() -> None:
    raising = "{{ raise_exception('only user turns, please') }}"
    models = {
        "strict": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=raising),
        "broken": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template="{% for %}"),
    }
    api = PromptApi(models)
    await api.add_engines("strict")
    messages = [{"role": "user", "content": "hi"}]
    strict = await api.match({"model": "strict", "messages": messages})
    assert strict.status_code == 400
    assert strict.json()["error"].startswith("messages: the chat template failed")
    assert "only user turns, please" in strict.json()["error"]
    broken = await api.match({"model": "broken", "messages": messages})
    assert broken.status_code == 503 and "'broken' failed to load" in broken.json()["error"]
    completion = await api.match({"model": "strict", "prompt": "completions use no template"})
    assert completion.status_code == 200


async def test_no_tokenizer_configured_is_a_400_naming_model() -> None:
    answer = await PromptApi({}).match({"model": "llama3ish", "prompt": "hi"})
    assert answer.status_code == 400
    assert (
        answer.json()["error"]
        == "model: no tokenizer is configured for 'llama3ish' (none is configured)"
    )


@pytest.mark.slow
def test_without_the_extra_a_prompt_is_a_400_naming_it() -> None:
    """kvindex imports and serves without transformers; a prompt then says what to install."""
    script = f"""
import sys, asyncio, json
sys.modules["transformers"] = None  # as if the extra were not installed
import httpx
from api import ApiSettings
from kvindex.wiring import api_app
from indexer.prompts import ModelTokenizer
from indexer.engine_registry import EngineRegistry
from indexer.stores import MemoryStore
from tests.apikit import FakeConsumers
store = MemoryStore()
settings = ApiSettings(models={{"m": ModelTokenizer({str(FIXTURES / "llama3ish")!r})}})
app = api_app(store, EngineRegistry(), FakeConsumers(store), settings)
async def main():
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://k")
    for body in ({{"model": "m", "messages": []}}, {{"tokens": [1, 2]}}):
        r = await client.post("/prefix-match", json=body)
        print(json.dumps([r.status_code, r.json()]))
asyncio.run(main())
from kvindex.config import ConfigError, ServeConfig
try:
    ServeConfig(models=settings.models).api_settings()
except ConfigError as e:
    print(json.dumps([0, {{"error": str(e)}}]))
"""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    chat, tokens, serve = (json.loads(line) for line in run.stdout.splitlines())
    assert chat[0] == 400
    assert chat[1]["error"].startswith("messages: needs the optional extra 'tokenize'")
    assert "pip install 'kvindex[tokenize]'" in chat[1]["error"]
    assert tokens[0] == 200
    # and a server configured with models refuses to start, in one line naming the extra
    assert serve[1]["error"] == (
        "models: m configured, but the tokenize extra is not installed"
        " (pip install 'kvindex[tokenize]'; missing transformers)"
    )


async def test_tokenizers_load_at_start_and_readyz_waits_for_them() -> None:
    """The configured models load in the worker threads as the app is made; /readyz
    is 503 naming them until they have, with no prompt query asking."""
    store = MemoryStore()
    app = api_app(store, EngineRegistry(), FakeConsumers(store), ApiSettings(models=MODELS))
    tokenizers = app.state.tokenizers
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://kvindex"
    ) as client:
        first = await client.get("/readyz")
        if first.status_code == 503:  # caught while they load
            assert first.json()["error"].startswith("tokenizers still loading: "), first.text
        for _ in range(600):
            if not tokenizers.loading():
                break
            await asyncio.sleep(0.05)
        assert tokenizers.loading() == []
        assert (await client.get("/readyz")).status_code == 200
    assert not tokenizers.failed(), tokenizers.failed()
