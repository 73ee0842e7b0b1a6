"""The rank consumers of one process, and the subscriber that runs every registered rank.

A :class:`RankPool` holds the running :class:`~indexer.ingest.rank_consumer.RankConsumer`
s of a process: one ZMQ context, one budget of replay requests, the batch
observers, the status gauges. Two things decide what runs in it: the
:class:`Subscriber` of ``kvindex serve`` follows an
:class:`~indexer.engine_registry.EngineRegistry` and runs every rank of every engine;
a :class:`~indexer.cluster.workers.Worker` of ``kvindex indexer`` runs the ranks it
holds a lease on.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import resource
from collections.abc import Callable, Iterator

import zmq.asyncio

from indexer import metrics
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import Change, EngineRegistry, EngineSpec, RankStatus, blank_status
from indexer.ingest.rank_consumer import RankConsumer
from indexer.ingest.settings import APPLY_SLICE, Observer, Shared, SubscriberSettings
from indexer.ingest.slices import Slices
from indexer.stores.base import Loss, Store

__all__ = ["RankPool", "Subscriber", "SubscriberSettings"]

log = logging.getLogger("kvindex.subscriber")

#: Open files asked for when the hard limit allows more (or is unlimited).
_MAX_FILES = 1 << 20


def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def raise_file_limit() -> int:
    """Raise the soft limit on open files to the hard one; the new soft limit.

    Each rank holds three ZeroMQ sockets (SUB and a monitor pair) and about
    four files (their mailboxes and the connection), one more of each while
    replaying: the usual soft limit of 1,024 files ends near 250 ranks.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _MAX_FILES if hard == resource.RLIM_INFINITY else min(hard, _MAX_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit", extra={"soft": soft, "error": str(e)})
    return soft


def return_memory() -> None:
    """Give freed memory back to the system now (glibc only; elsewhere a no-op).

    A removed engine's batches were freed, but glibc keeps freed heap pages
    (those of ZeroMQ's I/O thread in an arena of their own) until something
    trims them: a removed engine could leave hundreds of MB resident.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _context() -> zmq.asyncio.Context:
    """A context that may open as many sockets as the process may open files
    (ZeroMQ's default is 1,023, about 340 ranks)."""
    context = zmq.asyncio.Context()
    files = raise_file_limit()
    context.set(zmq.MAX_SOCKETS, max(1, min(files, context.get(zmq.SOCKET_LIMIT))))
    return context


class RankPool:
    """The rank consumers one process runs, started and stopped one rank at a time.

    ``token``: the bearer token engines' snapshot endpoints ask for (the API's:
    kvindex's vLLM plugin holds it to announce the engine).
    """

    def __init__(
        self, settings: SubscriberSettings | None = None, token: str | None = None
    ) -> None:
        self.settings = settings or SubscriberSettings()
        self._token = token
        self._ranks: dict[RankId, RankConsumer] = {}
        self._observers: list[Observer] = []
        self._token_readers: list[Callable[[str], bool]] = []
        self._failed_observers: set[int] = set()
        self._shared: Shared | None = None

    def add_observer(
        self, observer: Observer, reads_tokens: Callable[[str], bool] | None = None
    ) -> None:
        """Call ``observer(rank, batch)`` after every applied batch.

        Batches come with token ids only for engines some observer's
        ``reads_tokens(engine)`` asks them of: decoding them is half the
        cost of decoding a batch, and only the learned token index needs them.
        """
        self._observers.append(observer)
        if reads_tokens is not None:
            self._token_readers.append(reads_tokens)

    def open(self) -> None:
        """Make the shared ZMQ context; report rank gauges from now on."""
        self._shared = Shared(
            self.settings,
            _context(),
            asyncio.Semaphore(self.settings.max_concurrent_replays),
            asyncio.Semaphore(self.settings.max_concurrent_snapshots),
            self._token,
            self._notify,
            self._reads_tokens,
            Slices(APPLY_SLICE),
        )
        metrics.watch(self)

    async def close(self) -> None:
        """Stop every consumer, each after the batch in hand."""
        shared, self._shared = self._shared, None
        consumers = list(self._ranks.values())
        self._ranks.clear()
        await asyncio.gather(*(c.stop() for c in consumers))
        if shared is not None:
            shared.context.destroy(linger=0)

    @property
    def is_open(self) -> bool:
        return self._shared is not None

    def start(
        self, spec: EngineSpec, dp_rank: int, store: Store, fence: int | None = None
    ) -> RankConsumer:
        """Start consuming one rank into ``store``, under claim token ``fence`` if given
        (raises if its sockets cannot open)."""
        assert self._shared is not None, "start() on a closed pool"
        consumer = RankConsumer(spec, dp_rank, store, self._shared, fence)
        consumer.start()
        self._ranks[consumer.rank] = consumer
        return consumer

    async def stop(self, rank: RankId) -> RankConsumer | None:
        """Stop one rank after the batch in hand and drop its metric series."""
        consumer = self._ranks.pop(rank, None)
        if consumer is not None:
            await consumer.stop()
            consumer.metrics.remove()
        return consumer

    def notice_store_loss(self, loss: Loss) -> None:
        """Have every consumer resynchronise with the store (even idle ones)."""
        for consumer in self._ranks.values():
            consumer.notice_store_loss()

    def running(self) -> bool:
        return self._shared is not None and not any(c.failed for c in self._ranks.values())

    def rank_status(self, spec: EngineSpec) -> list[RankStatus]:
        """One status per dp rank of the engine; a rank not run here has a blank one."""
        statuses = []
        for dp_rank in range(spec.dp_ranks):
            consumer = self._ranks.get(RankId(spec.name, dp_rank))
            statuses.append(consumer.status_now() if consumer else blank_status(spec, dp_rank))
        return statuses

    def statuses(self) -> Iterator[tuple[str, RankStatus]]:
        """``(engine, status)`` of every rank run here (the metrics' gauges)."""
        for rank, consumer in list(self._ranks.items()):
            yield rank.engine, consumer.status_now()

    def _reads_tokens(self, engine: str) -> bool:
        return any(reads(engine) for reads in self._token_readers)

    def _notify(self, rank: RankId, batch: EventBatch) -> None:
        for observer in self._observers:
            try:
                observer(rank, batch)
            except Exception:
                if id(observer) not in self._failed_observers:
                    self._failed_observers.add(id(observer))
                    log.exception("batch observer failed", extra={"observer": repr(observer)})


class Subscriber:
    """Consumes every registered engine rank into the store.

    Implements :class:`~indexer.engine_registry.ConsumerView` for the API. Engines
    added to or removed from the registry while running are started or
    stopped (and their store state forgotten) before the registry call returns.
    """

    def __init__(
        self,
        store: Store,
        registry: EngineRegistry,
        settings: SubscriberSettings | None = None,
        token: str | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._pool = RankPool(settings, token)
        self._listening = False

    def add_observer(
        self, observer: Observer, reads_tokens: Callable[[str], bool] | None = None
    ) -> None:
        """See :meth:`RankPool.add_observer`."""
        self._pool.add_observer(observer, reads_tokens)

    async def start(self) -> None:
        """Start consuming every registered engine, and follow the registry."""
        self._pool.open()
        if not self._listening:
            self._registry.listen(self._on_change)
            self._store.on_loss(self._pool.notice_store_loss)
            self._listening = True
        for spec in self._registry.all():
            await self._start_engine(spec)

    async def stop(self) -> None:
        """Stop every consumer, each after the batch in hand."""
        await self._pool.close()

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def running(self) -> bool:
        return self._pool.running()

    def rank_status(self, engine: str) -> list[RankStatus]:
        """One status per dp rank of a registered engine (raises UnknownEngine)."""
        return self._pool.rank_status(self._registry.get(engine))

    async def _start_engine(self, spec: EngineSpec) -> None:
        if not spec.events:
            return  # nothing to consume: routed entries alone stand for its cache
        started: list[RankId] = []
        try:
            for dp_rank in range(spec.dp_ranks):
                started.append(self._pool.start(spec, dp_rank, self._store).rank)
        except BaseException:
            await asyncio.gather(*(self._pool.stop(rank) for rank in started))
            raise

    async def _on_change(self, change: Change, spec: EngineSpec) -> None:
        if not self._pool.is_open:
            return
        if change == "added":
            await self._start_engine(spec)
            return
        ranks = [RankId(spec.name, dp_rank) for dp_rank in range(spec.dp_ranks)]
        stopped = await asyncio.gather(*(self._pool.stop(rank) for rank in ranks))
        for consumer in filter(None, stopped):
            try:
                await self._store.forget(consumer.rank)
            except Exception as e:
                log.warning("could not forget rank", extra=consumer.ids(error=repr(e)))
        return_memory()
