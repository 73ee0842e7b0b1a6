"""vLLM 0.33.0's ``/v1/responses`` without a stored history: the chat it renders.

A Responses request is rendered as a chat, by the same rules
(:func:`~indexer.engines.vllm.render.conversation_call`), from messages built
thus: ``instructions`` first, as a system message; then ``input``, a string
(one user message) or items in order:

- an item with a ``role`` (``type`` ``message`` or none) is that chat
  message, except an assistant's, whose text (a string, or its first content
  part's) fills the assistant message before it if that one has no content
  yet (it holds only reasoning or tool calls), else starts a new one;
- ``function_call``: a tool call (``call_id``, ``name``, ``arguments``)
  added to the assistant message before it, else a new assistant message;
- ``function_call_output``: a ``tool`` message (``output``, ``call_id``);
- ``reasoning``: the text of its first ``content`` part, else of its first
  ``summary`` part, as the reasoning of the assistant message before it if
  that has none yet, else of a new one; encrypted reasoning is refused.

The template gets the function ``tools`` as a chat request's, none if there
are none or if ``tool_choice`` is ``"none"`` on a server that excludes them
then; ``tool_choice`` is not checked against the server's tool flags as a
chat's is. A last item with status ``in_progress`` or ``incomplete`` is
continued (``continue_final_message``, no generation prompt). The rendered
text is tokenized **with** the tokenizer's special tokens (a Responses
request, unlike a chat, has no ``add_special_tokens`` and vLLM's default is
true: a template that writes BOS gets a second one).

Not rendered, so refused: ``previous_response_id`` (the history lives in the
server's response store; send it in ``input``), tool types other than
``function`` (namespaces and custom tools become functions by rules kvindex
does not restate), and item types without a chat message (files, images,
built-in tool calls).
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.engines.rendering import (
    ChatCall,
    ChatMessage,
    ChatTool,
    PromptRefused,
    ResponsesRequest,
    ToolFunction,
    ToolServing,
)
from indexer.engines.vllm.render import TemplateTraits, conversation_call, thinking_flags
from indexer.engines.vllm.tools import tool_dicts

_OPEN = ("in_progress", "incomplete")


def responses_call(
    request: ResponsesRequest, traits: TemplateTraits, serving: ToolServing
) -> ChatCall:
    """The conversation and kwargs vLLM renders a Responses request with."""
    messages = _messages(request)
    continued = _continues(request.input)
    flags = {"add_generation_prompt": not continued, "continue_final_message": continued}
    kwargs = request.chat_template_kwargs
    flags |= thinking_flags(request.reasoning_effort, kwargs)
    tools = _tools(request, serving)
    try:
        return conversation_call(messages, kwargs, flags, tools, traits, True)
    except PromptRefused as e:  # named after the chat the items became
        if not e.field.startswith("messages"):
            raise
        raise PromptRefused("input", f"as the chat it renders as, {e}", e.status) from None


def _tools(request: ResponsesRequest, serving: ToolServing) -> list[dict[str, Any]] | None:
    given = request.tools or []
    for i, tool in enumerate(given):
        if tool.get("type") != "function":
            raise PromptRefused(
                f"tools[{i}].type",
                f"{str(tool.get('type'))[:40]!r} is not supported: kvindex renders"
                " function tools only",
            )
    if not given or (request.tool_choice == "none" and serving.exclude_tools_when_tool_choice_none):
        return None
    try:
        functions = [
            ChatTool(function=msgspec.convert(_without(t, "type"), ToolFunction)) for t in given
        ]
    except msgspec.ValidationError as e:
        raise PromptRefused("tools", str(e), 422) from None
    return tool_dicts(functions)


def _without(item: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != key}


def _continues(given: str | list[dict[str, Any]]) -> bool:
    """Whether the last input item is an unfinished message or reasoning, to continue."""
    if isinstance(given, str) or not given:
        return False
    last = given[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _OPEN


def _messages(request: ResponsesRequest) -> list[ChatMessage]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for i, item in enumerate(request.input):
            message = _message(i, item, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
    try:
        return msgspec.convert(messages, list[ChatMessage])
    except msgspec.ValidationError as e:
        raise PromptRefused("input", str(e), 422) from None


def _message(i: int, item: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any] | None:
    """Item ``i`` as a new chat message, or None where it went into ``before``."""
    assistant = before if before is not None and before.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": _field(i, item, "call_id"),
            "function": {
                "name": _field(i, item, "name"),
                "arguments": _field(i, item, "arguments"),
            },
            "type": "function",
        }
        if item.get("namespace"):
            raise PromptRefused(
                f"input[{i}].namespace", "is not supported: kvindex renders plain functions"
            )
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        return _reasoning(i, item, assistant)
    role = item.get("role")
    if role == "assistant":
        text = _assistant_text(item.get("content"))
        if text is None:
            return dict(item)  # a copy: a later item may add to it
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    if role is not None:
        return dict(item)
    raise PromptRefused(f"input[{i}].type", f"{str(kind)[:40]!r} is not supported")


def _assistant_text(content: Any) -> str | None:
    """An assistant item's text: a string, or its first part's (vLLM keeps no other)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _reasoning(
    i: int, item: dict[str, Any], assistant: dict[str, Any] | None
) -> dict[str, Any] | None:
    if item.get("encrypted_content"):
        raise PromptRefused(f"input[{i}].encrypted_content", "is not supported")
    parts = item.get("content") or item.get("summary") or []
    first = parts[0] if isinstance(parts, list) and parts else {}
    text = first.get("text", "") if isinstance(first, dict) else ""
    if assistant is not None and assistant.get("reasoning") is None:
        assistant["reasoning"] = text
        return None
    return {"role": "assistant", "reasoning": text}


def _field(i: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise PromptRefused(f"input[{i}].{name}", "must be a string", 422)
    return value
