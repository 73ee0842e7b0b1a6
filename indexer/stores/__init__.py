"""Stores: where residency counts live. One protocol, several backends."""

from indexer.stores.base import (
    ApplyResult,
    Loss,
    Residency,
    Store,
    StoreLost,
    StoreUnavailable,
    Watermark,
)
from indexer.stores.memory import MemoryStore

__all__ = [
    "ApplyResult",
    "Loss",
    "MemoryStore",
    "Residency",
    "Store",
    "StoreLost",
    "StoreUnavailable",
    "Watermark",
]
