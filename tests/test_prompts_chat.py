"""vLLM's rules for chat messages beyond what the golden cases show (content
parts, roles' fields, developer messages, template kwargs, content formats), so
that any chat, not only the rendered ones, gives vLLM's tokens."""

from __future__ import annotations

import random

import msgspec
import pytest

from indexer.engines.rendering import PromptRefused, ToolServing
from indexer.engines.vllm.render import ChatMessage, ChatOptions, TemplateTraits, chat_call
from indexer.prompts import ModelTokenizer, Tokenizers

from .prompts_kit import FIXTURES, MODELS, POOL, _conversation

# --- vLLM's message rules, beyond the golden cases ------------------------------------------

STRING = TemplateTraits("string", False, frozenset({"add_generation_prompt"}))
PARTS = TemplateTraits("openai", True, frozenset({"add_generation_prompt"}))


def _conversation_of(messages: list[dict], traits: TemplateTraits = STRING) -> list[dict]:
    converted = msgspec.convert(messages, list[ChatMessage])
    return chat_call(converted, ChatOptions(), traits, ToolServing()).conversation


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
            "tool_calls": [{**calls[0], "function": {"name": "f", "arguments": {}}}],
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
    call = chat_call(messages, ChatOptions(False, None, None, kwargs), traits, ToolServing())
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
    traits = {
        name: (loaded := pool._model(name, "messages")).traits("vllm", loaded.template)
        for name in ("loops", "aliased", "plain")
    }
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


def test_an_inline_template_longer_than_a_file_name_is_a_template() -> None:
    """A template given inline in the config is no file name, however long (asking the
    file system about 300 characters fails with ENAMETOOLONG)."""
    long = "{# " + "x" * 300 + " #}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pool = Tokenizers({"long": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=long)})
    tokens = pool.tokens_now("long", messages=[ChatMessage("user", "hello")])
    assert tokens == pool.tokens_now("long", prompt="hello", options=ChatOptions())


@pytest.mark.parametrize(
    ("call", "refused"),
    [
        ({"type": "function", "function": {"name": "f", "arguments": "{}"}}, "[0].id: "),
        ({"id": "c", "function": {"name": "f", "arguments": "{}"}}, "[0]: must be of type"),
        ({"id": "c", "type": "custom", "custom": {"name": "f", "input": ""}}, "[0]: must be of"),
        ({"id": "c", "type": "function", "function": {"name": "f"}}, "[0].function.arguments: "),
        ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "[0].function.name: "),
    ],
)
def test_tool_calls_vllm_refuses_are_refused_naming_the_call(call: dict, refused: str) -> None:
    """vLLM takes only function calls with a string id, name and arguments (JSON text)."""
    with pytest.raises(PromptRefused) as raised:
        _conversation_of([{"role": "assistant", "tool_calls": [call]}])
    assert f"messages[0].tool_calls{refused}" in str(raised.value)


def test_tool_calls_reach_the_template_in_vllms_order_with_their_arguments_parsed() -> None:
    call = {"index": 0, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    (entry,) = _conversation_of([{"role": "assistant", "tool_calls": [{**call, "id": "c"}]}])
    (made,) = entry["tool_calls"]
    assert list(made) == ["id", "function", "type", "index"]
    assert list(made["function"].items()) == [("arguments", {"a": 1}), ("name", "f")]
