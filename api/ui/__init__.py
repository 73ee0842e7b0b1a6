"""The operator page at ``/ui``: plain HTML, one vanilla JS file and CSS.

The files under ``static/`` ship as package data and need no build step or
network at run time. The page is a thin layer over the public JSON API
(``/stats``, ``/engines``, ``/engines/{name}``, ``/prefix-match``,
``/blocks/{hash}``), all readable without the bearer token, so it shows
nothing a ``curl`` could not. Its URLs are relative, so it also works
behind a proxy that serves kvindex under a path prefix.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

PAGE = "/ui/"
#: The page loads only its own files (and inline nothing), so a change that pulled in
#: anything from elsewhere is refused by the browser rather than fetched.
CSP = "default-src 'self'; img-src 'self' data:"


class _PageFiles(StaticFiles):
    """The page's files, revalidated on every load (a 304 while unchanged), so a
    browser never runs a cached older script against an upgraded server."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["cache-control"] = "no-cache"
        response.headers["content-security-policy"] = CSP
        return response


def install_ui(app: FastAPI) -> None:
    """Mount the page at ``/ui/``; ``/`` and ``/ui`` redirect to it."""
    static = files(__name__) / "static"
    app.mount(PAGE.rstrip("/"), _PageFiles(directory=str(static), html=True), name="ui")

    # Relative Locations: the browser resolves them against the URL it asked for,
    # prefix included.
    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("ui/")

    @app.get("/ui", include_in_schema=False)
    async def page() -> RedirectResponse:
        return RedirectResponse("ui/")
