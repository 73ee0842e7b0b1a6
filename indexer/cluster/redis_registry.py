"""The engine registry in Redis, shared by every API replica and indexer worker.

``POST /engines`` on any replica writes the engine into the hash
``{P:meta}:engines`` (the Redis store's metadata slot, see
:mod:`indexer.stores.redis.layout`), through the Redis gateway, so workers
see it and a worker's claim on one of its ranks can check, atomically, that
it is still registered. ``DELETE`` removes the engine and forgets its ranks
in one script that also bumps their fence tokens: the worker consuming them
has its next write refused, even before it notices the change.

:meth:`RedisRegistry.get` and :meth:`RedisRegistry.all` answer from a local
copy, because the API calls them synchronously; the copy is reloaded when the
registry's ``#version`` moves (:meth:`RedisRegistry.refresh`, polled by
:meth:`RedisRegistry.follow`). A process sees its own changes at once and
other processes' within one poll interval.

The registry lives in Redis, so it can be lost with Redis's data (a restart
without persistence, an older snapshot). Its ``#version`` only ever rises
otherwise: a registry whose version is gone or went back was lost, and the
process that finds it registers again every engine it knew (its last copy,
then the engines declared by flags and config files); the others' copies
fill in what it missed. Ingestion then resumes by itself: workers claim the
ranks of registered engines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec

from indexer.cluster.scripts import DEREGISTER, REGISTER
from indexer.engine_registry import EngineExists, EngineSpec, UnknownEngine
from indexer.retrying import repeat
from indexer.stores.redis.client import RedisClient

log = logging.getLogger("kvindex.registry")
_VERSION = b"#version"
_decode = msgspec.json.Decoder(EngineSpec).decode


class RedisRegistry:
    """Implements :class:`~indexer.engine_registry.Registry` over Redis (no change listeners:
    workers compare what they consume with :meth:`entries` instead)."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self._key = client.layout.registry_key
        self._version: bytes | None = None
        self._entries: dict[str, tuple[EngineSpec, bytes]] = {}
        self._declared: dict[str, EngineSpec] = {}  # by flags and config files

    async def add(self, spec: EngineSpec) -> EngineSpec:
        """Register an engine (raises :class:`EngineExists` if the name is taken)."""
        script = self._client.script(REGISTER, [self._key], [spec.name, msgspec.json.encode(spec)])
        (added,) = await self._client.execute([script])
        if not added:
            raise EngineExists(spec.name)
        await self.refresh()
        return spec

    async def remove(self, name: str) -> EngineSpec:
        """Deregister an engine and forget its ranks' residency (raises :class:`UnknownEngine`)."""
        keys = [self._key, self._client.layout.meta_key]
        (removed,) = await self._client.execute([self._client.script(DEREGISTER, keys, [name])])
        if removed is None:
            raise UnknownEngine(name)
        await self.refresh()
        return _decode(removed)

    def get(self, name: str) -> EngineSpec:
        try:
            return self._entries[name][0]
        except KeyError:
            raise UnknownEngine(name) from None

    def all(self) -> list[EngineSpec]:
        return [spec for _, (spec, _) in sorted(self._entries.items())]

    def entries(self) -> dict[str, tuple[EngineSpec, bytes]]:
        """Every engine with its registry entry as stored (what a claim must present)."""
        return dict(self._entries)

    async def refresh(self) -> None:
        """Reload the local copy if the registry changed since the last look."""
        (version,) = await self._client.execute([("HGET", self._key, _VERSION)])
        if version is not None and version == self._version:
            return
        if self._version is not None and int(version or 0) < int(self._version):
            await self._reseed()
        (fields,) = await self._client.execute([("HGETALL", self._key)])
        entries = {}
        for name, raw in fields.items():
            if name != _VERSION:
                entries[name.decode()] = (_decode(raw), raw)
        self._entries, self._version = entries, fields.get(_VERSION)

    async def _reseed(self) -> None:
        """Register again every engine this process knew: the registry was lost."""
        known = {name: raw for name, (_, raw) in self._entries.items()}
        for name, spec in self._declared.items():
            known.setdefault(name, msgspec.json.encode(spec))
        scripts = [self._client.script(REGISTER, [self._key], [n, r]) for n, r in known.items()]
        added = sum(await self._client.execute(scripts)) if scripts else 0
        log.warning("engine registry lost: registered again", extra={"engines": added})

    def declare(self, specs: Iterable[EngineSpec]) -> None:
        """Remember engines declared by flags or config files, to register them again
        if the registry is lost (without registering them now)."""
        self._declared.update((spec.name, spec) for spec in specs)

    async def follow(self, interval: float) -> None:
        """Refresh every ``interval`` seconds, forever (run it as a task)."""
        await repeat(interval, self.refresh, "registry")

    async def seed(self, specs: Iterable[EngineSpec]) -> None:
        """Register engines declared on the command line or in the config file.

        One already registered stays as it is: the registry, changed by the
        API since, wins over a worker's flags.
        """
        specs = list(specs)
        self.declare(specs)
        for spec in specs:
            try:
                await self.add(spec)
            except EngineExists:
                await self.refresh()
                if self._entries.get(spec.name, (None,))[0] != spec:
                    log.warning("declared engine differs from the registered one",
                                extra={"engine": spec.name})  # fmt: skip
