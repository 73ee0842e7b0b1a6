"""Engines given by the URL of their OpenAI server, which describes them.

vLLM's OpenAI server (0.32 and later) answers ``GET /kv_event_sources`` with
each data-parallel rank's KV events config (endpoint, replay endpoint, topic;
a map by rank, or a list of entries naming their ``data_parallel_rank`` in
later versions) and ``GET /v1/models`` with the models it serves. So the
``http://HOST:PORT`` routers already send requests to is enough to follow an
engine: :func:`describe` asks both and makes the
:class:`~indexer.engine_registry.EngineSpec`, which keeps the URL in ``url``. Other
engine types describe their publishers elsewhere (SGLang: ``/server_info``):
the engine's adapter (the ``adapter`` field) says where, and reads the answer
into the ranks' configs read here.

- A wildcard or loopback host in an endpoint (vLLM binds ``tcp://*:5557``) is
  the URL's host: where the server is, its publisher is.
- Rank r must publish at rank 0's ports + r (vLLM's rule, which the subscriber
  follows); a server whose entries say otherwise is refused with what differs.
- The model is the first one served that is not a LoRA adapter.
- vLLM states no block size: the spec leaves it null and kvindex learns it from
  the first ``BlockStored`` (:mod:`indexer.misdeclared`), unless the operator
  gives it; SGLang states its page size, which is the block size.

The operator may give any other field (``name``, ``hash_algo``, ``hash_seed``,
``block_size``, ``model``...), which wins over the description; the name
defaults to the URL's ``HOST:PORT``, stable for as long as the server's address.
What the server decides (endpoints, ranks, topic) cannot be given.
:class:`UrlEngines` registers the engines of flags and config files, retrying
with backoff while their servers cannot be asked: a kvindex may start first.
:func:`follow_moves` asks again the server of an engine none of whose ranks is
connected, and registers the engine anew where it now publishes (an engine
restarted with other ports or ranks).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import tenacity

from indexer.discovery.source import host_port
from indexer.engine_flags import nullable, parse_flag_fields
from indexer.engine_registry import EngineSpec, Registry, is_loopback
from indexer.engines import catalog
from indexer.engines.base import EngineAdapter
from indexer.retrying import repeat

log = logging.getLogger("kvindex.discovery")

#: Fields the server's answers decide, which an operator cannot give.
DESCRIBED = frozenset(
    {"endpoint", "replay_endpoint", "dp_ranks", "topic", "url", "bind", "events", "gpu_blocks"}
)
_FIELDS = frozenset(f.name for f in msgspec.structs.fields(EngineSpec))
_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")
_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]"})
#: What the server places: the fields an engine restarted elsewhere changes.
PLACEMENT = ("endpoint", "replay_endpoint", "dp_ranks", "topic")
#: Seconds one request to an engine's server may take.
TIMEOUT = 5.0
#: Seconds between looks at the servers of engines none of whose ranks is connected.
RECHECK = 10.0


class Unreachable(Exception):
    """The engine's server did not answer (refused, timed out): worth asking again."""


class BadAnswer(Exception):
    """The engine's server answered, but not as vLLM's OpenAI server does."""


class Unsupported(ValueError):
    """The engine's events cannot be followed as its server describes them."""


@dataclass(frozen=True)
class EngineUrl:
    """An engine to describe: its server's URL and the fields the operator gave."""

    url: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.fields.get("name") or default_name(self.url)


