"""An engine's declared KV groups as one rank's consumer applies its batches.

A rank that joins late may see a group's removals before any store says what
the group is; the declaration is told to the store ahead of the first batch
applied (:meth:`~indexer.core.hybrid.GroupDeclaration.prepended`), and what
events say against it is counted and logged once each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from indexer import metrics
from indexer.core.events import EventBatch
from indexer.core.hybrid import GroupDeclaration
from indexer.engine_registry import EngineSpec, RankStatus

log = logging.getLogger("kvindex.subscriber")


class DeclaredGroups:
    """The declaration of one rank's engine, until and after the store was told it."""

    def __init__(
        self,
        declaration: GroupDeclaration,
        status: RankStatus,
        rank_metrics: metrics.RankMetrics,
        ids: Callable[..., dict[str, Any]],
    ) -> None:
        self._declaration = declaration
        self._status, self._metrics, self._ids = status, rank_metrics, ids
        self.told = False  # set once a batch carrying the declaration was applied

    @classmethod
    def of(cls, spec: EngineSpec, *rest: Any) -> DeclaredGroups | None:
        """The engine's declaration (``rest``: as for the constructor), None if it has none."""
        if not spec.kv_groups:
            return None
        size = spec.block_size
        groups = [(g.kind, g.sliding_window, g.block_size or size) for g in spec.kv_groups]
        return cls(GroupDeclaration(groups, size), *rest)

    def to_apply(self, batch: EventBatch) -> EventBatch:
        """The batch as the store is to apply it, its contradictions counted."""
        for conflict in self._declaration.conflicts(batch):
            self._status.kv_group_mismatches += 1
            self._metrics.kv_group_mismatches.inc()
            log.warning("kv group differs from its declaration", extra=self._ids(**conflict))
        return batch if self.told else self._declaration.prepended(batch)
