"""Engines kvindex follows: their declared configuration and the registry.

The registry is the one place engines are added and removed: the config
file and CLI flags seed it, the operator API (``POST``/``DELETE /engines``)
changes it at runtime, and consumers follow it. :class:`Registry` is what
the API needs of one: :class:`EngineRegistry` keeps engines in process and
has the subscriber of ``kvindex serve`` listen to it;
:class:`~indexer.redis_registry.RedisRegistry` keeps them in Redis for API
replicas and indexer workers. ``RankStatus`` is what operators see of each rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal, Protocol

import msgspec

from indexer.hashing import HASH_ALGOS
from indexer.wire import offset_endpoint

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^(tcp://[^\s:]+:\d{1,5}|ipc://\S+|inproc://\S+)$")]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine as declared by an operator (vLLM's ``--kv-events-config``).

    Data-parallel rank r publishes on the endpoint's port + r, for both the
    PUB and the replay socket, exactly as vLLM offsets them.
    """

    name: Name
    endpoint: Endpoint
    model: str = ""
    replay_endpoint: Endpoint | None = None
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    topic: str = ""
    block_size: Positive = 16
    hash_algo: Literal[HASH_ALGOS] | None = "sha256"  # None: not reproducible here
    hash_seed: str | None = None
    blocks_per_chunk: Positive | None = None
    bind: bool = False  # True: kvindex binds and the engine connects

    def __post_init__(self) -> None:
        for endpoint in (self.endpoint, self.replay_endpoint):
            if self.dp_ranks > 1 and endpoint and endpoint.startswith("ipc://"):
                raise ValueError(
                    f"{endpoint}: vLLM gives each data-parallel rank its own tcp port or"
                    " inproc name, never an ipc path; use tcp:// for dp_ranks > 1"
                )

    def rank_endpoint(self, dp_rank: int, replay: bool = False) -> str | None:
        """The endpoint of one rank, offset as vLLM offsets it."""
        return offset_endpoint(self.replay_endpoint if replay else self.endpoint, dp_rank)


def parse_engine_flag(text: str) -> EngineSpec:
    """An engine from ``NAME=ENDPOINT[,FIELD=VALUE...]``, the ``--engine`` flag.

    Fields are :class:`EngineSpec`'s, values as in a config file (``null``
    for none), e.g. ``a=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558,dp_ranks=2``.
    Raises ValueError saying what is wrong.
    """
    head, *rest = text.split(",")
    name, sep, endpoint = head.partition("=")
    pairs = [item.partition("=") for item in rest if item]
    if not sep or not all(eq for _, eq, _ in pairs):
        raise ValueError(f"--engine {text!r}: expected NAME=ENDPOINT[,FIELD=VALUE...]")
    fields = {"name": name, "endpoint": endpoint, **{k.strip(): v for k, _, v in pairs}}
    try:
        return msgspec.convert(fields, EngineSpec, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"--engine {text!r}: {e}") from None


class EngineExists(KeyError):
    """An engine of that name is already registered."""


class UnknownEngine(KeyError):
    """No engine of that name is registered."""


Change = Literal["added", "removed"]
Listener = Callable[[Change, EngineSpec], Awaitable[None]]


class Registry(Protocol):
    """Where engines are registered, as the API uses it."""

    async def add(self, spec: EngineSpec) -> EngineSpec:
        """Register an engine (raises :class:`EngineExists`)."""

    async def remove(self, name: str) -> EngineSpec:
        """Deregister an engine and drop its residency (raises :class:`UnknownEngine`)."""

    def get(self, name: str) -> EngineSpec:
        """One engine (raises :class:`UnknownEngine`)."""

    def all(self) -> list[EngineSpec]:
        """Every engine, by name."""


class EngineRegistry:
    """Registered engines, kept in process, with change listeners.

    Listeners run in registration order and are awaited, so when
    :meth:`add` returns the subscriber is already consuming the engine.
    """

    def __init__(self) -> None:
        self._engines: dict[str, EngineSpec] = {}
        self._listeners: list[Listener] = []
        self._lock = asyncio.Lock()

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def add(self, spec: EngineSpec) -> EngineSpec:
        """Register an engine; if a listener cannot take it, it is not registered."""
        async with self._lock:
            if spec.name in self._engines:
                raise EngineExists(spec.name)
            self._engines[spec.name] = spec
            try:
                await self._notify("added", spec)
            except BaseException:
                del self._engines[spec.name]
                raise
        return spec

    async def remove(self, name: str) -> EngineSpec:
        async with self._lock:
            spec = self._engines.pop(name, None)
            if spec is None:
                raise UnknownEngine(name)
            await self._notify("removed", spec)
        return spec

    def get(self, name: str) -> EngineSpec:
        try:
            return self._engines[name]
        except KeyError:
            raise UnknownEngine(name) from None

    def all(self) -> list[EngineSpec]:
        return sorted(self._engines.values(), key=lambda s: s.name)

    async def _notify(self, change: Change, spec: EngineSpec) -> None:
        for listener in self._listeners:
            await listener(change, spec)


class Gap(msgspec.Struct):
    """A range of seqs a rank missed: ``first..last`` inclusive."""

    first: int
    last: int
    seen_at: float
    filled: bool = False


class RankStatus(msgspec.Struct):
    """What an operator sees of one (engine, dp_rank) consumer."""

    dp_rank: int
    connected: bool = False
    # Nothing has connected since the consumer started, for longer than the
    # subscriber's no_publisher_after: the endpoint is likely wrong or the engine down.
    never_connected: bool = False
    last_seq: int | None = None  # newest seq received (live or replay)
    applied_seq: int | None = None
    degraded: bool = False
    missing: list[Gap] = []  # unfilled gaps, newest last
    gaps: int = 0
    gaps_filled: int = 0
    gaps_unfilled: int = 0
    replays: int = 0
    restarts: int = 0
    rejected: dict[str, int] = {}  # bad frames by reason
    duplicates: int = 0  # batches received again (live and replay overlap) and skipped
    store_errors: int = 0  # failed store calls, each retried
    lag_batches: int = 0
    lag_seconds: float = 0.0
    last_event_ts: float | None = None
    owner: str | None = None  # the indexer worker consuming it (None: this process)


class ConsumerView(Protocol):
    """What the API reads of the running subscriber (or of the shared store
    when the API runs as its own process)."""

    def rank_status(self, engine: str) -> list[RankStatus]:
        """One status per declared dp rank of the engine, in rank order."""

    def running(self) -> bool:
        """Whether event consumption is up (for ``/readyz``)."""
