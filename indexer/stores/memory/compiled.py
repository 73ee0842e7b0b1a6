"""Which core the embedded store runs: the compiled tables, else the reference.

The holder index, its prefix walk and the per-rank refcount tables are Cython
modules built at install time, one job each (keys, tables, holder sets, the walk,
the hybrid rule, answers), behind ``_holders``; :mod:`indexer.stores.memory.holders`
and plain dicts are the pure-Python reference it must equal
(``tests/test_compiled_core.py``). Without the build the store still answers
exactly, through the reference, only many times slower and larger, so a missing
build is said loudly: every role warns on start (``PART.warn_if_unavailable``) and
``/stats`` reports ``PART.status()``. ``tests/test_compiled_core.py`` fails the run
when the build is missing, so CI always tests the compiled core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from indexer.compiled import CompiledModule
from indexer.core.events import BlockHash
from indexer.core.residency import TierTable
from indexer.stores.memory.holders import HolderIndex
from indexer.stores.memory.residency import IndexedResidency

PART = CompiledModule(
    "indexer.stores.memory._holders",
    "compiled holder index not in use: the embedded store runs its pure-Python "
    "reference, many times slower; reinstall with a C compiler (pip install -e .)",
)
#: The compiled tables' module, or None when it did not build or load.
core = PART.module


class CompiledResidency(IndexedResidency):
    """A rank's residency whose count tables are compiled (``hash -> refcount`` in
    12-byte slots: no Python int per hash held); counted by the same rules."""

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
