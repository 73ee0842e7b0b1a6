"""Engines that register themselves, kept by lease.

An engine that announces itself says who it is (its spec) and which start of
it is talking (an ``instance`` id drawn anew each start). Announcing again
renews the lease; a new instance means the process restarted, so what kvindex
held of the old one is dropped and rebuilt from the new one's events; an engine
that stops announcing is dropped when its lease passes, since no clean
shutdown told kvindex it went. Engines registered by hand (config, flags,
``POST /engines``) are not leased and never expire: announcements cannot take
them over.

:class:`Leases` sits over any :class:`~indexer.engine_registry.Registry`, so the
registry's listeners (the subscriber) start and stop consuming exactly as for
hand registrations. The leases live in a :class:`LeaseBook`: this process's
memory, or Redis when API replicas share the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, Protocol

import msgspec

from indexer import metrics
from indexer.engine_registry import EngineSpec, Registry, UnknownEngine
from indexer.retrying import repeat

log = logging.getLogger("kvindex.leases")

Instance = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Outcome = Literal["registered", "renewed", "restarted", "updated", "deregistered"]


class LeaseRules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Bounds of the leases engines may ask for, and how often expiry is checked.

    The lower bound keeps a misconfigured engine from making kvindex re-register
    it many times a second; the upper one bounds how long a dead engine's
    residency is offered to routers.
    """

    #: The shortest lease granted: keeps a misconfigured engine from being registered
    #: again many times a second.
    min_lease_seconds: float = 1.0
    #: The longest lease granted: how long a dead engine's residency may be offered.
    max_lease_seconds: float = 300.0
    #: The lease of an announcement that asks for none.
    default_lease_seconds: float = 30.0
    #: Seconds between looks for lapsed leases.
    sweep_seconds: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.min_lease_seconds <= self.default_lease_seconds <= self.max_lease_seconds:
            raise ValueError(
                "leases: expected 0 < min_lease_seconds <= default_lease_seconds"
                " <= max_lease_seconds"
            )
        if self.sweep_seconds <= 0:
            raise ValueError("leases: sweep_seconds must be above 0")

    def grant(self, asked: float | None) -> float:
        """The lease given for one asked (clamped to the bounds; None: the default)."""
        if asked is None:
            return self.default_lease_seconds
        return min(max(asked, self.min_lease_seconds), self.max_lease_seconds)


class Announcement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an engine sends: its spec, its start's id, the lease it asks for, and
    whether a hash seed is in force (default: whether the spec carries one)."""

    spec: EngineSpec
    instance: Instance
    lease_seconds: Annotated[float, msgspec.Meta(gt=0)] | None = None
    seeded: bool | None = None

    def registered_spec(self) -> EngineSpec:
        """The spec kvindex follows: a seed in force but not given leaves the
        hashes unreproducible here, so they are matched as learned (no algo)."""
        if self.seeded and self.spec.hash_seed is None and self.spec.hash_algo is not None:
            return msgspec.structs.replace(self.spec, hash_algo=None)
        return self.spec


class Lease(msgspec.Struct, frozen=True):
    """One leased registration, as ``/engines/{name}`` shows it."""

    instance: str
    lease_seconds: float
    expires_in: float


class Granted(msgspec.Struct, frozen=True):
    """The answer to an announcement or a deregistration."""

    name: str
    instance: str
    lease_seconds: float | None
    outcome: Outcome


class HandRegistered(Exception):
    """The engine was registered by hand: it has no lease to renew or end."""


class StaleInstance(Exception):
    """The caller is not the instance holding the lease (a predecessor, or a stranger)."""


class Held(msgspec.Struct, frozen=True):
    """A leased registration as a book keeps it."""

    announcement: Announcement
    lease_seconds: float


class LeaseBook(Protocol):
    """Where leases are kept, with their deadlines on the book's own clock: in this
    process (:class:`MemoryBook`) or in Redis for every API replica
    (:class:`~indexer.cluster.announced.RedisBook`)."""

    async def held(self, name: str) -> Held | None:
        """The engine's lease, expired or not (None: none)."""

    async def hold(self, held: Held) -> None:
        """Keep ``held``, its deadline ``lease_seconds`` from now."""

    async def release(self, name: str) -> None:
        """Forget the engine's lease."""

    async def lapsed(self) -> list[Held]:
        """Take out every lease whose deadline has passed, each for one caller only."""

    def lease(self, name: str) -> Lease | None:
        """The engine's lease as last seen, for reading without I/O."""


def lease_at(entry: tuple[Held, float] | None, clock: Callable[[], float]) -> Lease | None:
    """A book's ``(held, deadline)`` entry as ``/engines/{name}`` shows it, the time
    left read on ``clock`` (the one the deadline is on): every book answers
    :meth:`LeaseBook.lease` by this one rule."""
    if entry is None:
        return None
    held, deadline = entry
    remaining = round(max(0.0, deadline - clock()), 3)
    return Lease(held.announcement.instance, held.lease_seconds, remaining)


