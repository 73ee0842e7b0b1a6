"""Misdeclared engines in scale-out: found by the indexer workers, read by API replicas.

Only the worker consuming an engine's ranks sees its events, so the worker's
:class:`~indexer.misdeclared.Misdeclared` publishes what it found to the hash
``{P:meta}:misdeclared`` (engine name -> the spec checked, the
contradictions and the block size its events showed, JSON), and every replica
reads it back. An entry counts only while the engine is registered with the
very spec that was checked: a re-registration with another spec starts clean,
as in one process.

So a block size learned from the events (an engine registered without one)
lives beside the registry in Redis, as long as the registration: replicas that
start later read it here (a worker that takes the engine over learns it again,
for its own checks, from the next store). Should Redis lose it, each worker
writes again what it published (:meth:`RedisMisdeclared.republish`, a loss
listener): its own checks learned it once and do not learn it again. A replica
keeps what it read of a registration that is unchanged, so the findings it
answers with never lapse while they are rewritten.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from indexer.engine_registry import EngineSpec, Registry, UnknownEngine
from indexer.misdeclared import excludes
from indexer.retrying import repeat
from indexer.stores.base import Loss
from indexer.stores.redis.client import RedisClient

log = logging.getLogger("kvindex.misdeclared")


class _Entry(msgspec.Struct, frozen=True):
    spec: EngineSpec
    reasons: dict[str, str]
    block_size: int | None = None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(_Entry).decode


class RedisMisdeclared:
    """Implements :class:`~indexer.misdeclared.MisdeclaredView` from Redis (as of the
    last :meth:`refresh`), and lets a worker :meth:`publish` into it."""

    def __init__(self, client: RedisClient, registry: Registry) -> None:
        self._client = client
        self._registry = registry
        self._key = f"{{{client.layout.meta_key}}}:misdeclared"
        self._seen: dict[str, _Entry] = {}
        self._published: dict[str, _Entry] = {}  # by this process, to write again after a loss
        self._writes: set[asyncio.Task] = set()
        self._writing = asyncio.Lock()  # one read-merge-write at a time

    def reasons(self, engine: str) -> list[str]:
        entry = self._current(engine)
        return list(entry.reasons.values()) if entry else []

    def excluded(self, engine: str) -> bool:
        entry = self._current(engine)
        return entry is not None and excludes(entry.reasons)

    def block_size(self, engine: str) -> int | None:
        try:
            declared = self._registry.get(engine).block_size
        except UnknownEngine:
            return None
        entry = self._current(engine)
        return declared or (entry.block_size if entry else None)

    def publish(self, spec: EngineSpec, reasons: dict[str, str], block_size: int | None) -> None:
        """Write what the checks found in the background (an observer cannot wait), over
        what an earlier owner of the engine found of the same registration."""
        self._published[spec.name] = entry = _Entry(spec, reasons, block_size)
        self._start(entry)

    def republish(self, loss: Loss) -> None:
        """The store lost data (a loss listener): write again what this process found."""
        for entry in self._published.values():
            self._start(entry)

    def _start(self, entry: _Entry) -> None:
        task = asyncio.get_running_loop().create_task(self._write(entry))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def refresh(self) -> None:
        """Read every engine's findings; those Redis lost are kept until written again."""
        (fields,) = await self._client.execute([("HGETALL", self._key)])
        self._seen = self._seen | {name.decode(): _decode(raw) for name, raw in fields.items()}

    async def follow(self, interval: float) -> None:
        """Refresh every ``interval`` seconds, forever (run it as a task)."""
        await repeat(interval, self.refresh, "misdeclared engines")

    async def _write(self, entry: _Entry) -> None:
        name = entry.spec.name
        try:
            async with self._writing:
                (raw,) = await self._client.execute([("HGET", self._key, name)])
                if raw is not None:
                    entry = _merged(_decode(raw), entry)
                await self._client.execute([("HSET", self._key, name, _encode(entry))])
        except Exception as e:  # the log and the worker's metric have it already
            log.warning("could not publish a misdeclared engine", extra={"error": repr(e)})

    def _current(self, engine: str) -> _Entry | None:
        entry = self._seen.get(engine)
        try:
            registered = self._registry.get(engine)
        except UnknownEngine:
            return None
        return entry if entry is not None and entry.spec == registered else None


def _merged(old: _Entry, new: _Entry) -> _Entry:
    """A worker's findings over its predecessor's of the same registration: a worker
    taking an engine over learns its block size again before it has checked as much."""
    if old.spec != new.spec:
        return new
    return _Entry(new.spec, old.reasons | new.reasons, new.block_size or old.block_size)
