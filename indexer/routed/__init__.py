"""Routed entries beside the exact store: embedded and Redis, behind one protocol.

:class:`~indexer.routed.base.RoutedEntries` is what the API and the ingest
layer need of them; :mod:`indexer.routed.conformance` holds every
implementation to the same answers.
"""

from indexer.routed.base import RoutedEntries
from indexer.routed.memory import MemoryRouted
from indexer.routed.redis import RedisRouted

__all__ = ["MemoryRouted", "RedisRouted", "RoutedEntries"]
