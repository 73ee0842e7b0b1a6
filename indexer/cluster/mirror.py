"""A ``kvindex api`` replica that answers from its own memory: the engines' events
consumed by the replica itself, Redis kept for what replicas share.

A replica reading Redis pays round trips on every query, and their cost grows
with the fleet (each holder set is a hash to fetch). A mirror replica instead
runs the ingest of ``kvindex serve`` for every registered engine rank, into an
embedded store of its own, and answers from it at in-memory speed.

What a mirror keeps of the Redis deployment's rules, and how:

- **Exactly once, loss detection, catch-up** are the embedded ingest's own: each
  rank's consumer applies a batch once by its seq, fills gaps from the engine's
  replay buffer, and past it from the engine's snapshot; a rank that cannot is
  reported ``degraded`` in every answer, as in ``kvindex serve``.
- **Fencing** guards a store several writers share; a mirror's store has one
  writer, its own consumers, so nothing is fenced there. The workers still write
  Redis under their leases.
- **Staleness**: a mirror's answer is as of the last batch its consumer applied,
  the same stream the workers apply to Redis; the two differ by the gap between
  their consumers (the time to receive and apply a batch), never by a poll.
  While a rank catches up after a start, it is ``degraded``, as for any gap.
- **Shared state stays in Redis**: the engine registry (the mirror consumes what
  it lists, a poll after it changes), routed entries and their picks, leases,
  misdeclared-engine checks. Operators' engine changes through any replica reach
  every mirror by the registry.

The price: every mirror subscribes to every engine, as each of llm-d's replicas
does, so an engine's publisher serves one more subscriber per mirror.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from indexer.cluster.redis_registry import RedisRegistry
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import EngineRegistry, RankStatus, UnknownEngine, blank_status
from indexer.ingest.settings import SubscriberSettings
from indexer.ingest.subscriber import Subscriber
from indexer.retrying import repeat
from indexer.stores.memory import MemoryStore

log = logging.getLogger("kvindex.mirror")


class Mirror:
    """Every engine rank the shared registry lists, consumed into :attr:`store`.

    Implements :class:`~indexer.engine_registry.ConsumerView` (and reports applied
    batches, as the subscriber does) for the API over :attr:`store`.
    """

    def __init__(
        self,
        registry: RedisRegistry,
        settings: SubscriberSettings | None = None,
        token: str | None = None,
    ) -> None:
        self.store = MemoryStore()
        self._shared = registry
        self._local = EngineRegistry()  # what this mirror consumes, synced from the shared one
        self._consumed: dict[str, bytes] = {}  # engine -> the registry entry it runs with
        self._refused: dict[str, bytes] = {}  # engine -> an entry it could not start, once
        self._subscriber = Subscriber(self.store, self._local, settings, token)

    def add_observer(
        self,
        observer: Callable[[RankId, EventBatch], None],
        reads_tokens: Callable[[str], bool] | None = None,
    ) -> None:
        """See :meth:`~indexer.ingest.subscriber.RankPool.add_observer`."""
        self._subscriber.add_observer(observer, reads_tokens)

    async def start(self) -> None:
        """Consume every engine the shared registry lists (as last refreshed)."""
        await self._subscriber.start()
        await self.sync()

    async def stop(self) -> None:
        """Stop every consumer, each after the batch in hand."""
        await self._subscriber.stop()
        await self.store.close()

    def running(self) -> bool:
        return self._subscriber.running()

    def rank_status(self, engine: str) -> list[RankStatus]:
        """One status per dp rank; an engine registered but not consumed yet is blank
        (not connected, so degraded). Raises UnknownEngine for an unregistered one."""
        try:
            return self._subscriber.rank_status(engine)
        except UnknownEngine:
            spec = self._shared.get(engine)
            return [blank_status(spec, dp_rank) for dp_rank in range(spec.dp_ranks)]

    async def sync(self) -> None:
        """Start the engines the shared registry added, stop (and forget) the ones it
        removed; an engine whose entry changed is started again from its new spec."""
        shared = self._shared.entries()
        for name, entry in list(self._consumed.items()):
            if shared.get(name, (None, b""))[1] != entry:
                del self._consumed[name]
                await self._local.remove(name)
        for name, (spec, entry) in shared.items():
            if name in self._consumed or self._refused.get(name) == entry:
                continue
            try:
                await self._local.add(spec)
            except Exception as e:  # one engine's bad spec must not stop the others
                log.warning("cannot mirror engine", extra={"engine": name, "error": repr(e)})
                self._refused[name] = entry  # logged once, tried again when its entry changes
                continue
            self._consumed[name] = entry

    async def follow(self, interval: float) -> None:
        """Refresh the shared registry and sync with it every ``interval`` seconds,
        forever (run it as a task, instead of the registry's own follow)."""
        await repeat(interval, self._refresh, "mirror")

    async def _refresh(self) -> None:
        await self._shared.refresh()
        await self.sync()
