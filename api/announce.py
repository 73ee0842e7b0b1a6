"""Self-registration: engines announce themselves and keep their registration by lease.

``POST /engines/announce`` is an idempotent upsert (register, renew, restart,
update); ``DELETE /engines/announce/{name}?instance=`` is a clean shutdown.
Both change what kvindex follows, so they sit behind the same bearer token as
``POST /engines``. A hash seed is a secret of the engine's (it lets anyone who
has it predict which prompts an engine holds), so a seed is taken only from a
caller who proved who it is: with no token configured it is refused, and the
engine says ``seeded: true`` without it instead.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Path, Query, Request, Response

from api.auth import require_token
from api.context import ApiContext
from api.errors import ApiError, ErrorBody
from api.openapi import answers, body
from api.operators import AUTH_REFUSAL, REFUSALS, hand_registered, register
from api.parsing import StrictQueryRoute, decode_body
from indexer.announcements import Announcement, Granted, HandRegistered, Leases, StaleInstance
from indexer.engine_registry import UnknownEngine

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Announcement).decode


def _json(value: Granted) -> Response:
    return Response(_encode(value), 200, media_type="application/json")


def router(ctx: ApiContext) -> APIRouter:
    leases: Leases = ctx.leases
    routes = APIRouter(tags=["self-registration"], route_class=StrictQueryRoute)
    guarded = require_token(ctx.settings.auth_token)
    authenticated = ctx.settings.auth_token is not None

    @routes.post(
        "/engines/announce",
        dependencies=guarded,
        openapi_extra=body(Announcement),
        responses=answers(
            _200=(Granted, "registered, renewed, restarted or updated; the lease granted"),
            _403=(ErrorBody, "spec.hash_seed sent while no auth token is configured"),
            _409=(ErrorBody, "the name is registered by hand"),
            **REFUSALS,
        ),
        summary="Announce an engine (register or renew its lease)",
    )
    async def announce(request: Request) -> Response:
        announcement = await decode_body(request, _decode, "announcement")
        spec = announcement.spec
        if spec.hash_seed is not None and not authenticated:
            raise ApiError(
                403,
                "spec.hash_seed: accepted only on an authenticated request (configure"
                " auth_token); announce seeded: true without the seed instead",
            )
        granted = await register(ctx, spec, lambda: leases.announce(announcement))
        return _json(granted)

    @routes.delete(
        "/engines/announce/{name}",
        dependencies=guarded,
        responses=answers(
            _200=(Granted, "deregistered: no longer consumed, its residency dropped"),
            _401=AUTH_REFUSAL,
            _404=(ErrorBody, "no engine of that name is registered"),
            _409=(ErrorBody, "another instance holds the lease, or the engine is hand-registered"),
            _503=(ErrorBody, "the store is unreachable"),
        ),
        summary="Deregister an announced engine (clean shutdown)",
    )
    async def deregister(
        name: Annotated[str, Path(description="the announced engine's name")],
        instance: Annotated[str, Query(description="the instance that announced it")],
    ) -> Response:
        try:
            return _json(await leases.deregister(name, instance))
        except UnknownEngine:
            raise ApiError(404, f"unknown engine {name!r}") from None
        except HandRegistered:
            raise hand_registered(name) from None
        except StaleInstance as e:
            raise ApiError(
                409,
                f"engine {name!r} is held by instance {e.args[0]!r}, not {instance!r}:"
                " a stale instance cannot deregister its successor",
            ) from None

    return routes
