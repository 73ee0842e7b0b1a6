"""SGLang 0.5.23's OpenAI front end: what its generic Jinja chat path hands the tokenizer.

Where it differs from vLLM's (the reason this is not shared):

- A template reads content as a list of typed parts ("openai") when its text
  names ``image``, ``audio``, ``video`` or ``vision`` anywhere, or when it loops
  over ``message.content`` (also ``msg.content``, ``m.content``; through filters,
  tests and slices); else as one string. In string form the text parts are joined
  with one space, and null content is an empty string.
- A tool message whose content is all text parts is always one string, joined
  with a space.
- Each message keeps its fields that are set (``name``, ``tool_call_id``,
  ``reasoning_content``, ``tool_calls``, ``tools``); vLLM's ``reasoning`` is not
  one of SGLang's.
- A final assistant message with string content becomes a user message.
  ``continue_final_message`` instead renders without it and appends its tokens
  after the rendered prompt: kvindex does not restate that, and refuses it.
- Chat completions always render with ``add_generation_prompt`` and tokenize
  without special tokens: the request's flags for these are not SGLang's (its
  ``/tokenize`` endpoint alone takes them), so they are ignored as SGLang ignores
  them. ``chat_template_kwargs`` go to the template as they are.
- A completions prompt string is tokenized with the special tokens.

Only text is rendered: media parts are refused, as their placeholder tokens depend
on the model's processor. Models SGLang renders with an encoder of its own
(DeepSeek V3.2, Kimi) are not restated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from indexer.engines.rendering import (
    ChatCall,
    ChatMessage,
    ChatOptions,
    PromptRefused,
    ToolServing,
)

ContentFormat = Literal["string", "openai"]
_TEXT_TYPES = ("text", "input_text")
#: Set by SGLang itself: a request may not pass them as template kwargs.
_RESERVED_KWARGS = ("add_generation_prompt", "tokenize", "tools", "return_dict")
_KEPT_FIELDS = ("name", "tool_call_id", "reasoning_content", "tool_calls", "tools")


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What SGLang reads off a chat template: how it takes a message's content."""

    content_format: ContentFormat


def completion_input(prompt: str | list[int]) -> str | list[int]:
    """The text to tokenize, or the token ids as given; an empty prompt is refused."""
    if len(prompt) == 0:
        raise PromptRefused("prompt", "must not be empty")
    return prompt


def completion_special_tokens(add_special_tokens: bool | None) -> bool:
    """SGLang's completions take no such flag: the text is tokenized with them."""
    return True


#: The chat fields SGLang's tool and reasoning paths take, which kvindex does not restate.
_UNRESTATED = ("tools", "tool_choice", "documents", "reasoning_effort")


def chat_call(
    messages: list[ChatMessage], options: ChatOptions, traits: TemplateTraits, serving: ToolServing
) -> ChatCall:
    """The conversation and kwargs SGLang renders ``messages`` with, or :class:`PromptRefused`
    (``serving``, vLLM's tool flags, decides nothing here: tools are refused)."""
    for field in _UNRESTATED:
        if getattr(options, field) is not None:
            raise PromptRefused(field, "SGLang's rendering of it is not restated by kvindex")
    if options.continue_final_message:
        raise PromptRefused(
            "continue_final_message",
            "SGLang appends the final message's tokens after rendering: not restated by kvindex",
        )
    kwargs = dict(options.chat_template_kwargs or {})
    reserved = sorted(set(_RESERVED_KWARGS) & kwargs.keys())
    if reserved:
        raise PromptRefused(
            "chat_template_kwargs", f"may not set {', '.join(reserved)} (SGLang sets them)"
        )
    conversation = [_entry(i, m, traits.content_format) for i, m in enumerate(messages)]
    last = conversation[-1] if conversation else None
    if last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
        conversation[-1] = {"role": "user", "content": last["content"]}
    kwargs["add_generation_prompt"] = True
    return ChatCall(conversation, None, kwargs, False)


def _entry(i: int, message: ChatMessage, fmt: ContentFormat) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role}
    entry["content"] = _content(i, message, fmt)
    for field in _KEPT_FIELDS:
        value = getattr(message, field)
        if value is not None:
            entry[field] = value
    return entry


def _content(i: int, message: ChatMessage, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = list(_texts(i, content))
    if fmt == "string" or message.role == "tool":
        return " ".join(texts)
    return [{"type": "text", "text": text} for text in texts]


def _texts(i: int, parts: list[str | dict[str, Any]]) -> Iterator[str]:
    for j, part in enumerate(parts):
        if isinstance(part, str):
            yield part
            continue
        kind, text = part.get("type"), part.get("text")
        if kind not in _TEXT_TYPES:
            raise PromptRefused(
                f"messages[{i}].content[{j}].type",
                f"{str(kind)[:40]!r} is not supported: kvindex renders text parts only",
            )
        if not isinstance(text, str):
            raise PromptRefused(f"messages[{i}].content[{j}].text", "must be a string", 422)
        yield text