def default_name(url: str) -> str:
    """``HOST:PORT`` of the URL (the scheme's port when it has none)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def engine_url(url: str, fields: Mapping[str, Any] | None = None) -> EngineUrl:
    """An engine given by ``url`` with ``fields`` (EngineSpec's, values typed or as
    text; None as a flag's ``null``); raises ValueError saying what is wrong, before any
    server is asked."""
    fields = dict(fields or {})
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not one)
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        raise ValueError(f"url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r}: expected http://HOST[:PORT], the engine's OpenAI server")
    if unknown := sorted(fields.keys() - _FIELDS):
        raise ValueError(f"url {url!r}: unknown field(s) {', '.join(unknown)}")
    if given := sorted(fields.keys() & DESCRIBED):
        raise ValueError(
            f"url {url!r}: {', '.join(given)}: set by the engine's server for an engine"
            " given by its URL (register it by its endpoint to set them)"
        )
    defaults = [k for k, v in fields.items() if v is None and not nullable(k)]
    target = EngineUrl(url, {k: v for k, v in fields.items() if k not in defaults})
    _spec(target, {"endpoint": "tcp://127.0.0.1:1"})  # refuse a bad field now
    return target


def parse_engine_url(text: str) -> EngineUrl:
    """``URL[,FIELD=VALUE...]``, the ``--engine-url`` flag (values as ``--engine``'s)."""
    url, *rest = text.split(",")
    return engine_url(url, parse_flag_fields(rest, f"--engine-url {text!r}"))


async def describe(target: EngineUrl, timeout: float = TIMEOUT) -> EngineSpec:
    """The engine as its server describes it, with the operator's fields over that.

    Raises :class:`Unreachable`, :class:`BadAnswer` or :class:`Unsupported`, each
    naming the URL.
    """
    adapter = _adapter(target)
    if adapter.sources_path is None:
        raise Unsupported(f"url {target.url!r}: a {adapter.name} server does not describe itself")
    async with httpx.AsyncClient(timeout=timeout) as client:
        sources = await _get(client, target.url, adapter.sources_path)
        models = await _get(client, target.url, "/v1/models")
    return spec_of(target, sources, models)


def _adapter(target: EngineUrl) -> EngineAdapter:
    return catalog.adapter(target.fields.get("adapter") or catalog.DEFAULT)


def spec_of(target: EngineUrl, sources: Any, models: Any) -> EngineSpec:
    """The spec the server's two answers and the operator's fields make."""
    adapter = _adapter(target)
    where = _at(target.url, adapter.sources_path or "")
    try:
        sources = adapter.read_sources(sources)
    except ValueError as e:
        raise Unsupported(f"{where}: {e}") from None
    ranks = _ranks(sources, where)
    host = urlsplit(target.url).hostname or ""
    first = ranks[0]
    _check_publisher(first, where)
    endpoint = _reachable(first.get("endpoint"), host, where)
    replay = first.get("replay_endpoint")
    replay = _reachable(replay, host, where) if replay else None
    for r, entry in enumerate(ranks[1:], 1):
        _check_publisher(entry, where)
        for key, base in (("endpoint", endpoint), ("replay_endpoint", replay)):
            given = entry.get(key)
            shown = _reachable(given, host, where) if given else None
            if shown not in (base, adapter.rank_endpoint(base, r)):
                raise Unsupported(
                    f"{where}: rank {r}'s {key} is {given}, not rank 0's port + {r}"
                    f" ({adapter.rank_endpoint(base, r)}): kvindex follows data-parallel ranks"
                    " only at port + rank, as vLLM places them on one host"
                )
        if (entry.get("topic") or "") != (first.get("topic") or ""):
            raise Unsupported(f"{where}: ranks publish on different topics, kvindex takes one")
    described = {
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "dp_ranks": len(ranks),
        "topic": first.get("topic") or "",
        "model": _served_model(models, _at(target.url, "/v1/models")),
    }
    if isinstance(first.get("block_size"), int):  # SGLang states it; vLLM does not
        described["block_size"] = first["block_size"]
    return _spec(target, described)


def _spec(target: EngineUrl, described: dict[str, Any]) -> EngineSpec:
    fields = {"block_size": None, **described, **target.fields}
    fields |= {"name": target.name, "url": target.url}
    try:
        return msgspec.convert(fields, EngineSpec, strict=False)
    except msgspec.ValidationError as e:
        raise Unsupported(f"url {target.url!r}: {e}") from None


def _at(url: str, path: str) -> str:
    return url.rstrip("/") + path


async def _get(client: httpx.AsyncClient, url: str, path: str) -> Any:
    where = _at(url, path)
    try:
        answer = await client.get(where)
    except httpx.TransportError as e:
        raise Unreachable(f"cannot reach {where}: {str(e) or type(e).__name__}") from None
    if answer.status_code != 200:
        raise BadAnswer(f"{where} answered {answer.status_code}: {answer.text[:200]}")
    try:
        return answer.json()
    except ValueError:
        raise BadAnswer(f"{where} answered something other than JSON") from None


def _ranks(sources: Any, where: str) -> list[dict[str, Any]]:
    """Each rank's config, in rank order: a map by rank (vLLM 0.32, 0.33), or a list of
    entries with their ``data_parallel_rank``."""
    if isinstance(sources, list):
        entries = [entry for entry in sources if isinstance(entry, dict)]
        sources = {entry.get("data_parallel_rank", i): entry for i, entry in enumerate(entries)}
    if not isinstance(sources, dict):
        raise BadAnswer(f"{where}: expected each data-parallel rank's events config")
    by_rank = {str(r): entry for r, entry in sources.items() if isinstance(entry, dict)}
    if not by_rank:
        raise Unsupported(
            f"{where}: no KV event sources: start vLLM with --kv-events-config"
            ' \'{"enable_kv_cache_events": true, "publisher": "zmq", ...}\''
        )
    ranks = [str(r) for r in range(len(sources))]
    if sorted(by_rank) != sorted(ranks):
        raise BadAnswer(f"{where}: expected a config for each rank 0..{len(sources) - 1}")
    return [by_rank[r] for r in ranks]


def _check_publisher(entry: dict[str, Any], where: str) -> None:
    if entry.get("enable_kv_cache_events") is False:
        raise Unsupported(
            f"{where}: enable_kv_cache_events is false: the engine publishes no KV events"
        )
    publisher = entry.get("publisher", "zmq")
    if publisher != "zmq":
        raise Unsupported(f"{where}: publisher {publisher!r}: kvindex follows zmq publishers only")


def _reachable(endpoint: Any, host: str, where: str) -> str:
    """The address kvindex connects to for an endpoint the engine binds."""
    if not isinstance(endpoint, str) or not endpoint:
        raise BadAnswer(f"{where}: an entry has no endpoint")
    tcp = _TCP.fullmatch(endpoint)
    if tcp is None:
        if endpoint.startswith("inproc://"):
            raise Unsupported(f"{where}: {endpoint} is inside the engine's process")
        return endpoint  # ipc://: on this machine (EngineSpec says if it cannot be used)
    bound = tcp[1]
    if bound in _WILDCARDS or is_loopback(bound):
        return f"tcp://{host_port(host, int(tcp[2]))}"
    return endpoint


def _served_model(models: Any, where: str) -> str:
    entries = models.get("data") if isinstance(models, dict) else None
    for entry in entries or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and not entry.get("parent"):
            return entry["id"]
    raise BadAnswer(f"{where}: names no served model")


#: Seconds between attempts to describe an engine: the first wait, and the longest.
FIRST_WAIT, LONGEST_WAIT = 0.5, 30.0


class UrlEngines:
    """Engines given by URL at start (flags, config file), each registered by
    ``register`` once its server has described it.

    A server that cannot be asked, or answers what cannot be followed (or anything
    else going wrong), is asked again with exponential backoff (``FIRST_WAIT``
    doubling up to ``LONGEST_WAIT``), each failure logged: kvindex may start before
    its engines, and a server being reconfigured comes right eventually. A
    registration that is refused is logged and not retried (the same spec would be
    refused again).
    """

    def __init__(
        self,
        targets: Iterable[EngineUrl],
        register: Callable[[EngineSpec], Awaitable[Any]],
        first_wait: float = FIRST_WAIT,
    ) -> None:
        self._register = register
        self._wait = tenacity.wait_exponential(multiplier=first_wait, max=LONGEST_WAIT)
        self._tasks = [
            asyncio.create_task(self._follow(t), name=f"engine url {t.url}") for t in targets
        ]

    async def _follow(self, target: EngineUrl) -> None:
        retrying = tenacity.AsyncRetrying(
            wait=self._wait,
            retry=tenacity.retry_if_exception_type(Exception),  # whatever it is, log and retry
            before_sleep=lambda state: _failed(target, state),
        )
        spec = await retrying(describe, target)
        try:
            await self._register(spec)
        except Exception as e:
            log.error(
                "engine described by its server cannot be registered",
                extra={"engine": spec.name, "url": target.url, "error": repr(e)},
            )
            return
        log.info(
            "engine registered by its URL",
            extra={"engine": spec.name, "url": target.url, "endpoint": spec.endpoint},
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _failed(target: EngineUrl, state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning(
        "cannot describe the engine from its server: retrying",
        extra={
            "url": target.url,
            "error": str(error),
            "attempt": state.attempt_number,
            "retry_in": round(state.upcoming_sleep, 2),
        },
    )


async def follow_moves(
    registry: Registry, connected: Callable[[str], bool], interval: float = RECHECK
) -> None:
    """Every ``interval`` seconds, :func:`recheck` (run it as a task)."""

    async def chore() -> None:
        await recheck(registry, connected)

    await repeat(interval, chore, "engine servers")


async def recheck(registry: Registry, connected: Callable[[str], bool]) -> None:
    """Ask the server of each engine given by its URL none of whose ranks is
    ``connected`` where it publishes now; one that moved is registered anew there
    (its residency dropped: a new process). A server that cannot be asked, an
    engine that is merely down, changes nothing."""
    for spec in registry.all():
        if spec.url is None or connected(spec.name):
            continue
        try:
            now = await describe(EngineUrl(spec.url, {"name": spec.name, "adapter": spec.adapter}))
        except (Unreachable, BadAnswer, Unsupported):
            continue
        moved = msgspec.structs.replace(spec, **{f: getattr(now, f) for f in PLACEMENT})
        if moved != spec:
            await _move(registry, spec, moved)


async def _move(registry: Registry, old: EngineSpec, new: EngineSpec) -> None:
    """Register ``new`` in ``old``'s place; if it is refused, ``old`` stays."""
    await registry.remove(old.name)
    try:
        await registry.add(new)
    except Exception as e:
        await registry.add(old)
        log.warning(
            "engine's server places it elsewhere, where it cannot be followed",
            extra={"engine": old.name, "endpoint": new.endpoint, "error": repr(e)},
        )
        return
    log.warning(
        "engine's server places it elsewhere now: registered again there",
        extra={"engine": new.name, "url": new.url, "endpoint": new.endpoint},
    )
