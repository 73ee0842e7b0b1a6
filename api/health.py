"""Liveness, readiness and the Prometheus scrape.

``/healthz`` only says the process serves HTTP. ``/readyz`` says it can
answer queries truthfully: the store answers and event consumption runs;
a load balancer should stop sending routers here otherwise (and while the
configured models' tokenizers still load at start). Ranks that have
never had a publisher are listed in its answer; it is 503 only when that is
every registered rank (nothing this process knows is being fed).
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Response

from api.context import ApiContext
from api.errors import ErrorBody, error_response
from api.metrics import metrics_response
from api.openapi import answers
from api.schemas import Readiness, Status

_OK = msgspec.json.encode(Status("ok"))


def _ok() -> Response:
    return Response(_OK, media_type="application/json")


def _without_publisher(ctx: ApiContext) -> tuple[list[str], int]:
    """The ranks that never had a publisher (``engine/dp_rank endpoint``), and how
    many ranks are registered."""
    missing, ranks = [], 0
    for spec in ctx.registry.all():
        for status in ctx.consumers.rank_status(spec.name):
            ranks += 1
            if status.never_connected:
                missing.append(f"{spec.name}/{status.dp_rank} {spec.rank_endpoint(status.dp_rank)}")
    return missing, ranks


#: Ranks a /readyz answer names at most (the rest are counted).
_NAMED = 5


def _store_losses(ctx: ApiContext) -> list[str]:
    """``engine/dp_rank: why`` for every rank whose batches the store lost and that
    is not rebuilt (it under-reports until then, and may stay so)."""
    return [
        f"{spec.name}/{status.dp_rank}: {status.store_loss}"
        for spec in ctx.registry.all()
        for status in ctx.consumers.rank_status(spec.name)
        if status.store_loss is not None
    ]


def router(ctx: ApiContext) -> APIRouter:
    store, consumers = ctx.store, ctx.consumers
    routes = APIRouter(tags=["health"])

    @routes.get("/healthz", responses=answers(_200=(Status, "serving")), summary="Liveness")
    async def healthz() -> Response:
        return _ok()

    @routes.get(
        "/readyz",
        responses=answers(
            _200=(Readiness, "store reachable and subscribers running"),
            _503=(ErrorBody, "what is not ready"),
        ),
        summary="Readiness",
    )
    async def readyz() -> Response:
        await store.ping()  # any failure: the store handler answers 503
        if not consumers.running():
            return error_response(503, "event subscribers are not running")
        if loading := ctx.tokenizers.loading():
            return error_response(503, f"tokenizers still loading: {', '.join(loading)}")
        if lost := _store_losses(ctx):
            more = f"; and {len(lost) - _NAMED} more" if len(lost) > _NAMED else ""
            return error_response(503, f"store lost data: {'; '.join(lost[:_NAMED])}{more}")
        missing, ranks = _without_publisher(ctx)
        if missing and len(missing) == ranks:
            return error_response(503, f"no engine rank has a publisher: {', '.join(missing)}")
        if missing:
            body = msgspec.json.encode(Readiness("ok", missing))
            return Response(body, media_type="application/json")
        return _ok()

    @routes.get(
        "/metrics",
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        return metrics_response()

    return routes
