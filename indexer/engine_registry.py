"""Engines kvindex follows: their declared configuration and the registry.

The registry is the one place engines are added and removed: the config
file and CLI flags seed it, the operator API (``POST``/``DELETE /engines``)
changes it at runtime, and consumers follow it. :class:`Registry` is what
the API needs of one: :class:`EngineRegistry` keeps engines in process and
has the subscriber of ``kvindex serve`` listen to it;
:class:`~indexer.cluster.redis_registry.RedisRegistry` keeps them in Redis for API
replicas and indexer workers. ``RankStatus`` is what operators see of each rank.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Literal, Protocol

import msgspec

from indexer.core.addresses import check_topic_and_replay
from indexer.core.large_blocks import LargeBlocks
from indexer.engines import catalog
from indexer.engines.base import EngineAdapter
from indexer.kv_groups import KVGroup, Positive, check_kv_groups, large_blocks, released_before

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]
# Checked by EngineSpec.__post_init__, which says what was expected; the
# pattern is only for the OpenAPI schema.
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")
_PATH = re.compile(r"(ipc|inproc)://\S+")
Endpoint = Annotated[
    str,
    msgspec.Meta(
        description="tcp://HOST:PORT, ipc://PATH or inproc://NAME",
        extra_json_schema={"pattern": f"^({_TCP.pattern}|{_PATH.pattern})$"},
    ),
]
Release = Annotated[
    str, msgspec.Meta(pattern=r"^\d+\.\d+", max_length=64, description="such as 0.34.0")
]
LookaheadTokens = Annotated[
    int,
    msgspec.Meta(
        ge=0,
        description="tokens after each block that its hash covers: vLLM's"
        " num_hash_lookahead_tokens (EAGLE-style drafting that drops blocks, prefix caching"
        " on, no KV connector or, in vLLM 0.34, one that supports it); 0 for none",
    ),
]
#: Every hash algorithm some engine adapter reproduces.
HASH_ALGOS = catalog.hash_algos()
_MAX_PORT = 65535


def check_endpoint(field: str, endpoint: str, dp_ranks: int) -> None:
    """Raise ValueError for an endpoint ZMQ cannot use, or whose last rank's
    port (``port + dp_ranks - 1``) is not a port."""
    tcp = _TCP.fullmatch(endpoint)
    if tcp is None:
        if _PATH.fullmatch(endpoint):
            return
        raise ValueError(f"{field}: expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    port = int(tcp[2])
    if not 1 <= port <= _MAX_PORT:
        raise ValueError(f"{field}: port {port} of {endpoint!r} is not in 1-{_MAX_PORT}")
    if port + dp_ranks - 1 > _MAX_PORT:
        raise ValueError(
            f"{field}: with dp_ranks={dp_ranks}, rank {dp_ranks - 1} of {endpoint!r} would use"
            f" port {port + dp_ranks - 1}, above {_MAX_PORT}"
        )


def is_loopback(host: str) -> bool:
    """Whether an address is reachable from this machine only. Names other than
    ``localhost`` are not taken as loopback: what they resolve to can change."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ReuseReports = Literal["filtered", "capped", "counted"]
#: What each ``reuse_reports`` means. A request may ask vLLM for a reuse report
#: (``vllm_xargs: {"kv_cache_report_mode": "full"}``): vLLM then announces every
#: GPU block the request reused as a ``BlockStored`` exactly like a new physical
#: copy, and nothing removes it later.
REUSE_REPORTS = {
    "filtered": "the engine's kvindex plugin publishes a stream without reports:"
    " every GPU copy counted, exact",
    "capped": "vLLM's own stream, where a report looks like a copy: at most one"
    " reference per GPU block, so never a phantom; a second copy's eviction"
    " is counted as an unknown removal, the block missed until it goes",
    "counted": "the operator says no client asks for reports: every GPU store"
    " counted as a copy (a report would leave a phantom)",
}


class EngineSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine as declared (vLLM's ``--kv-events-config``): ``POST /engines``'s body.
    ``block_size`` is never assumed: vLLM's default changed (16 in 0.33, 64 in 0.34)
    and its attention backend may pick another; a wrong guess matches nothing."""

    #: The engine's name in answers, metrics and ``/engines/{name}``.
    name: Name
    #: Where rank 0 publishes KV events (rank r at port + r); unless ``events`` is false.
    endpoint: Endpoint | None = None
    #: The model it serves: queries naming a ``model`` match only its engines.
    model: str = ""
    #: Where rank 0 answers replay; without it a missed batch leaves the rank degraded.
    replay_endpoint: Endpoint | None = None
    #: Data-parallel ranks (``--data-parallel-size``), each publishing at port + r.
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: The topic the engine publishes under (``kv_events_config``'s ``topic``).
    topic: str = ""
    #: Tokens per block; null: learned from the first ``BlockStored`` (zeros until then).
    block_size: Positive | None = None
    #: ``--prefix-caching-hash-algo``; null: not reproducible, matched by learned tokens.
    hash_algo: Literal[HASH_ALGOS] | None = "sha256"
    #: The engine's ``PYTHONHASHSEED`` if set: it seeds sha256 chains too (docs/vllm.md).
    hash_seed: str | None = None
    #: vLLM's ``num_hash_lookahead_tokens``: tokens after a block its hash covers (EAGLE).
    lookahead_tokens: LookaheadTokens = 0
    #: Blocks per offload chunk of the CPU and storage tiers (the groups' blocks, where
    #: they are larger than ``block_size``); null: learned from events.
    blocks_per_chunk: Positive | None = None
    #: True: kvindex binds (within ``subscriber.bind``), the engine connects to it.
    bind: bool = False
    #: The KV cache groups by ``group_idx`` (null: learned); declared, they are checked.
    kv_groups: list[KVGroup] | None = None
    #: False: no KV events; routed by routers' ``POST /routed`` entries alone (an LRU).
    events: bool = True
    #: The GPU's KV cache capacity in blocks: bounds routed entries and GPU residency.
    gpu_blocks: Positive | None = None
    #: The event wire: ``vllm``, ``vllm_legacy`` (older positional events), ``sglang``.
    adapter: Literal[catalog.names()] = catalog.DEFAULT  # type: ignore[valid-type]
    #: How reuse reports reach kvindex (docs/residency.md); ``filtered``: the plugin's.
    reuse_reports: ReuseReports = "capped"
    #: The engine's OpenAI server: where it was described, and its load is scraped.
    url: str | None = None
    #: Where rank 0 answers snapshots (the vLLM plugin): asked when replay cannot help.
    snapshot_endpoint: Endpoint | None = None
    #: The engine's release (the vLLM plugin announces vLLM's version): rules that changed
    #: between releases follow it (docs/vllm.md); null: the newest release's rules.
    release: Release | None = None

    def __post_init__(self) -> None:
        if self.kv_groups:
            if self.block_size is None:
                raise ValueError("kv_groups: declared groups need the engine's block_size")
            check_kv_groups(self.kv_groups, self.block_size)
        check_topic_and_replay(self.topic, self.endpoint, self.replay_endpoint, self.bind)
        if self.events != (self.endpoint is not None):
            raise ValueError(
                "endpoint: required for an engine that publishes events, and only for one"
                " (events: false)"
            )
        if not self.events and (
            self.gpu_blocks is None or self.block_size is None or self.replay_endpoint or self.bind
        ):
            raise ValueError(
                "an engine with events: false needs gpu_blocks (its GPU capacity in blocks)"
                " and block_size (no event can teach it), and has no replay_endpoint or bind"
            )
        if self.snapshot_endpoint and not self.replay_endpoint:
            raise ValueError("snapshot_endpoint: needs the engine's replay_endpoint too")
        for field in ("endpoint", "replay_endpoint", "snapshot_endpoint"):
            endpoint = getattr(self, field)
            if endpoint is None:
                continue
            check_endpoint(field, endpoint, self.dp_ranks)
            if self.dp_ranks > 1 and endpoint.startswith("ipc://"):
                raise ValueError(
                    f"{endpoint}: vLLM gives each data-parallel rank its own tcp port or"
                    " inproc name, never an ipc path; use tcp:// for dp_ranks > 1"
                )

    @property
    def engine_adapter(self) -> EngineAdapter:
        return catalog.adapter(self.adapter)

    def rank_endpoint(self, dp_rank: int, replay: bool = False) -> str | None:
        """The endpoint of one rank, offset as its engine offsets it."""
        endpoint = self.replay_endpoint if replay else self.endpoint
        return self.engine_adapter.rank_endpoint(endpoint, dp_rank)

    def rank_snapshot_endpoint(self, dp_rank: int) -> str | None:
        """Where one rank answers snapshots (None: it does not)."""
        return self.engine_adapter.rank_endpoint(self.snapshot_endpoint, dp_rank)

    def released_before(self, major: int, minor: int) -> bool:
        """Whether the engine announced a release older than ``major.minor``."""
        return released_before(self.release, major, minor)

    def serves_empty_tools(self) -> bool:
        """Whether the engine's server serves a chat's ``tools: []`` as no tools."""
        since = self.engine_adapter.empty_tools_since
        return since is not None and not self.released_before(*since)

    @property
    def large_blocks(self) -> LargeBlocks | None:
        """The engine's shape when its groups' blocks span several hash blocks (None:
        they do not, or no group is declared)."""
        return large_blocks(self.kv_groups, self.block_size, self.blocks_per_chunk, self.release)


class BindRefused(ValueError):
    """An engine asks kvindex to bind where the operator has not allowed it."""


class BindPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where an engine with ``bind: true`` may make kvindex listen (``subscriber.bind``).

    A bind is a door anyone who can register an engine opens: for an ipc path ZMQ
    first unlinks whatever file is there, and a tcp listener on a public address takes
    events from anyone who reaches it. inproc never leaves the process: always allowed.
    """

    #: The directory ipc binds may be made in (over no file or an old socket); null: none.
    ipc_dir: str | None = None
    #: Non-loopback hosts tcp binds may be made on (``"*"``: any address).
    tcp_hosts: list[str] = []

    def check(self, spec: EngineSpec) -> None:
        """Raise :class:`BindRefused` unless kvindex may bind ``spec``'s endpoint."""
        if not spec.bind:
            return
        problem = None
        if spec.endpoint.startswith("ipc://"):
            problem = self._ipc_problem(spec.endpoint.removeprefix("ipc://"))
        elif tcp := _TCP.fullmatch(spec.endpoint):
            problem = self._tcp_problem(tcp[1])
        if problem:
            raise BindRefused(f"engine {spec.name!r} may not bind {spec.endpoint}: {problem}")

    def _ipc_problem(self, path: str) -> str | None:
        if self.ipc_dir is None:
            return "ipc binds are off (set subscriber.bind.ipc_dir to a directory for them)"
        if path.startswith(("@", "*")):
            return f"abstract and wildcard ipc names are not allowed; use a path in {self.ipc_dir}"
        # The parent resolved (a symlinked directory could point anywhere);
        # the name itself not: ZMQ unlinks a symlink, not its target.
        parent = Path(os.path.realpath(os.path.dirname(os.path.abspath(path))))
        if not parent.is_relative_to(os.path.realpath(self.ipc_dir)):
            return f"not in subscriber.bind.ipc_dir ({self.ipc_dir})"
        target = parent / os.path.basename(path)
        try:
            mode = target.lstat().st_mode
        except FileNotFoundError:
            return None
        if not stat.S_ISSOCK(mode):
            return f"{target} exists and is not a socket (kvindex never replaces it)"
        return None

    def _tcp_problem(self, host: str) -> str | None:
        if is_loopback(host) or host in self.tcp_hosts or "*" in self.tcp_hosts:
            return None
        return f"{host} is not loopback (list it in subscriber.bind.tcp_hosts to allow it)"


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
    store_loss: str | None = None  # the store lost batches of it: why, and how it recovers
    over_capacity: str | None = None  # media over the rank's bound, refused until a restart
    gaps: int = 0
    gaps_filled: int = 0
    gaps_unfilled: int = 0
    replays: int = 0
    restarts: int = 0
    # the engine answers snapshots (its snapshot_endpoint): what replay cannot bring,
    # the rank restores from one; restores: snapshots applied; why the last did not come
    snapshots: bool = False
    restores: int = 0
    snapshot_error: str | None = None
    rejected: dict[str, int] = {}  # bad frames by reason
    duplicates: int = 0  # batches received again (live and replay overlap) and skipped
    store_errors: int = 0  # failed store calls, each retried
    kv_group_mismatches: int = 0  # groups whose events contradict the declared kv_groups
    lag_batches: int = 0
    lag_seconds: float = 0.0
    last_event_ts: float | None = None
    owner: str | None = None  # the indexer worker consuming it (None: this process)
    # False: the engine publishes no events (``events: false``), so there is
    # nothing to connect to; routed entries alone stand for its cache
    events: bool = True


def blank_status(spec: EngineSpec, dp_rank: int) -> RankStatus:
    """The status of a rank before any batch (or one nothing consumes here): not
    connected, unless its
    engine publishes no events at all."""
    return RankStatus(dp_rank, events=spec.events, snapshots=spec.snapshot_endpoint is not None)


def is_degraded(status: RankStatus | None) -> bool:
    """Whether a rank's answers may be wrong: no live connection, an unfilled gap,
    batches the store lost that are not applied again, or media refused for
    holding more blocks than the rank's bound.

    A rank with no status at all (unknown) counts as not connected; a rank of
    an engine without events is never degraded (its answers are approximate by
    declaration). Prefix matches, ``/engines``, ``/stats`` and the metrics all
    use this one rule; :func:`degraded_reasons` says why in words.
    """
    if status is not None and not status.events:
        return False
    over = status is not None and status.over_capacity is not None
    return status is None or status.degraded or not status.connected or over


def degraded_reasons(status: RankStatus | None) -> list[str]:
    """Why :func:`is_degraded` holds, one phrase per cause (empty when it does not)."""
    if status is None:
        return ["not consumed: no status"]
    if not status.events:
        return []
    reasons = []
    if status.never_connected:
        reasons.append("never connected: no publisher at its endpoint")
    elif not status.connected:
        reasons.append("not connected")
    if status.store_loss is not None:
        reasons.append(f"store loss: {status.store_loss}")
    if status.missing:
        gaps = ", ".join(f"{g.first}..{g.last}" for g in status.missing)
        reasons.append(f"unfilled gaps: batches {gaps}")
    if status.over_capacity is not None:
        reasons.append(f"over capacity: {status.over_capacity}")
    if status.degraded and status.store_loss is None and not status.missing:
        reasons.append("missed batches replay could not fill")
    return reasons


class ConsumerView(Protocol):
    """What the API reads of the running subscriber (or of the shared store
    when the API runs as its own process)."""

    def rank_status(self, engine: str) -> list[RankStatus]:
        """One status per declared dp rank of the engine, in rank order."""

    def running(self) -> bool:
        """Whether event consumption is up (for ``/readyz``)."""
