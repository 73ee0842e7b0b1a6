"""The engine adapters kvindex has, by name: every package under :mod:`indexer.engines`
with an ``adapter`` module whose ``ADAPTER`` is an
:class:`~indexer.engines.base.EngineAdapter` named as its package.

Found by listing the packages, not by a list kept here, so adding an engine
type is adding its package, and no adapter imports another.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil

import indexer.engines
from indexer.compiled import Status
from indexer.engines.base import CompiledPart, EngineAdapter
from indexer.engines.rendering import Renderer

DEFAULT = "vllm"


@functools.cache
def names() -> tuple[str, ...]:
    """Every adapter's name, sorted (the packages are listed, not imported)."""
    found = []
    for module in pkgutil.iter_modules(indexer.engines.__path__):
        adapter_module = f"{indexer.engines.__name__}.{module.name}.adapter"
        if module.ispkg and importlib.util.find_spec(adapter_module) is not None:
            found.append(module.name)
    return tuple(sorted(found))


@functools.cache
def adapter(name: str) -> EngineAdapter:
    """The adapter called ``name`` (ValueError naming the known ones if there is none)."""
    if name not in names():
        raise ValueError(f"unknown engine adapter {name!r}; expected one of {names()}")
    found = importlib.import_module(f"{indexer.engines.__name__}.{name}.adapter").ADAPTER
    if found.name != name:
        raise RuntimeError(f"the adapter of package {name!r} calls itself {found.name!r}")
    return found


def hash_algos() -> tuple[str, ...]:
    """Every algorithm some adapter reproduces, in first-seen order (for schemas)."""
    return tuple(dict.fromkeys(a for name in names() for a in adapter(name).hash_algos))


def _compiled_parts() -> list[CompiledPart]:
    return [part for name in names() if (part := adapter(name).compiled) is not None]


def compiled_statuses() -> list[Status]:
    """Each adapter's compiled part's status (what ``/stats`` folds into its own)."""
    return [part.status() for part in _compiled_parts()]


def warn_if_unavailable(role: str) -> bool:
    """Warn once per adapter whose compiled part is missing; True if every one is in use."""
    in_use = [part.warn_if_unavailable(role) for part in _compiled_parts()]  # each warns
    return all(in_use)


def renderer(name: str) -> Renderer:
    """The renderer of adapter ``name`` (ValueError if it is unknown or renders nothing)."""
    found = adapter(name).renderer
    if found is None:
        raise ValueError(f"the {name!r} engine adapter does not render prompts")
    return found