class MemoryBook:
    """Leases in this process, deadlines on ``clock`` (monotonic by default)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[Held, float]] = {}

    async def held(self, name: str) -> Held | None:
        entry = self._held.get(name)
        return entry[0] if entry else None

    async def hold(self, held: Held) -> None:
        self._held[held.announcement.spec.name] = (held, self._clock() + held.lease_seconds)

    async def release(self, name: str) -> None:
        self._held.pop(name, None)

    async def lapsed(self) -> list[Held]:
        now = self._clock()
        gone = [name for name, (_, deadline) in self._held.items() if deadline <= now]
        return [self._held.pop(name)[0] for name in gone]

    def lease(self, name: str) -> Lease | None:
        return lease_at(self._held.get(name), self._clock)


class Leases:
    """The leased registrations over a registry, with their expiry.

    One lock orders this process's announcements, deregistrations and expiry,
    so a renewal racing the sweep either extends the lease or finds the engine
    gone and registers it again, never both. Replicas sharing a Redis book
    each sweep, and the book gives each lapsed lease to one of them.
    ``on_removed(name)`` runs after each removal this class makes (the API drops
    the engine's routed entries). The sweep starts with :meth:`start` or the
    first announcement.
    """

    def __init__(
        self,
        registry: Registry,
        rules: LeaseRules | None = None,
        *,
        on_removed: Callable[[str], Awaitable[None]] | None = None,
        book: LeaseBook | None = None,
    ) -> None:
        self.registry = registry
        self.rules = rules or LeaseRules()
        self._on_removed = on_removed
        self._book = book or MemoryBook()
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task | None = None

    def lease(self, name: str) -> Lease | None:
        """The engine's lease (None: hand-registered, or not registered)."""
        return self._book.lease(name)

    async def announce(self, announcement: Announcement) -> Granted:
        """Register, renew, re-register (restart, update) an announced engine.

        Raises :class:`HandRegistered`, or whatever the registry raises when its
        listeners cannot take the spec (the previous registration then stays).
        """
        self.start()
        name = announcement.spec.name
        granted = self.rules.grant(announcement.lease_seconds)
        async with self._lock:
            held = await self._held(name)
            if held is None:
                if self._registered(name):
                    raise HandRegistered(name)
                await self.registry.add(announcement.registered_spec())
                outcome: Outcome = "registered"
            elif held.announcement == msgspec.structs.replace(
                announcement, lease_seconds=held.announcement.lease_seconds
            ):
                outcome = "renewed"
            else:
                outcome = (
                    "updated"
                    if held.announcement.instance == announcement.instance
                    else "restarted"
                )
                await self._replace(held.announcement.registered_spec(), announcement)
            await self._book.hold(Held(announcement, granted))
        if outcome != "renewed":
            log.info(
                f"engine {outcome} by announcement",
                extra={"engine": name, "instance": announcement.instance, "lease": granted},
            )
        return Granted(name, announcement.instance, granted, outcome)

    async def _held(self, name: str) -> Held | None:
        """The engine's lease, if the engine is still registered (a leased engine
        removed by hand meanwhile, ``DELETE /engines``, has none)."""
        refresh = getattr(self.registry, "refresh", None)
        if refresh is not None:  # a registry shared by replicas: see their changes first
            await refresh()
        held = await self._book.held(name)
        if held is not None and not self._registered(name):
            await self._book.release(name)
            return None
        return held

    async def deregister(self, name: str, instance: str) -> Granted:
        """End a lease at once (a clean shutdown). Raises :class:`UnknownEngine`,
        :class:`HandRegistered` or :class:`StaleInstance`."""
        async with self._lock:
            held = await self._held(name)
            if held is None:
                if self._registered(name):
                    raise HandRegistered(name)
                raise UnknownEngine(name)
            if held.announcement.instance != instance:
                raise StaleInstance(held.announcement.instance)
            await self._remove(name)
        log.info("engine deregistered", extra={"engine": name, "instance": instance})
        return Granted(name, instance, None, "deregistered")

    async def expire(self) -> list[str]:
        """Drop every registration whose lease has passed; their names."""
        gone = []
        async with self._lock:
            for held in await self._book.lapsed():
                name = held.announcement.spec.name
                await self._remove(name)
                gone.append(name)
                metrics.LEASES_EXPIRED.inc()
                log.warning(
                    "engine lease expired: deregistered, residency dropped",
                    extra={
                        "engine": name,
                        "instance": held.announcement.instance,
                        "lease": held.lease_seconds,
                    },
                )
        return gone

    async def close(self) -> None:
        """Stop the sweep (the registrations stay)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    def start(self) -> None:
        """Start sweeping lapsed leases (if not yet): a replica that never took an
        announcement still drops the leases others granted."""
        if self._sweeper is None or self._sweeper.done():

            async def sweep() -> None:
                await self.expire()

            self._sweeper = asyncio.create_task(
                repeat(self.rules.sweep_seconds, sweep, "engine leases")
            )

    def _registered(self, name: str) -> bool:
        try:
            self.registry.get(name)
        except UnknownEngine:
            return False
        return True

    async def _replace(self, old: EngineSpec, announcement: Announcement) -> None:
        """Swap a registration for a new one; if the new one is refused, put the
        old one back so a bad update leaves the engine followed as before."""
        await self._remove(old.name, forget=False)
        try:
            await self.registry.add(announcement.registered_spec())
        except BaseException:
            await self.registry.add(old)
            raise
        if self._on_removed is not None:
            await self._on_removed(old.name)

    async def _remove(self, name: str, *, forget: bool = True) -> None:
        with contextlib.suppress(UnknownEngine):  # removed by hand meanwhile: nothing to drop
            await self.registry.remove(name)
        if forget:
            await self._book.release(name)
            if self._on_removed is not None:
                await self._on_removed(name)
