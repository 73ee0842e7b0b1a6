"""Whether kvindex runs its compiled core, and if not, why.

The core's hot paths are Cython modules built at install time. Without
them kvindex still answers correctly through the pure-Python reference,
only many times slower, so a missing build must be visible: every role
warns on start (:func:`warn_if_unavailable`) and ``/stats`` reports
:func:`status`. ``tests/test_native.py`` fails the run when the build is
missing, so CI always tests the compiled core.
"""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger("kvindex.native")


def _import_core() -> tuple[ModuleType | None, str | None]:
    try:
        from indexer.engines.vllm import _chainhash
    except ImportError as error:
        return None, f"{type(error).__name__}: {error}"
    return _chainhash, None


#: The compiled token-chain hashing module, or None when it did not build or load.
chainhash, IMPORT_ERROR = _import_core()
AVAILABLE: bool = chainhash is not None


def status() -> dict[str, bool | str | None]:
    """What ``/stats`` reports: whether the compiled core is in use, and the import error."""
    return {"compiled_core": AVAILABLE, "compiled_core_error": IMPORT_ERROR}


def warn_if_unavailable(role: str) -> bool:
    """Log a WARNING when the compiled core is missing; True if it is in use."""
    if not AVAILABLE:
        log.warning(
            "compiled core not in use: kvindex runs its pure-Python reference, many times "
            "slower; reinstall with a C compiler and OpenSSL headers (pip install -e .)",
            extra={"role": role, "import_error": IMPORT_ERROR},
        )
    return AVAILABLE
