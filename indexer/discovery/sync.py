"""Keeping the registry equal to what a discovery source sees, with a grace period.

A source (DNS answers, Kubernetes pods) says which engines exist now; the
:class:`Sync` announces them through the same leased upsert as engines that
register themselves (:class:`~indexer.announcements.Leases`): a new engine is
registered, one whose settings changed is re-registered (a pod with a new IP
is a new engine process, so its old residency must go), and every engine it
holds is renewed on each view. One that is no longer seen is deregistered
only after it has been missing for ``grace`` seconds: a DNS answer that
briefly lacks an address, or a readiness probe that flaps, must not throw
away a whole engine's residency. If discovery itself stops renewing (the
task died), the leases lapse and the engines go as a dead engine's would.
An engine registered under the same name by hand, or announced by itself
(the vLLM plugin), is left alone (counted as ``name_taken``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from indexer.announcements import Announcement, HandRegistered, Leases, StaleInstance
from indexer.engine_registry import EngineSpec, UnknownEngine

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
    """Applies a source's successive views of its engines to the leases.

    ``source`` labels the log lines and metrics (the ``--discover`` URL
    without its query); ``renew_every`` is how often the source calls
    :meth:`apply` or :meth:`expire` at the least. Leases are renewed every
    third of their length (not on every call: a watch's ticker runs every
    second over possibly hundreds of pods), so each outlives two missed
    renewals. Calls are serialised, so a watch event and the grace timer never
    interleave.
    """

    def __init__(
        self,
        leases: Leases,
        source: str,
        grace: float,
        renew_every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._leases = leases
        self.source = source
        self.grace = grace
        self.lease_seconds = max(leases.rules.default_lease_seconds, 3 * renew_every)
        #: one id for this run of the source: its engines' announcing instance
        self.instance = f"discovery-{uuid.uuid4().hex}"
        self._clock = clock
        self._lock = asyncio.Lock()
        self.registered: dict[str, EngineSpec] = {}
        #: engines registered here but not seen since (monotonic time first missed)
        self.missing_since: dict[str, float] = {}
        self._desired: dict[str, EngineSpec] = {}
        self._renewed_at = clock()

    async def apply(self, desired: Mapping[str, EngineSpec]) -> None:
        """Make the registry hold ``desired``: add, replace and renew now, remove
        after the grace."""
        async with self._lock:
            self._desired = dict(desired)
            await self._converge()

    async def expire(self) -> None:
        """Renew what is held and deregister what has been missing past the grace,
        with no new view (a failed lookup, or a quiet watch)."""
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
                await self._remove(name)
        for name in changes.changed:
            await self._announce(self._desired[name], "replaced")
        for name in changes.added:
            await self._announce(self._desired[name], "added")
        if now - self._renewed_at >= self.lease_seconds / 3:
            self._renewed_at = now
            fresh = {*changes.changed, *changes.added}
            for name, spec in list(self.registered.items()):
                if name not in fresh:
                    await self._announce(spec, None)

    async def _announce(self, spec: EngineSpec, change: str | None) -> None:
        """Register, re-register or (``change`` None) renew one engine."""
        announcement = Announcement(spec, self.instance, self.lease_seconds)
        held = self._leases.lease(spec.name)
        try:
            if held is not None and held.instance != self.instance:
                # The engine announces itself (its own declaration wins): taking the
                # lease over would re-register it on each renewal of either side.
                raise HandRegistered(spec.name)
            granted = await self._leases.announce(announcement)
        except HandRegistered:
            # An operator or the engine itself owns the name: never touch it.
            self.registered.pop(spec.name, None)
            CHANGES.labels(self.source, "name_taken").inc()
            log.warning("discovered engine's name is taken", extra=self._fields(spec))
            return
        except Exception as e:
            # A new engine stays out of ``registered``, so the next view tries again.
            CHANGES.labels(self.source, "failed").inc()
            log.warning(
                "cannot register discovered engine", extra={**self._fields(spec), "error": repr(e)}
            )
            return
        self.registered[spec.name] = spec
        if change is None and granted.outcome == "registered":
            change = "added"  # its lease had lapsed (or an operator deregistered it)
        if change is not None:
            CHANGES.labels(self.source, change).inc()
            log.info(f"discovered engine {change}", extra=self._fields(spec))

    async def _remove(self, name: str) -> None:
        spec = self.registered.pop(name)
        self.missing_since.pop(name, None)
        # gone already: an operator deregistered it, or a fresh instance took it over
        with contextlib.suppress(UnknownEngine, HandRegistered, StaleInstance):
            await self._leases.deregister(name, self.instance)
        CHANGES.labels(self.source, "removed").inc()
        log.info("discovered engine removed", extra=self._fields(spec))

    def _fields(self, spec: EngineSpec) -> dict[str, str | None]:
        return {"source": self.source, "engine": spec.name, "endpoint": spec.endpoint}
