"""Stores: where residency counts live. One protocol, several backends."""

from indexer.stores.base import (
    ApplyResult,
    Fenced,
    Loss,
    Residency,
    Store,
    StoreLost,
    StoreUnavailable,
    Watermark,
    apply_events,
)
from indexer.stores.memory import MemoryStore

__all__ = [
    "ApplyResult",
    "Fenced",
    "Loss",
    "MemoryStore",
    "Residency",
    "Store",
    "StoreLost",
    "StoreUnavailable",
    "Watermark",
    "apply_events",
]
