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
import random
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api import ApiSettings, create_app
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.vllm.render import (
    ChatMessage,
    ChatOptions,
    PromptRefused,
    TemplateTraits,
    chat_call,
)
from indexer.prompts import ModelTokenizer, Tokenizers
from indexer.registry import EngineRegistry
from indexer.stores import MemoryStore
from kvindex.config import ConfigError, load_config

from .apikit import FakeConsumers, engine

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/vllm-0.33.0/tokenize"
GOLDEN = json.loads((FIXTURES / "cases.json").read_text())
CASES = GOLDEN["cases"]
MODELS = {name: ModelTokenizer(str(FIXTURES / d)) for name, d in GOLDEN["tokenizers"].items()}
BLOCK = GOLDEN["block_size"]
REQUEST_FIELDS = ("add_special_tokens", "add_generation_prompt", "continue_final_message")
VLLM = catalog.adapter("vllm")
#: One pool for the whole module: loading a tokenizer is the slow part of a test.
POOL = Tokenizers(MODELS)


def _id(case: dict) -> str:
    return f"{case['tokenizer']}-{case['name']}"


ACCEPTED = [c for c in CASES if "expected_error" not in c]
REFUSED = [c for c in CASES if "expected_error" in c]


def _tokens(case: dict, pool: Tokenizers = POOL) -> list[int]:
    request = case["request"]
    messages = request.get("messages")
    return pool.tokens_now(
        case["tokenizer"],
        prompt=request.get("prompt"),
        messages=msgspec.convert(messages, list[ChatMessage]) if messages is not None else None,
        options=ChatOptions(**{k: request[k] for k in REQUEST_FIELDS if k in request}),
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
        app = create_app(self.store, self.registry, self.consumers, settings, tokenizers=pool)
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
from api import ApiSettings, create_app
from indexer.prompts import ModelTokenizer
from indexer.registry import EngineRegistry
from indexer.stores import MemoryStore
from tests.apikit import FakeConsumers
store = MemoryStore()
settings = ApiSettings(models={{"m": ModelTokenizer({str(FIXTURES / "llama3ish")!r})}})
app = create_app(store, EngineRegistry(), FakeConsumers(store), settings)
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
    app = create_app(store, EngineRegistry(), FakeConsumers(store), ApiSettings(models=MODELS))
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


# --- the piece cache is exact, and tokenizing leaves the event loop free ----------------


def _conversation(turns: int, seed: int = 3) -> list[ChatMessage]:
    rng = random.Random(seed)
    words = ["kv", "cache", "re\u0301sume", "日本語", "12345", "\n\n", "  ", "<|eot_id|>", "x"]
    return [
        ChatMessage(
            role="user" if i % 2 == 0 else "assistant",
            content=" ".join(rng.choice(words) for _ in range(rng.randint(0, 60))),
        )
        for i in range(turns)
    ]


@pytest.mark.parametrize("tokenizer", sorted(MODELS))
def test_a_growing_conversation_tokenizes_as_if_whole(tokenizer: str) -> None:
    """Turn after turn, the cached pieces give exactly what tokenizing the whole
    rendered text gives, and the earlier turns come from the cache."""
    pool = Tokenizers({tokenizer: MODELS[tokenizer]})
    for turns in range(1, 12):
        messages = _conversation(turns)
        tokens = pool.tokens_now(tokenizer, messages=messages)
        loaded = pool._model(tokenizer, "messages")
        text = loaded.hf.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokens == loaded.hf(text, add_special_tokens=False)["input_ids"]
    assert loaded.split is not None and len(pool._cache) > 10


#: Texts made of what the tokenizers treat specially: added tokens of both, their
#: fragments, combining accents (NFC), digits, contractions and whitespace runs.
_PIECES = ["a", "é", "e\u0301", " ", "  ", "\n", "\t", "1", "日", "'s", "<|", "<|im_end|>"]
_TEXT = st.lists(st.sampled_from([*_PIECES, "<|eot_id|>", "<|begin_of_text|>"]), max_size=40).map(
    "".join
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(text=_TEXT, special=st.booleans())
def test_pieces_equal_the_whole_text_for_any_text(text: str, special: bool) -> None:
    for name in MODELS:
        loaded = POOL._model(name, "prompt")
        assert POOL._encode(loaded, text, special) == loaded.whole(text, special)


@pytest.mark.slow
async def test_tokenizing_runs_off_the_event_loop() -> None:
    pool = Tokenizers({"llama3ish": MODELS["llama3ish"]})
    await pool.tokens("llama3ish", prompt="warm up")
    seen: list[str] = []
    real = pool._encode

    def spy(*args: object) -> list[int]:
        seen.append(threading.current_thread().name)
        return real(*args)

    pool._encode = spy  # type: ignore[method-assign]
    ticks = 0
    long_text = " ".join(str(i) for i in range(20_000))
    work = asyncio.ensure_future(pool.tokens("llama3ish", prompt=long_text))
    while not work.done():
        ticks += 1
        await asyncio.sleep(0)
    assert len(await work) > 20_000 and ticks > 1
    assert seen and all(name.startswith("kvindex-tokenize") for name in seen)
    pool.close()


# --- configuration ------------------------------------------------------------------------


def test_models_are_a_top_level_config_section(tmp_path: Path) -> None:
    path = tmp_path / "kvindex.yaml"
    path.write_text(f"models:\n  m:\n    tokenizer: {FIXTURES / 'chatmlish'}\n")
    assert load_config(path).api_settings().models == {
        "m": ModelTokenizer(str(FIXTURES / "chatmlish"))
    }
    path.write_text("api:\n  models: {}\n")
    with pytest.raises(ConfigError, match="models is a section of its own"):
        load_config(path).api_settings()
    path.write_text("models:\n  m:\n    tokeniser: x\n")
    with pytest.raises(ConfigError, match="tokeniser"):
        load_config(path)


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    pool = Tokenizers(
        {
            "file": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=str(template)),
            "text": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=template.read_text()),
            "typo": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template="no/such.jinja"),
        }
    )
    messages = [ChatMessage(role="user", content="hi")]
    assert pool.tokens_now("file", messages=messages) == pool.tokens_now("text", messages=messages)
    with pytest.raises(PromptRefused, match="neither a file nor a template"):
        pool.tokens_now("typo", messages=messages)


