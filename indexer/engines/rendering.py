"""The OpenAI request shapes a prompt arrives in, and what an engine's renderer does with them.

A completions ``prompt``, a chat's ``messages`` (with its ``tools``) or a
Responses request's ``input`` is the same input whatever engine serves the
model; how it becomes the text (or token ids) the tokenizer reads is the
engine's server's rule, so each adapter brings a :class:`Renderer` and
:mod:`indexer.prompts` asks the model's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

import msgspec


class PromptRefused(ValueError):
    """A prompt field the engine would refuse, or kvindex cannot render: 4xx naming ``field``."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


class ChatMessage(msgspec.Struct, omit_defaults=True):
    """An OpenAI chat message, with the fields an engine's server may pass to the template.

    Other fields are ignored, as servers ignore them; the renderer decides
    which of these (and which of a content part's fields) the template sees.
    """

    role: str
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tools: list[dict[str, Any]] | None = None
    task: str | None = None


class ToolFunction(msgspec.Struct, omit_defaults=True):
    """A function tool's definition, as an OpenAI chat request lists it (other fields
    are ignored, as servers ignore them)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ChatTool(msgspec.Struct, omit_defaults=True):
    """One entry of a chat request's ``tools``: only function tools exist there."""

    function: ToolFunction
    type: Literal["function"] = "function"
    defer_loading: bool | None = None


class ToolName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    """``tool_choice`` naming the one function the model must call."""

    function: ToolName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
#: The reasoning efforts an OpenAI request may ask for ("max": DeepSeek V4's).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The request's chat flags as sent (None: not set, the engine's default applies)."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    #: Whether every engine asked about serves ``tools: []`` as no tools (else refused).
    empty_tools_served: bool = False


@dataclass(frozen=True, slots=True)
class ToolServing:
    """The engine server's own tool settings (its command line, not the request's):
    they decide which ``tool_choice`` it serves and whether ``"none"`` hides the tools."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields of an OpenAI Responses request that shape its prompt. ``input``
    items stay plain objects: which item types exist and how each becomes a chat
    message is the renderer's rule."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChatCall:
    """The arguments of the one ``apply_chat_template(tokenize=False)`` call."""

    conversation: list[dict[str, Any]]
    #: the ``tools`` argument (None: the template sees no tools)
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    add_special_tokens: bool


class Renderer(Protocol):
    """One engine server's rules from an OpenAI request to the tokenizer's input.

    Every method raises :class:`PromptRefused` for what that server refuses.
    """

    def completion_input(self, prompt: str | list[int]) -> str | list[int]:
        """The text to tokenize, or the token ids as given."""

    def completion_special_tokens(self, add_special_tokens: bool | None) -> bool:
        """Whether a completion's text is tokenized with the special tokens."""

    def template_traits(self, source: str, tree: Any, call_parameters: Collection[str]) -> Any:
        """What rendering needs to know of a chat template, read once when it loads:
        its text, its Jinja syntax tree and ``apply_chat_template``'s parameters."""

    def chat_call(
        self, messages: list[ChatMessage], options: ChatOptions, traits: Any, serving: ToolServing
    ) -> ChatCall:
        """The conversation and kwargs the server renders ``messages`` with."""

    def responses_call(
        self, request: ResponsesRequest, traits: Any, serving: ToolServing
    ) -> ChatCall:
        """The conversation and kwargs the server renders a Responses request with."""


class ModuleRenderer:
    """An engine's :class:`Renderer` from its render module, whose template reader lives
    in another module imported on first use: it needs jinja2, part of the optional
    ``tokenize`` extra, which producers and ingest do without."""

    def __init__(
        self,
        render: ModuleType,
        template_module: str,
        responses_call: Callable[[ResponsesRequest, Any, ToolServing], ChatCall] | None = None,
    ) -> None:
        self.completion_input = render.completion_input
        self.completion_special_tokens = render.completion_special_tokens
        self.chat_call = render.chat_call
        self.responses_call = responses_call or _no_responses
        self._template_module = template_module

    def template_traits(self, source: str, tree: Any, call_parameters: Collection[str]) -> Any:
        reader = importlib.import_module(self._template_module)
        return reader.template_traits(source, tree, call_parameters)


def _no_responses(request: ResponsesRequest, traits: Any, serving: ToolServing) -> ChatCall:
    """The Responses rendering of an engine whose server's kvindex does not restate."""
    raise PromptRefused(
        "input", "Responses requests are rendered for vLLM engines only: send messages"
    )
