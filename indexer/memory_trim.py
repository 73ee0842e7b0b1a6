"""Freed memory handed back to the system.

glibc's allocator keeps the pages of freed blocks for the process: a heap
freed out of order (request heads that left in any order, a rank's tables
dropped at once) cannot shrink from its top, so without a trim RSS stays at
its peak after the memory is free. Elsewhere (no glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def return_freed_memory() -> None:
    """Have glibc give freed heap pages back to the system (``malloc_trim(0)``)."""
    trim = _trim()
    if trim is not None:
        trim(0)
