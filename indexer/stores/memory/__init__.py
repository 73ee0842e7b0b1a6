"""The embedded store: exact refcounts per rank and a shared holder index, in process."""

from indexer.stores.memory.store import MemoryStore

__all__ = ["MemoryStore"]
