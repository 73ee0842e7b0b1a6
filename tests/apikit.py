"""What the API tests share: a fake or the real subscriber, an HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI

from api import ApiSettings
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec, RankStatus
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.subscriber import Subscriber
from indexer.ingest.trace import Trace
from indexer.stores import MemoryStore, apply_events
from indexer.stores.base import Store
from kvindex.http import listen, serve_http
from kvindex.wiring import api_app
from producer.publisher import Publisher

from .conftest import free_ports, wait_until

Observer = Callable[[RankId, EventBatch], None]


class FakeConsumers:
    """A :class:`~indexer.engine_registry.ConsumerView` standing in for the subscriber.

    :meth:`apply` does what the subscriber does with a batch: apply it to the
    store, then tell the observers (the learned token index) if it was new.
    Every rank is connected unless ``statuses`` says otherwise.
    """

    def __init__(self, store: Store, running: bool = True) -> None:
        self.store = store
        self.is_running = running
        self.statuses: dict[str, list[RankStatus]] = {}
        self.observers: list[Observer] = []

    def rank_status(self, engine: str) -> list[RankStatus]:
        return self.statuses.get(engine, [RankStatus(dp_rank=0, connected=True)])

    def running(self) -> bool:
        return self.is_running

    def add_observer(self, observer: Observer, reads_tokens: object = None) -> None:
        self.observers.append(observer)

    async def apply(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        if (await apply_events(self.store, rank, seq, batch)).applied:
            for observer in self.observers:
                observer(rank, batch)

    async def apply_trace(self, rank: RankId, trace: Trace) -> None:
        for seq, payload in trace:
            await self.apply(rank, seq, decode_batch(payload))


#: The block size the tests' engines declare unless told (kvindex assumes none).
BLOCK_SIZE = 16


def engine(name: str, **fields) -> EngineSpec:
    """A spec with a syntactically valid endpoint nobody listens on."""
    return EngineSpec(
        name=name, endpoint="tcp://127.0.0.1:1", **{"block_size": BLOCK_SIZE, **fields}
    )


class Api:
    """An app over a memory store with a fake subscriber, and a client for it."""

    def __init__(self, settings: ApiSettings | None = None, store: Store | None = None) -> None:
        self.store = store or MemoryStore()
        self.registry = EngineRegistry()
        self.consumers = FakeConsumers(self.store)
        self.app: FastAPI = api_app(
            self.store, self.registry, self.consumers, settings or ApiSettings()
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://kvindex"
        )

    async def add(self, spec: EngineSpec) -> EngineSpec:
        return await self.registry.add(spec)

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.loads.close()


def get_json(http: httpx.Client, path: str) -> dict | None:
    """A live server's JSON answer to ``GET path``; None while it is not there yet
    (connection refused, or not 200: still starting), so pollers can wait on it."""
    try:
        answer = http.get(path)
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code == 200 else None


def csv(values) -> str:
    return ",".join(map(str, values))


class LiveApi:
    """The real pipeline: publishers on local ports, the subscriber, the store, the app.

    What :class:`Api` fakes (the subscriber) is real here, so the token index
    is fed by the subscriber's observers exactly as in ``kvindex serve``.
    """

    def __init__(self, settings: ApiSettings | None = None, store: Store | None = None) -> None:
        self.store = store or MemoryStore()
        self.registry = EngineRegistry()
        self.subscriber = Subscriber(self.store, self.registry)
        self.app = api_app(self.store, self.registry, self.subscriber, settings or ApiSettings())
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://kvindex"
        )
        self.publishers: list[Publisher] = []

    async def __aenter__(self) -> LiveApi:
        await self.subscriber.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        await self.subscriber.stop()
        for publisher in self.publishers:
            publisher.close()

    async def add_published(self, name: str, dp_ranks: int = 1, **fields) -> list[Publisher]:
        """Register an engine whose ranks publish on fresh local ports."""
        base = free_ports(2 * dp_ranks)
        spec = EngineSpec(
            name=name,
            endpoint=f"tcp://127.0.0.1:{base}",
            replay_endpoint=f"tcp://127.0.0.1:{base + dp_ranks}",
            dp_ranks=dp_ranks,
            **{"block_size": BLOCK_SIZE, **fields},
        )
        publishers = [
            Publisher(spec.endpoint, spec.replay_endpoint, data_parallel_rank=r, bind=True)
            for r in range(dp_ranks)
        ]
        self.publishers += publishers
        await self.registry.add(spec)
        return publishers

    async def wait_applied(self, name: str, seqs: list[int]) -> None:
        """Until rank r of the engine has applied seq ``seqs[r]`` (live or replayed)."""

        def applied() -> bool:
            marks = [s.applied_seq for s in self.subscriber.rank_status(name)]
            return all(a is not None and a >= w for a, w in zip(marks, seqs, strict=True))

        await wait_until(applied, timeout=30.0, what=f"{name} to apply seqs {seqs}")


@contextlib.asynccontextmanager
async def served(app: FastAPI, settings: ApiSettings) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` on a real port through uvicorn as ``kvindex serve`` runs it
    (:func:`~kvindex.http.serve_http`), and a client of it."""
    stop = asyncio.Event()
    with listen("127.0.0.1", 0) as sock:
        server = asyncio.create_task(serve_http(app, settings, sock, stop))
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                yield client
        finally:
            stop.set()
            await asyncio.wait_for(server, 15)
