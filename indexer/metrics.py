"""Prometheus metrics of event ingestion, per engine and dp rank.

Counters are incremented where things happen (each through a per-rank child
resolved once, so the apply loop pays no label lookup). Gauges that describe
current state (connected, degraded, lag, applied seq) are read from the live
subscribers at scrape time instead of being kept up to date per batch.

Everything lives in the default registry, which ``/metrics`` exposes; a
registry refuses duplicate names, so these objects are module-level and
shared by every subscriber in the process (tests build many).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from indexer.registry import RankStatus

_RANK = ["engine", "dp_rank"]

BATCHES = Counter("kvindex_ingest_batches_total", "Event batches applied to the store.", _RANK)
BLOCK_OPS = Counter(
    "kvindex_ingest_block_ops_total", "Block hash operations (+1/-1) applied.", _RANK
)
REJECTED = Counter(
    "kvindex_ingest_rejected_frames_total",
    "Frames that were not a valid batch, by reason.",
    [*_RANK, "reason"],
)
GAPS = Counter(
    "kvindex_ingest_gaps_total",
    "Missing seq ranges: detected, then filled by replay or left unfilled.",
    [*_RANK, "outcome"],
)
REPLAYS = Counter("kvindex_ingest_replays_total", "Replay requests sent.", _RANK)
RESTARTS = Counter("kvindex_ingest_restarts_total", "Engine restarts detected.", _RANK)
DUPLICATES = Counter(
    "kvindex_ingest_duplicates_total", "Batches received again and skipped.", _RANK
)
STORE_ERRORS = Counter(
    "kvindex_ingest_store_errors_total", "Store calls that failed and were retried.", _RANK
)
KV_GROUP_MISMATCHES = Counter(
    "kvindex_ingest_kv_group_mismatches_total",
    "KV groups whose events contradict the engine's declared kv_groups (each seen once).",
    _RANK,
)


class RankMetrics:
    """The counter children of one rank, resolved once."""

    def __init__(self, engine: str, dp_rank: int) -> None:
        self.labels = (engine, str(dp_rank))
        self.batches = BATCHES.labels(*self.labels)
        self.block_ops = BLOCK_OPS.labels(*self.labels)
        self.replays = REPLAYS.labels(*self.labels)
        self.restarts = RESTARTS.labels(*self.labels)
        self.duplicates = DUPLICATES.labels(*self.labels)
        self.store_errors = STORE_ERRORS.labels(*self.labels)
        self.kv_group_mismatches = KV_GROUP_MISMATCHES.labels(*self.labels)
        self._labelled: set[tuple[Counter, str]] = set()  # series with a third label

    def rejected(self, reason: str) -> None:
        self._third(REJECTED, reason).inc()

    def gap(self, outcome: str) -> None:
        self._third(GAPS, outcome).inc()

    def _third(self, counter: Counter, value: str) -> Counter:
        self._labelled.add((counter, value))
        return counter.labels(*self.labels, value)

    def remove(self) -> None:
        """Forget the rank's series (its engine was deregistered)."""
        counters = (BATCHES, BLOCK_OPS, REPLAYS, RESTARTS, DUPLICATES, STORE_ERRORS)
        for counter in (*counters, KV_GROUP_MISMATCHES):
            counter.remove(*self.labels)
        for counter, value in self._labelled:
            counter.remove(*self.labels, value)


class StatusSource(Protocol):
    def statuses(self) -> Iterable[tuple[str, RankStatus]]:
        """``(engine, status)`` for every rank being consumed."""


_sources: weakref.WeakSet[StatusSource] = weakref.WeakSet()


def watch(source: StatusSource) -> None:
    """Report a subscriber's rank gauges at every scrape, for as long as it lives."""
    _sources.add(source)


_GAUGES = {
    "connected": "Whether the rank's SUB socket has a live peer.",
    "never_connected": "Whether nothing has connected to the rank since it started "
    "(after no_publisher_after seconds): a wrong endpoint or an engine not running.",
    "degraded": "Whether the rank missed batches that replay could not fill.",
    "lag_batches": "Newest received seq minus applied seq.",
    "lag_seconds": "Batch ts of the newest received batch minus that of the applied one.",
    "applied_seq": "Seq of the last applied batch.",
}
#: Gauges that are 1 while a status field is set (it says why), else 0.
_SET = {
    "store_loss": "Whether the store lost batches of the rank that are not applied again yet "
    "(or could not be): /engines/{name} says which and why.",
}


class _RankGauges(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        families, flags = (
            {
                name: GaugeMetricFamily(f"kvindex_ingest_{name}", doc, labels=_RANK)
                for name, doc in docs.items()
            }
            for docs in (_GAUGES, _SET)
        )
        for source in list(_sources):
            for engine, status in source.statuses():
                labels = [engine, str(status.dp_rank)]
                for name, family in families.items():
                    value = getattr(status, name)
                    if value is not None:
                        family.add_metric(labels, float(value))
                for name, family in flags.items():
                    family.add_metric(labels, float(getattr(status, name) is not None))
        yield from families.values()
        yield from flags.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


REGISTRY.register(_RankGauges())
