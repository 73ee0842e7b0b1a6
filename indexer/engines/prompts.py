"""The OpenAI request shapes a prompt arrives in, and what an engine's renderer does with them.

A completions ``prompt`` or a chat's ``messages`` is the same input whatever
engine serves the model; how it becomes the text (or token ids) the tokenizer
reads is the engine's server's rule, so each adapter brings a
:class:`Renderer` and :mod:`indexer.prompts` asks the model's.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

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


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The request's chat flags as sent (None: not set, the engine's default applies)."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ChatCall:
    """The arguments of the one ``apply_chat_template(tokenize=False)`` call."""

    conversation: list[dict[str, Any]]
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

    def chat_call(self, messages: list[ChatMessage], options: ChatOptions, traits: Any) -> ChatCall:
        """The conversation and kwargs the server renders ``messages`` with."""


class ModuleRenderer:
    """An engine's :class:`Renderer` from its render module, whose template reader lives
    in another module imported on first use: it needs jinja2, part of the optional
    ``tokenize`` extra, which producers and ingest do without."""

    def __init__(self, render: ModuleType, template_module: str) -> None:
        self.completion_input = render.completion_input
        self.completion_special_tokens = render.completion_special_tokens
        self.chat_call = render.chat_call
        self._template_module = template_module

    def template_traits(self, source: str, tree: Any, call_parameters: Collection[str]) -> Any:
        reader = importlib.import_module(self._template_module)
        return reader.template_traits(source, tree, call_parameters)
