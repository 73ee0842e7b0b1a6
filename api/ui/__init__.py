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

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

PAGE = "/ui/"


def install_ui(app: FastAPI) -> None:
    """Mount the page at ``/ui/``; ``/`` and ``/ui`` redirect to it."""
    static = files(__name__) / "static"
    app.mount(PAGE.rstrip("/"), StaticFiles(directory=str(static), html=True), name="ui")

    # Relative Locations: the browser resolves them against the URL it asked for,
    # prefix included.
    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("ui/")

    @app.get("/ui", include_in_schema=False)
    async def page() -> RedirectResponse:
        return RedirectResponse("ui/")
