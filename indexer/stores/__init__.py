"""Stores: where residency counts live. One protocol, several backends."""

from indexer.stores.base import (
    ApplyResult,
    Residency,
    Store,
    StoreUnavailable,
    Watermark,
)
from indexer.stores.memory import MemoryStore

__all__ = ["ApplyResult", "MemoryStore", "Residency", "Store", "StoreUnavailable", "Watermark"]
