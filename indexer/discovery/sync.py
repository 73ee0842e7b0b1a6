"""Keeping the registry equal to what a discovery source sees, with a grace period.

A source (DNS answers, Kubernetes pods) says which engines exist now; the
:class:`Sync` registers the new ones, re-registers an engine whose settings
changed (a pod with a new IP is a new engine process, so its old residency
must go), and deregisters an engine only after it has been missing for
``grace`` seconds: a DNS answer that briefly lacks an address, or a readiness
probe that flaps, must not throw away a whole engine's residency. It touches
only the engines it registered itself, so an engine an operator added by hand
under the same name is left alone (counted as ``name_taken``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from indexer.registry import EngineExists, EngineSpec, Registry, UnknownEngine

log = logging.getLogger("kvindex.discovery")

CHANGES = Counter(
    "kvindex_discovery_changes_total",
    "Engines discovery registered, replaced, deregistered or could not register, by source.",
    ["source", "change"],
)
LOOKUPS = Counter(
    "kvindex_discovery_lookups_total",
    "Discovery lookups (DNS resolutions, Kubernetes lists and watch events), by outcome.",
    ["source", "outcome"],
)


@dataclass(frozen=True, slots=True)
class Diff:
    """How two sets of engines (by name) differ."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()


def diff(old: Mapping[str, EngineSpec], new: Mapping[str, EngineSpec]) -> Diff:
    """The engines ``new`` has and ``old`` lacks, the reverse, and those whose
    spec differs (each sorted by name)."""
    return Diff(
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(sorted(n for n in old.keys() & new.keys() if old[n] != new[n])),
    )


class Sync:
    """Applies a source's successive views of its engines to a registry.

    ``source`` labels the log lines and metrics (the ``--discover`` URL
    without its query). Calls are serialised, so a watch event and the grace
    timer never interleave.
    """

    def __init__(
        self,
        registry: Registry,
        source: str,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self.source = source
        self.grace = grace
        self._clock = clock
        self._lock = asyncio.Lock()
        self.registered: dict[str, EngineSpec] = {}
        #: engines registered here but not seen since (monotonic time first missed)
        self.missing_since: dict[str, float] = {}
        self._desired: dict[str, EngineSpec] = {}

    async def apply(self, desired: Mapping[str, EngineSpec]) -> None:
        """Make the registry hold ``desired``: add and replace now, remove after the grace."""
        async with self._lock:
            self._desired = dict(desired)
            await self._converge()

    async def expire(self) -> None:
        """Deregister the engines missing for longer than the grace (for sources
        that report only changes, not a full view on a timer)."""
        async with self._lock:
            await self._converge()

    def count(self, outcome: str) -> None:
        LOOKUPS.labels(self.source, outcome).inc()

    async def _converge(self) -> None:
        now = self._clock()
        changes = diff(self.registered, self._desired)
        for name in self._desired:
            self.missing_since.pop(name, None)
        for name in changes.removed:
            first = self.missing_since.setdefault(name, now)
            if now - first >= self.grace:
                await self._remove(name, "removed")
        for name in changes.changed:
            await self._remove(name, "replaced")
            await self._add(self._desired[name])
        for name in changes.added:
            await self._add(self._desired[name])

    async def _add(self, spec: EngineSpec) -> None:
        try:
            await self._registry.add(spec)
        except EngineExists:
            # Someone else (an operator, another source) owns the name: never touch it.
            CHANGES.labels(self.source, "name_taken").inc()
            log.warning("discovered engine's name is taken", extra=self._fields(spec))
            return
        except Exception as e:
            # Left out of ``registered``: the next view tries again.
            CHANGES.labels(self.source, "failed").inc()
            log.warning(
                "cannot register discovered engine", extra={**self._fields(spec), "error": repr(e)}
            )
            return
        self.registered[spec.name] = spec
        CHANGES.labels(self.source, "added").inc()
        log.info("discovered engine registered", extra=self._fields(spec))

    async def _remove(self, name: str, change: str) -> None:
        spec = self.registered.pop(name)
        self.missing_since.pop(name, None)
        with contextlib.suppress(UnknownEngine):  # an operator deregistered it already
            await self._registry.remove(name)
        CHANGES.labels(self.source, change).inc()
        log.info(f"discovered engine {change}", extra=self._fields(spec))

    def _fields(self, spec: EngineSpec) -> dict[str, str | None]:
        return {"source": self.source, "engine": spec.name, "endpoint": spec.endpoint}
