"""Operator REST: the engines kvindex follows, one block's residency, totals.

Registering or removing an engine goes through the registry, whose
listeners (the subscriber) start or stop consuming — and, on removal, drop
the engine's residency from the store — before the call returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
from fastapi import APIRouter, Path, Request, Response

from api.auth import authenticated, optional_security, require_token
from api.context import ApiContext
from api.errors import ApiError, ErrorBody
from api.openapi import answers, body
from api.parsing import StrictQueryRoute, decode_body, hash_text, parse_hash
from api.schemas import (
    HASH_PATTERN,
    BlockResidencies,
    EngineState,
    EngineSummary,
    EngineView,
    RankCounts,
    RankState,
    Stats,
    UrlRegistration,
    engine_view,
)
from indexer.announcements import HandRegistered
from indexer.compiled import Status, combined
from indexer.core.events import MEDIA, RankId
from indexer.discovery import served
from indexer.engine_registry import (
    BindRefused,
    EngineExists,
    EngineSpec,
    RankStatus,
    UnknownEngine,
    blank_status,
    degraded_reasons,
    is_degraded,
)
from indexer.engines import catalog, intlist
from indexer.misdeclared import MisdeclaredView
from indexer.stores.base import StoreUnavailable
from indexer.stores.memory import compiled as holder_core

log = logging.getLogger("kvindex.api")
_encode = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode

_UNAVAILABLE = (ErrorBody, "the store is unreachable")
_UNKNOWN = (ErrorBody, "no engine of that name is registered")
AUTH_REFUSAL = (ErrorBody, "missing or wrong bearer token (when one is configured)")
T = TypeVar("T")
#: How a registration (``POST /engines``, an announcement) is refused (see :func:`register`).
REFUSALS = {
    "_400": (ErrorBody, "body is not JSON"),
    "_401": AUTH_REFUSAL,
    "_413": (ErrorBody, "body over the configured maximum"),
    "_422": (
        ErrorBody,
        "a malformed or unknown field, an endpoint that cannot be used, or a bind"
        " the operator has not allowed (subscriber.bind)",
    ),
    "_503": _UNAVAILABLE,
}
#: How a registration by ``url`` is refused besides: the engine's server answered
#: wrong, or not at all.
URL_REFUSALS = {
    "_502": (ErrorBody, "the engine's server (url) answered, but not as vLLM's does"),
    "_503": (ErrorBody, "the store, or the engine's server (url), is unreachable"),
}
EngineName = Annotated[str, Path(description="a registered engine's name")]


def _json(value: object, status: int = 200) -> Response:
    return Response(_encode(value), status, media_type="application/json")


class Operators:
    """What the operator endpoints read, over one API context.

    Every endpoint sees the same ranks of an engine (its declared dp ranks and
    any other the store holds) with the same status (a rank no consumer runs
    has a blank one: not connected), judged by :func:`is_degraded`, so
    ``/engines``, ``/engines/{name}``, ``/stats`` and prefix-match agree.
    """

    def __init__(self, ctx: ApiContext) -> None:
        self.store = ctx.store
        self.registry = ctx.registry
        self.consumers = ctx.consumers
        self.token_index = ctx.token_index
        self.routed = ctx.routed
        self.leases = ctx.leases
        self.misdeclared = ctx.misdeclared

    def spec(self, name: str) -> EngineSpec:
        try:
            return self.registry.get(name)
        except UnknownEngine:
            raise ApiError(404, f"unknown engine {name!r}") from None

    async def stored_ranks(self) -> dict[str, set[int]]:
        return _by_engine(await self.store.ranks())

    def statuses(self, spec: EngineSpec, held: set[int]) -> list[RankStatus]:
        """The status of each declared rank and of each other rank the store holds."""
        known = {s.dp_rank: s for s in self.consumers.rank_status(spec.name)}
        ranks = sorted(held | set(range(spec.dp_ranks)))
        return [known.get(r) or blank_status(spec, r) for r in ranks]

    async def rank_state(self, spec: EngineSpec, status: RankStatus) -> RankState:
        rank = RankId(spec.name, status.dp_rank)
        blocks, anomalies = await asyncio.gather(
            self.store.block_counts(rank), self.store.anomalies(rank)
        )
        fields = msgspec.structs.asdict(status) | {"degraded": is_degraded(status)}
        return RankState(
            **fields, blocks=blocks, anomalies=anomalies, degraded_reasons=degraded_reasons(status)
        )

    async def engine_state(self, spec: EngineSpec, with_seed: bool) -> EngineState:
        held = (await self.stored_ranks()).get(spec.name, set())
        ranks = await asyncio.gather(
            *(self.rank_state(spec, status) for status in self.statuses(spec, held))
        )
        lease = self.leases.lease(spec.name) if self.leases else None
        checks = self.misdeclared
        size = checks.block_size(spec.name) if checks else spec.block_size
        return EngineState(
            **engine_view(spec, with_seed),
            ranks=list(ranks),
            lease=lease,
            misdeclared=checks.reasons(spec.name) if checks else [],
            learned_block_size=None if spec.block_size else size,
            unmatched=unmatched(spec, checks, size),
        )

    async def summaries(self, with_seed: bool) -> list[EngineSummary]:
        held = await self.stored_ranks()
        return [
            EngineSummary(
                **engine_view(spec, with_seed),
                **msgspec.structs.asdict(count(self.statuses(spec, held.get(spec.name, set())))),
            )
            for spec in self.registry.all()
        ]

    async def stats(self) -> Stats:
        ranks = await self.store.ranks()
        counts = await asyncio.gather(*(self.store.block_counts(r) for r in ranks))
        anomalies = await asyncio.gather(*(self.store.anomalies(r) for r in ranks))
        held = _by_engine(ranks)
        engines = self.registry.all()
        statuses = [s for spec in engines for s in self.statuses(spec, held.get(spec.name, set()))]
        return Stats(
            **msgspec.structs.asdict(count(statuses)),
            engines=len(engines),
            stored_ranks=len(ranks),
            blocks={m: sum(c[m] for c in counts) for m in MEDIA},
            anomalies=_total(anomalies),
            token_index_entries=len(self.token_index),
            routed=await self.routed.counts(),
            **compiled_status(),
        )


async def register(ctx: ApiContext, spec: EngineSpec, add: Callable[[], Awaitable[T]]) -> T:
    """Register ``spec`` through ``add`` (the registry's, or the leases' for an
    announcement) once the operator's bind rules allow it, so that ``POST /engines``
    and announcements refuse alike: a bind not allowed, or a spec no listener can
    take (e.g. an endpoint ZMQ refuses), is a 422; a name taken (registered already,
    or by hand) a 409; an unreachable store stays a 503."""
    try:
        ctx.settings.engine_binds.check(spec)
        return await add()
    except BindRefused as e:
        raise ApiError(422, str(e)) from None
    except EngineExists:
        raise ApiError(409, f"engine {spec.name!r} is already registered") from None
    except HandRegistered:
        raise hand_registered(spec.name) from None
    except (ApiError, StoreUnavailable):
        raise
    except Exception as e:  # a listener could not take it
        log.warning("engine refused", extra={"engine": spec.name, "error": repr(e)})
        raise ApiError(422, f"cannot consume engine {spec.name!r}: {e}") from None


def unmatched(spec: EngineSpec, checks: MisdeclaredView | None, size: int | None) -> str | None:
    """Why prefix-match answers the engine with zeros for now (None: it does not), by
    the matcher's rules: its events contradict its declaration, or its block size,
    learned from its events, is not known yet."""
    if checks is not None and checks.excluded(spec.name):
        return "its events contradict its declared config (see misdeclared): tokens answer 0"
    if size is None:
        return (
            "block size not known yet: learned from the engine's first BlockStored event"
            " (registered without one); until then it matches nothing"
        )
    return None


def _registration(body: bytes) -> EngineSpec | served.EngineUrl:
    """``POST /engines``'s body: a spec, or an engine given by its server's ``url`` (with
    no endpoint) and the fields the operator sets."""
    fields = _decode_json(body)
    if not isinstance(fields, dict) or "url" not in fields or "endpoint" in fields:
        return msgspec.convert(fields, EngineSpec)
    url = fields.pop("url")
    try:
        return served.engine_url(url if isinstance(url, str) else repr(url), fields)
    except ValueError as e:
        raise msgspec.ValidationError(str(e)) from None


async def described(target: served.EngineUrl) -> EngineSpec:
    """The engine as its server describes it; 503 when the server cannot be reached,
    502 when it answers wrong, 422 when its events cannot be followed as described."""
    try:
        return await served.describe(target)
    except served.Unreachable as e:
        raise ApiError(503, f"engine server {target.url}: {e}") from None
    except served.BadAnswer as e:
        raise ApiError(502, f"engine server {target.url}: {e}") from None
    except served.Unsupported as e:
        raise ApiError(422, f"engine server {target.url}: {e}") from None


def hand_registered(name: str) -> ApiError:
    """The answer when announcements reach for an engine an operator registered."""
    return ApiError(
        409,
        f"engine {name!r} is registered by hand (config, --engine or POST /engines):"
        " announcements cannot take it over or remove it",
    )


#: The compiled parts the API runs beside the engine adapters' own: the embedded
#: store's holder index and GET prompts' decimal-list reader.
_API_PARTS = (holder_core.PART, intlist.PART)


def compiled_status() -> Status:
    """The compiled core is in use when every compiled part is (each engine adapter's,
    such as vLLM's token hashing, and the API's own)."""
    return combined([*catalog.compiled_statuses(), *(part.status() for part in _API_PARTS)])


def warn_if_unavailable(role: str, *, embedded_store: bool) -> bool:
    """Warn once per compiled part the role runs that is missing (the holder index only
    with ``embedded_store``: on Redis nothing uses it); True if every one is in use."""
    parts = _API_PARTS if embedded_store else (intlist.PART,)
    in_use = [catalog.warn_if_unavailable(role)]
    in_use += [part.warn_if_unavailable(role) for part in parts]  # each warns
    return all(in_use)


def _by_engine(ranks: list[RankId]) -> dict[str, set[int]]:
    """The dp ranks the store holds state for, by engine."""
    held: dict[str, set[int]] = {}
    for rank in ranks:
        held.setdefault(rank.engine, set()).add(rank.dp_rank)
    return held


def count(statuses: list[RankStatus]) -> RankCounts:
    """How many of these ranks are in each state."""
    return RankCounts(
        registered_ranks=len(statuses),
        connected_ranks=sum(s.connected for s in statuses),
        never_connected_ranks=sum(s.never_connected for s in statuses),
        degraded_ranks=sum(is_degraded(s) for s in statuses),
    )


def _total(counts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)  # unlike +, update keeps zero counts
    return dict(total)


def router(ctx: ApiContext) -> APIRouter:
    ops = Operators(ctx)
    routes = APIRouter(tags=["operators"], route_class=StrictQueryRoute)
    token = ctx.settings.auth_token
    guarded = require_token(token)

    def view(spec: EngineSpec, request: Request, status: int = 200) -> Response:
        """An engine as answered, its seed only to a caller who presented the token."""
        return _json(EngineView(**engine_view(spec, authenticated(token, request))), status)

    @routes.get(
        "/engines",
        responses=answers(
            _200=(list[EngineSummary], "registered engines, by name, with their rank counts"),
            _503=_UNAVAILABLE,
        ),
        openapi_extra=optional_security(token),
        summary="List engines",
    )
    async def list_engines(request: Request) -> Response:
        return _json(await ops.summaries(authenticated(token, request)))

    @routes.post(
        "/engines",
        status_code=201,
        dependencies=guarded,
        openapi_extra=body(EngineSpec, UrlRegistration),
        responses=answers(
            _201=(EngineView, "registered; consumption has started"),
            _409=(ErrorBody, "an engine of that name is already registered"),
            **(REFUSALS | URL_REFUSALS),
        ),
        summary="Register an engine (by its endpoints, or by its OpenAI server's url)",
    )
    async def add_engine(request: Request) -> Response:
        given = await decode_body(request, _registration, "engine")
        spec = given if isinstance(given, EngineSpec) else await described(given)
        await register(ctx, spec, lambda: ops.registry.add(spec))
        return view(spec, request, 201)

    @routes.get(
        "/engines/{name}",
        responses=answers(
            _200=(EngineState, "the engine and the state of each dp rank"),
            _404=_UNKNOWN,
            _503=_UNAVAILABLE,
        ),
        openapi_extra=optional_security(token),
        summary="One engine's state",
    )
    async def get_engine(name: EngineName, request: Request) -> Response:
        return _json(await ops.engine_state(ops.spec(name), authenticated(token, request)))

    @routes.delete(
        "/engines/{name}",
        dependencies=guarded,
        responses=answers(
            _200=(EngineView, "removed: no longer consumed, its residency dropped"),
            _401=AUTH_REFUSAL,
            _404=_UNKNOWN,
            _503=_UNAVAILABLE,
        ),
        summary="Remove an engine",
    )
    async def remove_engine(name: EngineName, request: Request) -> Response:
        try:
            spec = await ops.registry.remove(name)
        except UnknownEngine:
            raise ApiError(404, f"unknown engine {name!r}") from None
        await ctx.routed.forget(name)  # its routed entries end with it
        return view(spec, request)

    @routes.get(
        "/blocks/{block_hash}",
        responses=answers(
            _200=(BlockResidencies, "every residency of the block (empty if none)"),
            _422=(ErrorBody, "not a decimal uint64 or 0x-hex digest"),
            _503=_UNAVAILABLE,
        ),
        summary="One block's residency",
    )
    async def get_block(
        block_hash: Annotated[
            str,
            Path(
                description="decimal uint64, or 0x-hex raw digest",
                json_schema_extra={"pattern": HASH_PATTERN},
            ),
        ],
    ) -> Response:
        value = parse_hash(block_hash)
        residency = await ops.store.block_residency(value)
        return _json(BlockResidencies(hash_text(value), residency))

    @routes.get(
        "/stats",
        responses=answers(_200=(Stats, "totals"), _503=_UNAVAILABLE),
        summary="Totals",
    )
    async def stats() -> Response:
        return _json(await ops.stats())

    return routes
