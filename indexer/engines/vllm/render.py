"""vLLM 0.33.0's OpenAI front end: what a completions or chat request hands its tokenizer.

Routers hold OpenAI bodies, not token ids. A block hash matches only if
kvindex feeds the tokenizer exactly what vLLM's renderer feeds it, so the
rules of that renderer are restated here, separate from any tokenizer:

Completions (``prompt``): a string is tokenized with ``add_special_tokens``
(default True: a BOS for tokenizers whose post-processor adds one, even
after a literal BOS in the text); a list of token ids is the prompt as it
is; an empty prompt is refused.

Chat (``messages``): ``add_generation_prompt`` defaults to True,
``continue_final_message`` to False and ``add_special_tokens`` to False
(the template writes its own BOS). ``continue_final_message`` is refused
unless ``add_generation_prompt`` is false (set or defaulted true,
transformers refuses the pair). The request's flags (and ``documents``,
``reasoning_effort``) override the same keys in ``chat_template_kwargs``
unless they are null; a kwarg left null or ``"auto"`` is dropped, a
``tools`` kwarg replaces the request's tools (:mod:`.tools`), and
``chat_template``/``tokenize`` are refused; kwargs neither the template nor
``apply_chat_template`` names are dropped. Each message becomes a
conversation entry: string content is one text part, null content none;
for a template that reads content as a string the text parts are joined
with ``"\\n"``, for one that loops over content items they stay a list of
``{"type": "text", "text": ...}``. A system text part whose first line
starts with ``x-anthropic-billing-header`` loses that line (its value
changes on every request and would defeat the prefix cache). When a
template never names the ``developer`` role, developer messages become
system messages and, if a system message is then not alone at the front,
all system contents are merged with ``"\\n\\n"`` into one first message.
An assistant's ``tool_calls`` reach the template with their ``arguments``
parsed from JSON (an empty list of calls is dropped).
The rendered text is then tokenized like a completion string.

Only text is rendered: image, audio and other media parts are refused
(400, as vLLM refuses a part type it cannot take), because their placeholder
tokens and hashes depend on the model's processor.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from indexer.engines.rendering import (
    ChatCall,
    ChatMessage,
    ChatOptions,
    PromptRefused,
    ToolServing,
)
from indexer.engines.vllm.tools import chat_tool_dicts

#: How a chat template reads a message's content: one string, or a list of typed parts.
ContentFormat = Literal["string", "openai"]

#: Content part types vLLM reads as text, and the field each keeps its text in.
TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: A text part's fields that are not passed on as the part's extra fields.
_PART_FIELDS = {"type", "uuid", *TEXT_PART_FIELDS.values()}
_BILLING_HEADER = "x-anthropic-billing-header"
#: vLLM's own texts for the refusals a router is likely to meet, so logs read alike.
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
#: Template kwargs a request may not set: kvindex (as vLLM) decides them.
RESERVED_KWARGS = ("chat_template", "tokenize")


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What the renderer reads off a chat template once, when it is loaded."""

    content_format: ContentFormat
    #: Whether the template names the developer role (else developer becomes system).
    knows_developer: bool
    #: Every kwarg the template or the tokenizer's ``apply_chat_template`` accepts.
    accepted_kwargs: frozenset[str]


def completion_input(prompt: str | list[int]) -> str | list[int]:
    """The text to tokenize, or the token ids as given; refuses an empty prompt."""
    if len(prompt) == 0:
        raise PromptRefused("prompt", EMPTY_PROMPT)
    return prompt


def completion_special_tokens(add_special_tokens: bool | None) -> bool:
    """Completions add the tokenizer's special tokens unless told not to."""
    return True if add_special_tokens is None else add_special_tokens


def chat_call(
    messages: list[ChatMessage], options: ChatOptions, traits: TemplateTraits, serving: ToolServing
) -> ChatCall:
    """The conversation and kwargs vLLM renders a chat request with, or :class:`PromptRefused`."""
    generation = True if options.add_generation_prompt is None else options.add_generation_prompt
    if generation and options.continue_final_message:
        raise PromptRefused(
            "continue_final_message",
            "cannot be true while add_generation_prompt is (it defaults to true: set it"
            " false): continue the final message or start a new assistant message, not both",
        )
    flags = {
        "add_generation_prompt": generation,
        "continue_final_message": bool(options.continue_final_message),
        "documents": options.documents,
    }
    return conversation_call(
        messages,
        options.chat_template_kwargs,
        flags | thinking_flags(options.reasoning_effort, options.chat_template_kwargs),
        chat_tool_dicts(options, serving),
        traits,
        bool(options.add_special_tokens),
    )


def thinking_flags(effort: str | None, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's reasoning effort as template kwargs: the effort itself and, unless
    the request's kwargs set it, ``enable_thinking`` (templates that must be told to
    think read that one)."""
    flags: dict[str, Any] = {"reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in (kwargs or {}):
        flags["enable_thinking"] = effort != "none"
    return flags


def conversation_call(
    messages: list[ChatMessage],
    request_kwargs: Mapping[str, Any] | None,
    flags: Mapping[str, Any],
    tools: list[dict[str, Any]] | None,
    traits: TemplateTraits,
    add_special_tokens: bool,
) -> ChatCall:
    """The render of ``messages`` with the request's ``chat_template_kwargs`` under the
    request's own ``flags``, over ``tools``: what chat and Responses requests share.

    Each layer overrides the one below except with None or ``"auto"`` (vLLM reads
    those as "not set"), so a template kwarg left at one of them is dropped, and a
    ``tools`` kwarg replaces the request's tools."""
    kwargs = dict(request_kwargs or {})
    reserved = sorted(set(RESERVED_KWARGS) & kwargs.keys())
    if reserved:
        raise PromptRefused(
            "chat_template_kwargs", f"may not set {', '.join(reserved)} (the server decides them)"
        )
    kwargs = _over({"tools": tools}, _over(kwargs, flags))
    tools = kwargs.pop("tools")
    kwargs = {k: v for k, v in kwargs.items() if k in traits.accepted_kwargs}
    conversation = [
        _conversation_entry(i, m, traits.content_format) for i, m in enumerate(messages)
    ]
    if not traits.knows_developer and any(m["role"] == "developer" for m in conversation):
        conversation = _merge_system(list(map(_developer_as_system, conversation)))
    return ChatCall(conversation, tools, kwargs, add_special_tokens)


