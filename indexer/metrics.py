"""Prometheus metrics of event ingestion and residency, per engine and dp rank.

Counters are incremented where things happen (each through a per-rank child
resolved once, so the apply loop pays no label lookup). Gauges that describe
current state (connected, degraded, lag, resident blocks) are read at scrape
time from the live consumers, and from the last residency sample, instead of
being kept up to date per batch.

Cardinality: a rank's counters are one series each (rates need every rank's
own), about ten per rank. The state gauges are bounded per process by
``MetricsSettings.rank_series``: up to that many ranks each have their own
series; beyond it only the ranks an operator looks at first do (degraded,
then most behind, then holding most), and every rank is still counted in the
per-engine ``kvindex_engine_*`` gauges. 1,000 ranks in one process with the
default 100 export 100 ranks' gauges plus three tiers per engine.

Everything lives in the default registry, which ``/metrics`` exposes; a
registry refuses duplicate names, so these objects are module-level and
shared by every subscriber in the process (tests build many).
"""

from __future__ import annotations

import asyncio
import heapq
import weakref
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import Annotated, Protocol

import msgspec
from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from indexer.core.events import MEDIA, RankId
from indexer.engine_registry import RankStatus, is_degraded
from indexer.retrying import repeat

# A ``_created`` series per counter says when the process started counting: noise
# beside the process start time Prometheus already has.
disable_created_metrics()

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
LOAD_SCRAPES = Counter(
    "kvindex_load_scrapes_total",
    "Engines' load pages read for route=best (ok), or not (failed: unreachable, not 200,"
    " or no load stated).",
    ["outcome"],
)
SNAPSHOTS = Counter(
    "kvindex_ingest_snapshots_total",
    "Engine snapshots asked for when replay could not fill a range, by outcome.",
    [*_RANK, "outcome"],
)
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
LEASES_EXPIRED = Counter(
    "kvindex_engine_leases_expired_total",
    "Self-registered engines dropped because their lease passed without a renewal.",
)
MISDECLARED = Counter(
    "kvindex_engine_misdeclared_total",
    "Announced or registered engines whose events contradict their declared config,"
    " by what disagrees (each engine and reason counted once per registration).",
    ["engine", "reason"],
)
# No rank label: a histogram is a dozen series, times every rank would be thousands.
APPLY_SECONDS = Histogram(
    "kvindex_ingest_store_apply_seconds",
    "Time from handing a batch to the store until it is applied, retries included.",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5),
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
        for outcome in ("detected", "filled", "unfilled"):  # at 0 from the start, so
            self._third(GAPS, outcome)  # rate() and increase() see the first gap

    def rejected(self, reason: str) -> None:
        self._third(REJECTED, reason).inc()

    def gap(self, outcome: str) -> None:
        self._third(GAPS, outcome).inc()

    def snapshot(self, outcome: str) -> None:
        """A snapshot ``applied``, or ``failed``."""
        self._third(SNAPSHOTS, outcome).inc()

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


class MetricsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``metrics`` config section: what keeps the series bounded with 1,000 ranks."""

    #: Ranks of this process that get per-rank gauge series (the rest are in the
    #: per-engine gauges only).
    rank_series: Annotated[int, msgspec.Meta(ge=1)] = 100
    #: Seconds between reads of each rank's resident blocks from the store: one read
    #: per rank per interval whatever the number of scrapers.
    sample_interval: Annotated[float, msgspec.Meta(gt=0)] = 5.0


class StatusSource(Protocol):
    def statuses(self) -> Iterable[tuple[str, RankStatus]]:
        """``(engine, status)`` for every rank being consumed."""


class ResidencyReader(Protocol):
    """What the residency sample reads of a store."""

    async def block_counts(self, rank: RankId) -> dict[str, int]: ...

    async def anomalies(self, rank: RankId) -> dict[str, int]: ...


_sources: weakref.WeakSet[StatusSource] = weakref.WeakSet()
#: The last sample: resident blocks per tier and unknown removals, by rank.
_residency: dict[tuple[str, int], tuple[dict[str, int], int]] = {}
_settings = MetricsSettings()


def watch(source: StatusSource) -> None:
    """Report a subscriber's rank gauges at every scrape, for as long as it lives."""
    _sources.add(source)


def configure(settings: MetricsSettings) -> None:
    """Use these settings for the process's gauges from now on."""
    global _settings
    _settings = settings


async def sample_residency(store: ResidencyReader, settings: MetricsSettings) -> None:
    """Read every consumed rank's resident blocks every ``sample_interval``, forever
    (run it as a task in the process that consumes, beside its store)."""
    configure(settings)

    async def sample() -> None:
        ranks = [RankId(engine, s.dp_rank) for engine, s in _statuses()]
        found = {}
        for i in range(0, len(ranks), _CONCURRENT_READS):
            chunk = ranks[i : i + _CONCURRENT_READS]
            reads = await asyncio.gather(*(_read(store, rank) for rank in chunk))
            found.update(zip(chunk, reads, strict=True))
        _residency.clear()
        _residency.update(found)

    await repeat(settings.sample_interval, sample, "residency sample")


#: Ranks read at once by a sample: enough to fill a Redis pipeline, few enough
#: not to flood the event loop.
_CONCURRENT_READS = 32


async def _read(store: ResidencyReader, rank: RankId) -> tuple[dict[str, int], int]:
    blocks, anomalies = await asyncio.gather(store.block_counts(rank), store.anomalies(rank))
    return blocks, anomalies.get("unknown_removals", 0)


def _statuses() -> list[tuple[str, RankStatus]]:
    return [pair for source in list(_sources) for pair in source.statuses()]


