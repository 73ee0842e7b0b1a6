"""vLLM 0.33.0's rules for a chat request's ``tools`` and ``tool_choice``.

The tool definitions are part of the prompt (the template writes them), so
which tools the template sees, and in what shape, decides the tokens:

- ``tool_choice`` defaults to ``"auto"`` when there are tools (``"none"``
  otherwise). vLLM refuses ``tools: []``, a choice other than ``"none"``
  without tools, and a named function not among them; and, by its server's
  tool flags (:class:`~indexer.engines.rendering.ToolServing`), ``"auto"``
  without ``--enable-auto-tool-choice`` and a ``--tool-call-parser``, and
  ``"required"`` or a named function without a parser.
- The template sees no tools when there are none, or when the choice is
  ``"none"`` on a server started with ``--exclude-tools-when-tool-choice-none``.
- Each tool is serialised as vLLM's request model dumps it: ``type`` and
  ``function`` with ``name``, ``description`` and ``parameters`` always
  (null when not given), ``strict`` and ``defer_loading`` only when given
  (a tool's own ``defer_loading`` copied into its function unless that sets
  one), any other field dropped.

vLLM 0.34 treats ``tools: []`` as no tools (``"auto"``/``"required"`` then
``"none"``); 0.33 refuses it. ``ChatOptions.empty_tools_served`` says which: true
when every engine a query asks about serves it (``EngineSpec.serves_empty_tools``).
"""

from __future__ import annotations

from typing import Any

from indexer.engines.rendering import (
    ChatOptions,
    ChatTool,
    NamedToolChoice,
    PromptRefused,
    ToolServing,
)


def chat_tool_dicts(options: ChatOptions, serving: ToolServing) -> list[dict[str, Any]] | None:
    """The tools a chat request hands its template, after vLLM's checks of ``tools``
    and ``tool_choice`` against each other and against the server's tool flags."""
    tools, choice = options.tools, options.tool_choice
    if tools == []:
        if not options.empty_tools_served:
            raise PromptRefused(
                "tools",
                "must not be an empty array: give at least one tool or leave the field out",
            )
        tools = None  # no tools: "auto" and "required" are then "none"
        choice = "none" if choice in ("auto", "required") else choice
    if choice is None and tools:
        choice = "auto"  # vLLM's default with tools (and "none" without)
    if isinstance(choice, NamedToolChoice):
        if not choice.function.name:
            raise PromptRefused("tool_choice.function.name", "must be a non-empty string")
        if tools is None or choice.function.name not in {t.function.name for t in tools}:
            raise PromptRefused(
                "tool_choice", f"names {choice.function.name!r}, which is not one of the tools"
            )
    elif choice not in (None, "none") and tools is None:
        raise PromptRefused("tool_choice", "needs tools: set tools too")
    if serving.tool_call_parser is None and choice not in (None, "none"):
        if choice == "auto" and not serving.enable_auto_tool_choice:
            raise PromptRefused(
                "tool_choice",
                '"auto" needs the server started with --enable-auto-tool-choice and'
                " --tool-call-parser (this model's enable_auto_tool_choice and"
                " tool_call_parser in kvindex's config)",
            )
        if choice != "auto":
            raise PromptRefused(
                "tool_choice",
                "other than auto or none needs the server started with --tool-call-parser"
                " (this model's tool_call_parser in kvindex's config)",
            )
    if tools is None or (choice == "none" and serving.exclude_tools_when_tool_choice_none):
        return None
    return tool_dicts(tools)


def tool_dicts(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """Tools as the template sees them: description and parameters always present (null
    when not given), ``strict`` and ``defer_loading`` only when given, a tool's own
    ``defer_loading`` copied into its function unless that sets one."""
    dicts = []
    for tool in tools:
        f = tool.function
        function = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            function["strict"] = f.strict
        defer = f.defer_loading if f.defer_loading is not None else tool.defer_loading
        if defer is not None:
            function["defer_loading"] = defer
        entry: dict[str, Any] = {"type": tool.type, "function": function}
        if tool.defer_loading is not None:
            entry["defer_loading"] = tool.defer_loading
        dicts.append(entry)
    return dicts
