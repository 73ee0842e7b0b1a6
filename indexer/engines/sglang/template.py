"""How SGLang 0.5.23 reads a chat template (:func:`template_traits`); it needs jinja2, part
of the optional ``tokenize`` extra, so the renderer imports it on first use."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from jinja2 import nodes

from indexer.engines.sglang.render import TemplateTraits

_MEDIA_WORDS = ("image", "audio", "video", "vision")
_CONTENT_OWNERS = ("message", "msg", "m")


def template_traits(source: str, tree: Any, call_parameters: Collection[str]) -> TemplateTraits:
    """SGLang's reading of a template: media words, else a loop over a message's content."""
    if any(word in source for word in _MEDIA_WORDS):
        return TemplateTraits("openai")
    loops = tree.find_all(nodes.For) if tree is not None else ()
    if any(_reads_content(loop.iter) for loop in loops):
        return TemplateTraits("openai")
    return TemplateTraits("string")


def _reads_content(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads_content(node.node)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads_content(node.node)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        owner, key = node.node, node.arg.value
    elif isinstance(node, nodes.Getattr):
        owner, key = node.node, node.attr
    else:
        return False
    return key == "content" and isinstance(owner, nodes.Name) and owner.name in _CONTENT_OWNERS
