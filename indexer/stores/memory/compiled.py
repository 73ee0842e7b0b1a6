"""Which holder index the embedded store runs: the compiled one, else the reference.

The holder index and its prefix walk are a Cython module built at install time
(``_holders``); :mod:`indexer.stores.memory.holders` is the pure-Python reference
it must equal (``tests/test_compiled_core.py``). Without the build the store still
answers exactly, through the reference, only many times slower, so a missing build
is said loudly: every role warns on start (:func:`warn_if_unavailable`) and
``/stats`` reports :func:`status`. ``tests/test_compiled_core.py`` fails the run
when the build is missing, so CI always tests the compiled index.
"""

from __future__ import annotations

import logging
from types import ModuleType

from indexer.stores.memory import holders

log = logging.getLogger("kvindex.native")


def _import_core() -> tuple[ModuleType | None, str | None]:
    try:
        from indexer.stores.memory import _holders
    except ImportError as error:
        return None, f"{type(error).__name__}: {error}"
    return _holders, None


#: The compiled holder index module, or None when it did not build or load.
core, IMPORT_ERROR = _import_core()
AVAILABLE: bool = core is not None
#: The holder index a MemoryStore builds by default.
HolderIndex: type = core.HolderIndex if core is not None else holders.HolderIndex


def status() -> dict[str, bool | str | None]:
    """Whether the compiled holder index is in use, and the import error."""
    return {"compiled_core": AVAILABLE, "compiled_core_error": IMPORT_ERROR}


def warn_if_unavailable(role: str) -> bool:
    """Log a WARNING when the compiled holder index is missing; True if it is in use."""
    if not AVAILABLE:
        log.warning(
            "compiled holder index not in use: the embedded store runs its pure-Python "
            "reference, many times slower; reinstall with a C compiler (pip install -e .)",
            extra={"role": role, "import_error": IMPORT_ERROR},
        )
    return AVAILABLE