def _over(below: Mapping[str, Any], above: Mapping[str, Any]) -> dict[str, Any]:
    return {**below, **{k: v for k, v in above.items() if v is not None and v != "auto"}}


def _conversation_entry(i: int, message: ChatMessage, fmt: ContentFormat) -> dict[str, Any]:
    role = message.role
    parts = _text_parts(i, message)
    if role == "system":
        parts = _without_billing_header(parts)
    content: str | list[dict[str, Any]]
    if fmt == "string":  # an empty text adds no line: vLLM drops it before joining
        content = "\n".join(text for text, _, _ in parts if text)
    elif role == "tool":  # vLLM flattens a tool result made of text parts
        content = "\n".join(text for text, _, _ in parts)
    else:
        content = [{"type": "text", "text": text, **extras} for text, extras, _ in parts]
    entry: dict[str, Any] = {"role": role, "content": content}
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if role == "assistant":
        if message.tool_calls:  # an empty list is dropped
            entry["tool_calls"] = [
                _tool_call(f"messages[{i}].tool_calls[{j}]", call)
                for j, call in enumerate(message.tool_calls)
            ]
        if reasoning is not None:
            entry["reasoning"] = entry["reasoning_content"] = reasoning
    elif role == "tool" and message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    if message.task is not None:
        entry["task"] = message.task
    if role == "developer":
        entry["tools"] = message.tools
    return entry


def _tool_call(where: str, call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call as vLLM hands it to the template: ``id``, ``function``
    (``arguments``, ``name``), ``type``, then any other fields, its ``arguments`` parsed
    from their JSON string (empty, malformed or non-object arguments become ``{}``:
    vLLM coerces them, so that a bad call in the history fails no later turn). vLLM
    refuses a call without a string ``id``, ``name`` and ``arguments`` or of another
    type than ``function``."""
    function = call.get("function")
    if not isinstance(function, dict) or call.get("type") != "function":
        raise PromptRefused(where, "must be of type function, with a function")
    for field, value in (("id", call.get("id")), *((f, function.get(f)) for f in _CALLED)):
        if not isinstance(value, str):
            name = field if field == "id" else f"function.{field}"
            raise PromptRefused(f"{where}.{name}", "must be a string")
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    except ValueError:
        arguments = {}
    called = {"arguments": arguments if isinstance(arguments, dict) else {}}
    called |= {k: v for k, v in function.items() if k != "arguments"}
    made = {"id": call["id"], "function": called, "type": "function"}
    return made | {k: v for k, v in call.items() if k not in made}


#: A tool call's function fields, in vLLM's order.
_CALLED = ("arguments", "name")


#: A text part: its text, its extra fields, and whether it is a plain text part
#: (a string, or of type ``text``: the only parts the billing header is cut from).
_Part = tuple[str, dict[str, Any], bool]


def _text_parts(i: int, message: ChatMessage) -> list[_Part]:
    """The message's text parts in order, each with its extra fields; a part with no
    text is skipped, as vLLM does."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, {}, True)]
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append((part, {}, True))
            continue
        kind = part.get("type")
        field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if field is None:
            raise PromptRefused(
                f"messages[{i}].content[{j}].type",
                f"{str(kind)[:40]!r} is not supported: kvindex renders text parts only"
                f" ({', '.join(TEXT_PART_FIELDS)})",
            )
        text = part.get(field)
        if text is not None:
            if not isinstance(text, str):
                raise PromptRefused(f"messages[{i}].content[{j}].{field}", "must be a string", 422)
            extras = {k: v for k, v in part.items() if k not in _PART_FIELDS}
            parts.append((text, extras, kind == "text"))
    return parts


def _without_billing_header(parts: list[_Part]) -> list[_Part]:
    kept = []
    for text, extras, plain in parts:
        if plain and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        kept.append((text, extras, plain))
    return kept


def _developer_as_system(entry: dict[str, Any]) -> dict[str, Any]:
    if entry["role"] != "developer":
        return entry
    entry = {**entry, "role": "system"}
    entry.pop("tools", None)
    return entry


def _merge_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One system message at the front holding every system content, when there is
    more than one or one not first; untouched otherwise."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, entry in enumerate(conversation):
        if entry["role"] != "system":
            others.append(entry)
            continue
        merge = merge or i > 0 or bool(contents)
        content = entry.get("content", "")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        if content:
            contents.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def accepted_kwargs(
    template_variables: Collection[str], call_parameters: Collection[str]
) -> frozenset[str]:
    """The kwargs a render passes on: the template's free variables and the named
    parameters of ``apply_chat_template``; any other key is dropped silently, as vLLM does."""
    return (frozenset(template_variables) | frozenset(call_parameters)) - set(RESERVED_KWARGS)
