"""What vLLM reads off a chat template before rendering with it.

Three traits decide how a conversation is handed to the template
(:class:`~indexer.engines.vllm.render.TemplateTraits`):

- Content format. vLLM looks for a loop over a message's content in the
  template's syntax tree: ``for m in messages`` (or over a variable assigned
  from ``messages``, a slice or a filter of it) and then ``for c in
  m['content']`` / ``m.content``, or any loop over a variable named
  ``content``. Found: the template gets content as a list of typed parts
  ("openai"); not found: as one string ("string").
- Developer role: supported only if the template text holds ``'developer'``
  or ``"developer"``.
- Accepted kwargs: the template's undeclared variables, plus the named
  parameters of the tokenizer's ``apply_chat_template``.

The syntax tree comes from the caller (parsed by the same Jinja environment
transformers renders with), so this module needs only jinja2's node types.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from jinja2 import meta, nodes

from indexer.engines.vllm.render import TemplateTraits, accepted_kwargs


def template_traits(
    source: str, tree: nodes.Template, call_parameters: Collection[str]
) -> TemplateTraits:
    """The traits of the template ``source``, parsed as ``tree``."""
    fmt = "openai" if next(_content_loops(tree), None) is not None else "string"
    knows_developer = "'developer'" in source or '"developer"' in source
    variables = meta.find_undeclared_variables(tree)
    return TemplateTraits(fmt, knows_developer, accepted_kwargs(variables, call_parameters))


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` reads variable ``name`` (or its item/attribute ``key``),
    through filters, tests and slices."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return (
            _reads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        )
    if isinstance(node, nodes.Getattr):
        return _reads(node.node, name) and node.attr == key
    return False


def _aliases(tree: nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (transitively)."""
    found, pending = [name], [name]
    while pending:
        current = pending.pop(0)
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if _reads(assign.node, current) and isinstance(target, nodes.Name):
                found.append(target.name)
                if target.name != current:
                    pending.append(target.name)
    return found


def _loop_targets(tree: nodes.Template, sources: list[str], key: str | None) -> Iterator[str]:
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(
            _reads(loop.iter, source, key) for source in sources
        ):
            yield loop.target.name


def _content_loops(tree: nodes.Template) -> Iterator[str]:
    messages = list(_loop_targets(tree, _aliases(tree, "messages"), None))
    yield from _loop_targets(tree, messages, "content")
    for loop in tree.find_all(nodes.For):  # a bare ``for c in content``, no filter
        if isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            yield "content"
