"""Each rank's load, as its engine reports it and as this process routed to it.

The pick (:mod:`indexer.core.load`) needs, per rank, what the engine itself
says is running and waiting, and the requests routed to it that the engine
cannot have counted yet. Engines with an HTTP ``url`` whose adapter reads a
load page (vLLM's ``/metrics``) are scraped every ``scrape_interval`` seconds in
the background, never on a query's path, each on its own (an engine that answers
late delays no other's report); a rank's report counts for ``stale_after``
seconds. A pick counts as pending on its rank until a scrape that started after it
(the engine counts it itself by then), or, on a rank without a fresh report, for
``pending_seconds``.

Scraping starts with the first pick once an engine has a url
(:meth:`LoadBoard.placements`), so a process that never routes never scrapes.
Picks are this process's: API replicas each see the others' picks only through
the engines' reports, a scrape interval later. The prefill queued on a rank is not
read here: it is the rank's routed entries (:func:`~indexer.core.load.queued_blocks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import takewhile

import httpx

from indexer.core.events import GPU, RankId
from indexer.core.load import EngineLoad, LoadRules, Placement, placement
from indexer.engine_registry import EngineSpec, Registry
from indexer.errors import StoreUnavailable
from indexer.metrics import LOAD_SCRAPES
from indexer.stores.base import Store

log = logging.getLogger(__name__)

#: Seconds a request takes from a pick to the engine's scheduler (the router's
#: forwarding): a scrape started less than this after a pick may not count it yet.
TRANSIT = 0.1
#: the picks kept per rank: more than a rank ever has waiting
KEPT_PICKS = 256


@dataclass(frozen=True, slots=True)
class Report:
    """A rank's load as scraped at ``at`` (the scrape's start, monotonic seconds), with
    kvindex's count of its resident GPU blocks then (None: not read)."""

    load: EngineLoad
    at: float
    resident: int | None = None


class LoadBoard:
    """The latest report and the pending picks of every rank, and the scraper."""

    def __init__(
        self,
        registry: Registry,
        store: Store,
        rules: LoadRules,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry, self._store, self.rules, self._clock = registry, store, rules, clock
        self._reports: dict[RankId, Report] = {}
        self._picks: dict[RankId, deque[float]] = {}  # when
        self._task: asyncio.Task | None = None

    def report(self, rank: RankId) -> Report | None:
        """The rank's report while it is fresh, else None."""
        kept = self._reports.get(rank)
        if kept is None or self._clock() - kept.at > self.rules.stale_after:
            return None
        return kept

    def age(self, report: Report) -> float:
        """Seconds since ``report``'s scrape started."""
        return self._clock() - report.at

    def pending(self, rank: RankId, report: Report | None) -> int:
        """Picks of ``rank`` its fresh ``report`` (None: none) does not count."""
        since = self._clock() - self.rules.pending_seconds
        if report is not None:
            since = max(since, report.at - TRANSIT)
        recent = takewhile(lambda when: when > since, reversed(self._picks.get(rank, ())))
        return sum(1 for _ in recent)

    def placements(
        self, ranks: Sequence[tuple[RankId, bool]]
    ) -> list[tuple[Placement, Report | None]]:
        """Each rank's placement now (``ranks``: each with whether its engine publishes
        events), with the fresh report it is of (and the scraper started, if it is not)."""
        self._start()
        placed = []
        for rank, events in ranks:
            report = self.report(rank)
            load = None if report is None else report.load
            resident = None if report is None else report.resident
            where = placement(self.rules, load, self.pending(rank, report), resident, events)
            placed.append((where, report))
        return placed

    def picked(self, rank: RankId) -> None:
        """A request was routed to ``rank`` now."""
        self._picks.setdefault(rank, deque(maxlen=KEPT_PICKS)).append(self._clock())

    def _start(self) -> None:
        """Scrape from now on, once some engine has a url to scrape."""
        if self._task is not None or not self.rules.enabled:
            return
        if any(spec.url for spec in self._registry.all()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="load scrape")

    async def _run(self) -> None:
        scraping: dict[str, asyncio.Task] = {}  # each engine's read in flight, or its last
        # a busy engine's server may answer late: a report is of use until it is stale
        async with httpx.AsyncClient(timeout=self.rules.stale_after) as client:
            try:
                while True:
                    started = self._clock()
                    scraping = self._scrape_due(client, scraping, started)
                    wake = started + self.rules.scrape_interval
                    await asyncio.sleep(max(0.0, wake - self._clock()))
            finally:
                for task in scraping.values():
                    task.cancel()
                await asyncio.gather(*scraping.values(), return_exceptions=True)

    def _scrape_due(
        self, client: httpx.AsyncClient, scraping: dict[str, asyncio.Task], started: float
    ) -> dict[str, asyncio.Task]:
        """Start reading the load page of each engine that has one and whose last read is
        over (each on its own, so one that answers late delays no other's), forget what is
        kept of engines gone, and return the reads kept."""
        specs = self._registry.all()
        for spec in specs:
            last = scraping.get(spec.name)
            if spec.url and spec.engine_adapter.load_path and (last is None or last.done()):
                scraping[spec.name] = asyncio.create_task(self._scrape(client, spec, started))
        names = {spec.name for spec in specs}
        self._forget_others(names)
        return {n: task for n, task in scraping.items() if n in names or not task.done()}

    async def _scrape(self, client: httpx.AsyncClient, spec: EngineSpec, started: float) -> None:
        adapter = spec.engine_adapter
        try:
            answer = await client.get(f"{spec.url}{adapter.load_path}")
            answer.raise_for_status()
            # parsed off the event loop: a page is tens of kilobytes, and the loop answers picks
            loads = await asyncio.to_thread(adapter.read_load, answer.text)
        except (httpx.HTTPError, ValueError) as e:
            LOAD_SCRAPES.labels("failed").inc()
            log.debug("load scrape failed", extra={"engine": spec.name, "error": str(e)})
            return
        LOAD_SCRAPES.labels("ok").inc()
        for dp_rank, load in loads.items():
            rank = RankId(spec.name, dp_rank)
            self._reports[rank] = Report(load, started, await self._resident(rank, load))

    async def _resident(self, rank: RankId, load: EngineLoad) -> int | None:
        """The rank's resident GPU blocks, when its engine says its capacity and the store
        answers (a store down leaves the engine's own ``kv_usage`` to say how full it is)."""
        if not load.capacity:
            return None
        try:
            return (await self._store.block_counts(rank)).get(GPU)
        except StoreUnavailable:
            return None

    def _forget_others(self, engines: set[str]) -> None:
        """Drop what is kept of engines no longer registered."""
        for kept in (self._reports, self._picks):
            for rank in [r for r in kept if r.engine not in engines]:
                del kept[rank]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
