"""Which core the embedded store runs: the compiled holder index, else the core's rule.

The holder index, its prefix walk and the per-rank refcount tables are Cython
modules built at install time, one job each (keys, tables, holder sets, the walk,
the hybrid rule, answers), behind ``_holders``. The reference they must equal is
:mod:`indexer.core`'s own: each rank's :class:`~indexer.core.residency.RankResidency`
walked by :meth:`~indexer.core.residency.RankResidency.match`
(``tests/test_compiled_core.py``). Without the build the store runs that reference
(:data:`REFERENCE`): exact, only many times slower and larger, so a missing build
is said loudly: every role warns on start (``PART.warn_if_unavailable``) and
``/stats`` reports ``PART.status()``. ``tests/test_compiled_core.py`` fails the run
when the build is missing, so CI always tests the compiled core.
"""

from __future__ import annotations

from types import ModuleType

from indexer.compiled import CompiledModule

PART = CompiledModule(
    "indexer.stores.memory._holders",
    "compiled holder index not in use: the embedded store walks each rank by the "
    "core's rule, many times slower; reinstall with a C compiler (pip install -e .)",
)
#: The compiled tables' module, or None when it did not build or load.
core = PART.module

#: What a MemoryStore runs: the compiled module, or None for the core's rule rank by rank.
StoreCore = ModuleType | None
REFERENCE: StoreCore = None
#: The core a MemoryStore runs by default: the compiled one when it built.
CORE: StoreCore = core
