"""A compiled part of kvindex: a Cython module built at install time.

Each compiled part has a pure-Python reference that answers the same, only
many times slower, so a failed build never stops kvindex, and for that very
reason must never pass unnoticed: every role warns on start
(:meth:`CompiledModule.warn_if_unavailable`) and ``/stats`` reports
:func:`combined` over all parts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib import import_module
from types import ModuleType

log = logging.getLogger("kvindex.native")

Status = dict[str, bool | str | None]


class CompiledModule:
    """The module ``name`` if it imports, else why not.

    ``missing`` is the warning's sentence: what runs instead and how to get the
    build (it differs per part: the headers each needs, how much slower it is).
    """

    def __init__(self, name: str, missing: str) -> None:
        self.name, self._missing = name, missing
        try:
            self.module: ModuleType | None = import_module(name)
            self.error: str | None = None
        except ImportError as error:
            self.module, self.error = None, f"{type(error).__name__}: {error}"

    @property
    def available(self) -> bool:
        return self.module is not None

    def status(self) -> Status:
        """``compiled_core``: whether it is in use; ``compiled_core_error``: why not."""
        return {"compiled_core": self.available, "compiled_core_error": self.error}

    def warn_if_unavailable(self, role: str) -> bool:
        """Log a WARNING when the module is missing; True if it is in use."""
        if not self.available:
            log.warning(self._missing, extra={"role": role, "import_error": self.error})
        return self.available


def combined(statuses: Iterable[Status]) -> Status:
    """Several parts as one: in use when every one is; the errors of those that are not."""
    statuses = list(statuses)
    errors = [e for s in statuses if (e := s["compiled_core_error"])]
    return {
        "compiled_core": all(s["compiled_core"] for s in statuses),
        "compiled_core_error": "; ".join(errors) or None,
    }
