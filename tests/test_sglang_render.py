"""SGLang 0.5.23's chat rules as kvindex restates them (indexer/engines/sglang/render.py)."""

from __future__ import annotations

import pytest
from jinja2 import Environment

from indexer.engines import catalog
from indexer.engines.rendering import ChatMessage, ChatOptions, PromptRefused, ToolServing

RENDERER = catalog.renderer("sglang")
SERVING = ToolServing()  # vLLM's tool flags: SGLang's rendering takes none of them


def traits(source: str):
    return RENDERER.template_traits(source, Environment().parse(source), ())


@pytest.mark.parametrize(
    ("source", "fmt"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
         "openai"),
        ("{% for message in messages %}{% for c in message['content'] | list %}{% endfor %}"
         "{% endfor %}", "openai"),
        # SGLang follows no alias, unlike vLLM
        ("{% for x in messages %}{% for c in x.content %}{% endfor %}{% endfor %}", "string"),
        ("{{ messages[0].content }} {# an image #}", "openai"),
    ],
)  # fmt: skip
def test_the_content_format_is_sglangs_reading(source: str, fmt: str) -> None:
    assert traits(source).content_format == fmt


def test_parts_join_with_a_space_and_a_final_assistant_message_becomes_the_user() -> None:
    messages = [
        ChatMessage(role="system", content=None, name="ops"),
        ChatMessage(role="user", content=[{"type": "text", "text": "a"}, "b"]),
        ChatMessage(role="tool", content=[{"type": "text", "text": "c"}], tool_call_id="t1"),
        ChatMessage(role="assistant", content="d", reasoning="r", reasoning_content="rc"),
    ]
    string = RENDERER.chat_call(messages, ChatOptions(), traits("{{ messages }}"), SERVING)
    assert string.conversation == [
        {"role": "system", "content": "", "name": "ops"},
        {"role": "user", "content": "a b"},
        {"role": "tool", "content": "c", "tool_call_id": "t1"},
        {"role": "user", "content": "d"},
    ]
    assert string.kwargs == {"add_generation_prompt": True} and not string.add_special_tokens
    parts = RENDERER.chat_call(messages[1:3], ChatOptions(), traits("{{ vision }}"), SERVING)
    assert parts.conversation[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert parts.conversation[1]["content"] == "c"  # a tool's text parts: always one string


def test_flags_sglang_ignores_are_ignored_and_what_it_cannot_take_is_refused() -> None:
    messages = [ChatMessage(role="user", content="x")]
    fmt = traits("{{ messages }}")
    ignored = ChatOptions(add_generation_prompt=False, add_special_tokens=True,
                          chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    call = RENDERER.chat_call(messages, ignored, fmt, SERVING)
    assert call.kwargs == {"enable_thinking": False, "add_generation_prompt": True}
    assert not call.add_special_tokens
    refused = [
        (ChatOptions(continue_final_message=True), "continue_final_message"),
        (ChatOptions(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
        (ChatOptions(tools=[]), "tools"),  # SGLang's tool rendering is not restated
        (ChatOptions(reasoning_effort="low"), "reasoning_effort"),
    ]
    for options, field in refused:
        with pytest.raises(PromptRefused) as e:
            RENDERER.chat_call(messages, options, fmt, SERVING)
        assert e.value.field == field
    image = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "u"}}])]
    with pytest.raises(PromptRefused, match="text parts only"):
        RENDERER.chat_call(image, ChatOptions(), fmt, SERVING)
    assert RENDERER.completion_special_tokens(False) is True
    with pytest.raises(PromptRefused):
        RENDERER.completion_input("")
    with pytest.raises(PromptRefused) as e:  # no Responses rendering for SGLang engines
        RENDERER.responses_call(None, fmt, SERVING)
    assert e.value.field == "input"
