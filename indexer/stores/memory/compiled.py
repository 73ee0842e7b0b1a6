"""Which core the embedded store runs: the compiled tables, else the reference.

The holder index, its prefix walk and the per-rank refcount tables are a Cython
module built at install time (``_holders``); :mod:`indexer.stores.memory.holders`
and plain dicts are the pure-Python reference it must equal
(``tests/test_compiled_core.py``). Without the build the store still answers
exactly, through the reference, only many times slower and larger, so a missing
build is said loudly: every role warns on start (:func:`warn_if_unavailable`) and
``/stats`` reports :func:`status`. ``tests/test_compiled_core.py`` fails the run
when the build is missing, so CI always tests the compiled core.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib import import_module
from types import ModuleType
from typing import NamedTuple

from indexer.core.events import BlockHash
from indexer.core.residency import TierTable
from indexer.stores.memory.holders import HolderIndex
from indexer.stores.memory.residency import IndexedResidency

log = logging.getLogger("kvindex.native")


def _import_core() -> tuple[ModuleType | None, str | None]:
    # by name: an import of the package itself would close a loop through its __init__
    try:
        return import_module("indexer.stores.memory._holders"), None
    except ImportError as error:
        return None, f"{type(error).__name__}: {error}"


#: The compiled tables' module, or None when it did not build or load.
core, IMPORT_ERROR = _import_core()
AVAILABLE: bool = core is not None


class CompiledResidency(IndexedResidency):
    """A rank's residency whose count tables are compiled (``hash -> refcount`` in
    16-byte slots: no Python int per hash held); counted by the same rules."""

    def new_table(self) -> TierTable:
        return TierTable(core.CountTable())

    def added(self, counts, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        return counts.add(hashes)

    def dropped(self, counts, hashes: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        return counts.drop(hashes)


class StoreCore(NamedTuple):
    """What a MemoryStore is built of: its holder index and its ranks' residency."""

    index: Callable[[], object]
    residency: type[IndexedResidency]


#: The pure-Python reference: the holder index of :mod:`~indexer.stores.memory.holders`
#: and dict counts.
REFERENCE = StoreCore(HolderIndex, IndexedResidency)
#: The core a MemoryStore runs by default: the compiled one when it built.
CORE = StoreCore(core.HolderIndex, CompiledResidency) if core is not None else REFERENCE


def status() -> dict[str, bool | str | None]:
    """Whether the embedded store's compiled core is in use, and the import error."""
    return {"compiled_core": AVAILABLE, "compiled_core_error": IMPORT_ERROR}


def warn_if_unavailable(role: str) -> bool:
    """Log a WARNING when the compiled tables are missing; True if they are in use."""
    if not AVAILABLE:
        log.warning(
            "compiled holder index not in use: the embedded store runs its pure-Python "
            "reference, many times slower; reinstall with a C compiler (pip install -e .)",
            extra={"role": role, "import_error": IMPORT_ERROR},
        )
    return AVAILABLE
