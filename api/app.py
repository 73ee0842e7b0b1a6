"""Mount the kvindex HTTP API's routes over the services they work with.

The program wires the services (:func:`kvindex.wiring.api_app`, for ``kvindex
serve``, API replicas, tests and benchmarks) and hands them to
:func:`create_app`, which builds nothing of the domain itself.
"""

from __future__ import annotations

from fastapi import FastAPI

from api import announce, health, operators, prefix
from api import routed as routed_api
from api.context import ApiContext
from api.docs import install_docs
from api.errors import install_error_handlers
from api.limits import BodyLimit
from api.openapi import install_openapi
from api.ui import install_ui

DESCRIPTION = """\
Which engine holds how much of a prompt's KV cache, per tier, from the KV
cache events of vLLM engines. Routers call `/prefix-match`; operators use
`/engines`, `/blocks/{hash}`, `/stats`, `/metrics`, `/healthz`, `/readyz`,
and the page at `/ui/` that draws them.
Every error is `{"error": "<what was wrong>"}`.
"""


def create_app(ctx: ApiContext) -> FastAPI:
    """The API app over ``ctx``'s services."""
    # FastAPI's own /docs and /redoc load their assets from a CDN: install_docs serves them.
    app = FastAPI(
        title="kvindex",
        version="0.1.0",
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
    )
    app.state.loads = ctx.loads  # its scraper ends with the app's owner (LoadBoard.close)
    app.state.tokenizers = ctx.tokenizers
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=ctx.settings.max_body_bytes)
    app.include_router(prefix.router(ctx))
    app.include_router(routed_api.router(ctx))
    app.include_router(operators.router(ctx))
    app.include_router(announce.router(ctx))
    app.include_router(health.router(ctx))
    install_openapi(app)
    install_docs(app)
    install_ui(app)
    return app
