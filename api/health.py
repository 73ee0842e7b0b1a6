"""Liveness, readiness and the Prometheus scrape.

``/healthz`` only says the process serves HTTP. ``/readyz`` says it can
answer queries truthfully: the store answers and event consumption runs;
a load balancer should stop sending routers here otherwise.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Response

from api.context import ApiContext
from api.errors import ErrorBody, error_response
from api.metrics import metrics_response
from api.openapi import answers
from api.schemas import Status

_OK = msgspec.json.encode(Status("ok"))


def _ok() -> Response:
    return Response(_OK, media_type="application/json")


def router(ctx: ApiContext) -> APIRouter:
    store, consumers = ctx.store, ctx.consumers
    routes = APIRouter(tags=["health"])

    @routes.get("/healthz", responses=answers(_200=(Status, "serving")), summary="Liveness")
    async def healthz() -> Response:
        return _ok()

    @routes.get(
        "/readyz",
        responses=answers(
            _200=(Status, "store reachable and subscribers running"),
            _503=(ErrorBody, "what is not ready"),
        ),
        summary="Readiness",
    )
    async def readyz() -> Response:
        await store.ping()  # any failure: the store handler answers 503
        if not consumers.running():
            return error_response(503, "event subscribers are not running")
        return _ok()

    @routes.get(
        "/metrics",
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        return metrics_response()

    return routes