# --- vLLM's message rules, beyond the golden cases ------------------------------------------

STRING = TemplateTraits("string", False, frozenset({"add_generation_prompt"}))
PARTS = TemplateTraits("openai", True, frozenset({"add_generation_prompt"}))


def _conversation_of(messages: list[dict], traits: TemplateTraits = STRING) -> list[dict]:
    converted = msgspec.convert(messages, list[ChatMessage])
    return chat_call(converted, ChatOptions(), traits).conversation


def test_text_parts_join_with_newlines_and_empty_ones_add_no_line() -> None:
    parts = [
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},
        "two",
        {"type": "input_text", "text": "three"},
        {"type": "text", "text": None},
    ]
    assert _conversation_of([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "one\ntwo\nthree"}
    ]
    # A template that loops over parts gets them as typed dicts, extra fields kept.
    assert _conversation_of([{"role": "user", "content": parts}], PARTS)[0]["content"] == [
        {"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},
        {"type": "text", "text": "two"},
        {"type": "text", "text": "three"},
    ]


def test_roles_carry_the_fields_vllm_passes_on() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    conversation = _conversation_of(
        [
            {"role": "user", "content": "hi", "name": "ann", "unknown_field": 1},
            {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "r"},
            {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1"},
        ],
        PARTS,
    )
    assert conversation == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        {
            "role": "assistant",
            "content": [],
            "tool_calls": calls,
            "reasoning": "r",
            "reasoning_content": "r",
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_developer_messages_merge_into_one_system_only_where_the_template_lacks_the_role() -> None:
    messages = [
        {"role": "user", "content": "u"},
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d", "tools": [{"type": "function"}]},
    ]
    assert _conversation_of(messages) == [
        {"role": "system", "content": "s\n\nd"},
        {"role": "user", "content": "u"},
    ]
    kept = _conversation_of(messages, PARTS)
    assert [m["role"] for m in kept] == ["user", "system", "developer"]
    assert kept[2]["tools"] == [{"type": "function"}]
    # Without a developer message, system messages stay where they are.
    two_systems = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}]
    assert [m["content"] for m in _conversation_of(two_systems)] == ["a", "b"]


def test_the_request_flags_override_chat_template_kwargs_and_unknown_kwargs_are_dropped() -> None:
    messages = msgspec.convert([{"role": "user", "content": "x"}], list[ChatMessage])
    kwargs = {"add_generation_prompt": True, "enable_thinking": False, "nobody_reads_me": 1}
    traits = TemplateTraits(
        "string", False, frozenset({"add_generation_prompt", "enable_thinking"})
    )
    call = chat_call(messages, ChatOptions(False, None, None, kwargs), traits)
    assert call.kwargs == {"add_generation_prompt": False, "enable_thinking": False}
    assert call.add_special_tokens is False


def test_the_content_format_is_read_off_the_template() -> None:
    loops = "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}"
    aliased = (
        "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content %}"
        "{{ c['text'] }}{% endfor %}{% endfor %}"
    )
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# 'developer' #}"
    pool = Tokenizers(
        {
            name: ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=template)
            for name, template in (("loops", loops), ("aliased", aliased), ("plain", plain))
        }
    )
    traits = {name: pool._model(name, "messages").traits for name in ("loops", "aliased", "plain")}
    assert traits["loops"].content_format == traits["aliased"].content_format == "openai"
    assert traits["plain"].content_format == "string"
    assert traits["plain"].knows_developer and not traits["loops"].knows_developer
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "hello"}])]
    assert pool.tokens_now("loops", messages=messages) == pool.tokens_now(
        "plain", messages=[ChatMessage(role="user", content="hello")]
    )


@pytest.mark.parametrize("tokenizer", sorted(MODELS))
@pytest.mark.parametrize("seed", range(12))
def test_random_chats_and_flags_tokenize_as_transformers_renders_them(
    tokenizer: str, seed: int
) -> None:
    """Where vLLM adds no rule of its own (no developer role, no billing header, string
    content), its tokens are transformers' render, tokenized: random chats and flags."""
    rng = random.Random(seed)
    messages = [
        {"role": role, "content": m.content}
        for role, m in zip(
            rng.choice([["system"], []]) + ["user", "assistant"] * 3,
            _conversation(8, seed),
            strict=False,
        )
    ]
    generation = rng.choice([None, True, False])
    cont = generation is False and rng.random() < 0.5
    special = rng.choice([None, True, False])
    options = ChatOptions(generation, cont or None, special)
    converted = msgspec.convert(messages, list[ChatMessage])
    tokens = POOL.tokens_now(tokenizer, messages=converted, options=options)
    hf = POOL._model(tokenizer, "messages").hf
    text = hf.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=generation is not False,
        continue_final_message=cont,
    )
    assert tokens == hf(text, add_special_tokens=bool(special))["input_ids"]