#: Per-rank gauges read off a status, and what each says.
_GAUGES = {
    "connected": "Whether the rank's SUB socket has a live peer.",
    "never_connected": "Whether nothing has connected to the rank since it started "
    "(after no_publisher_after seconds): a wrong endpoint or an engine not running.",
    "degraded": "Whether the rank's answers may be wrong: not connected, an unfilled gap, "
    "or a store loss not applied again yet (prefix-match flags it alike).",
    "lag_batches": "Newest received seq minus applied seq.",
    "lag_seconds": "Batch ts of the newest received batch minus that of the applied one.",
    "applied_seq": "Seq of the last applied batch.",
    "store_loss": "Whether the store lost batches of the rank that are not applied again yet "
    "(or could not be): /engines/{name} says which and why.",
}


def _value(name: str, status: RankStatus) -> float | None:
    if name == "degraded":
        return float(is_degraded(status))
    if name == "store_loss":
        return float(status.store_loss is not None)
    value = getattr(status, name)
    return None if value is None else float(value)


def _attention(item: tuple[str, RankStatus]) -> tuple:
    """Sort key: the ranks an operator looks at first come first."""
    engine, status = item
    blocks, _ = _residency.get((engine, status.dp_rank), ({}, 0))
    held = -sum(blocks.values())
    return (not is_degraded(status), -status.lag_seconds, -status.lag_batches, held, engine)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class _RankGauges(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        statuses = _statuses()
        yield from self._engines(statuses)
        if len(statuses) > _settings.rank_series:
            statuses = heapq.nsmallest(_settings.rank_series, statuses, key=_attention)
        yield from self._ranks(statuses)

    def _ranks(self, statuses: list[tuple[str, RankStatus]]) -> Iterator[GaugeMetricFamily]:
        families = {n: _gauge(f"kvindex_ingest_{n}", d, _RANK) for n, d in _GAUGES.items()}
        resident = _gauge(
            "kvindex_rank_resident_blocks",
            "Distinct block hashes the rank holds, by tier (as of the last sample).",
            [*_RANK, "tier"],
        )
        unknown = _gauge(
            "kvindex_rank_unknown_removals",
            "Removals of hashes the rank did not hold, as the store counts them "
            "(restarts from 0 when the rank is forgotten).",
            _RANK,
        )
        for engine, status in statuses:
            labels = [engine, str(status.dp_rank)]
            for name, family in families.items():
                value = _value(name, status)
                if value is not None:
                    family.add_metric(labels, value)
            if (sampled := _residency.get((engine, status.dp_rank))) is not None:
                for tier in MEDIA:
                    resident.add_metric([*labels, tier], sampled[0].get(tier, 0))
                unknown.add_metric(labels, sampled[1])
        yield from families.values()
        yield resident
        yield unknown

    def _engines(self, statuses: list[tuple[str, RankStatus]]) -> Iterator[GaugeMetricFamily]:
        ranks, connected, degraded = Tally(), Tally(), Tally()
        lag: dict[str, float] = {}
        blocks: dict[tuple[str, str], int] = {}
        for engine, status in statuses:
            ranks[engine] += 1
            connected[engine] += status.connected
            degraded[engine] += is_degraded(status)
            lag[engine] = max(lag.get(engine, 0.0), status.lag_seconds)
            if (sampled := _residency.get((engine, status.dp_rank))) is not None:
                for tier in MEDIA:
                    blocks[engine, tier] = blocks.get((engine, tier), 0) + sampled[0].get(tier, 0)
        per_engine = {
            "ranks": ("Ranks of the engine consumed by this process.", ranks),
            "connected_ranks": ("Of those, ranks with a live publisher.", connected),
            "degraded_ranks": ("Of those, ranks whose answers may be wrong.", degraded),
            "max_lag_seconds": ("The largest lag_seconds of its ranks.", lag),
        }
        for name, (doc, values) in per_engine.items():
            family = _gauge(f"kvindex_engine_{name}", doc, ["engine"])
            for engine in ranks:
                family.add_metric([engine], values[engine])
            yield family
        family = _gauge(
            "kvindex_engine_resident_blocks",
            "Distinct block hashes held by the engine's ranks consumed here, summed, by tier.",
            ["engine", "tier"],
        )
        for (engine, tier), count in blocks.items():
            family.add_metric([engine, tier], count)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


REGISTRY.register(_RankGauges())


class RoutedSource(Protocol):
    def local_counts(self) -> dict[str, int]:
        """Routed entries by outcome as this process saw them, and ``live``."""


_routed_sources: weakref.WeakSet[RoutedSource] = weakref.WeakSet()


def watch_routed(source: RoutedSource) -> None:
    """Report a process's routed-entry counters at every scrape, for as long as it lives."""
    _routed_sources.add(source)


class _RoutedCounters(Collector):
    """Read at scrape time: the routed entries count their outcomes themselves (in
    Redis from each script's answer), so nothing is kept twice."""

    def collect(self) -> Iterator[Metric]:
        totals: Tally[str] = Tally()
        for source in list(_routed_sources):
            totals.update(source.local_counts())
        family = CounterMetricFamily(
            "kvindex_routed_entries",
            "Routed entries (POST /routed, route=best) recorded in this process, and how"
            " those it saw end ended: confirmed by events, expired, evicted past the"
            " rank's bound, cleared (a GPU clear, restart or removal).",
            labels=["outcome"],
        )
        for outcome in ("recorded", "confirmed", "expired", "evicted", "cleared"):
            family.add_metric([outcome], totals[outcome])
        yield family
        yield GaugeMetricFamily(
            "kvindex_routed_live_entries",
            "Routed entries held now (embedded: exact; Redis: what this process recorded"
            " less what it saw end).",
            value=totals["live"],
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())


REGISTRY.register(_RoutedCounters())
