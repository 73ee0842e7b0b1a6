"""``/docs`` and ``/redoc`` that work on a machine without internet.

FastAPI's default pages load Swagger UI and ReDoc from a CDN, so they are
blank where GPU fleets usually run. The fastapi-offline package ships both
bundles (their licence notices are in the files' headers); kvindex serves
them itself under :data:`ASSETS`, and the pages reference nothing else: no
web fonts, a local favicon, and Swagger UI's online spec validator off (it
would send the schema to a public service). ReDoc's bundle still shows its
vendor's logo from that vendor's CDN; the pages' Content-Security-Policy
keeps the browser from loading anything but kvindex's own URLs (inline
script and style stay allowed: the pages are built from them), so a machine
with internet does not call out either.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/assets/docs"
CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline';"
    " img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:"
)


def _own_urls_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["content-security-policy"] = CSP
    return page


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and ``/redoc`` from local assets.

    ``app`` must be built with ``docs_url=None, redoc_url=None`` so FastAPI's
    CDN pages are not registered first.
    """
    bundles = files("fastapi_offline") / "static"
    app.mount(ASSETS, StaticFiles(directory=str(bundles)), name="docs-assets")

    def page(
        path: str, render: Callable[..., HTMLResponse], assets: dict[str, str], **options: Any
    ) -> None:
        """Serve at ``path`` the page ``render`` builds; ``assets``: its URL arguments,
        each a file of the bundles; ``options``: its other arguments."""

        async def handler(request: Request) -> HTMLResponse:
            # Behind a proxy that strips a path prefix, the page's URLs need it back.
            root = request.scope.get("root_path", "").rstrip("/")
            urls = {name: f"{root}{ASSETS}/{file}" for name, file in assets.items()}
            spec = f"{root}{app.openapi_url}"
            return _own_urls_only(
                render(openapi_url=spec, title=f"{app.title} API", **urls, **options)
            )

        app.add_api_route(path, handler, methods=["GET"], include_in_schema=False)

    swagger = {
        "swagger_js_url": "swagger-ui-bundle.js",
        "swagger_css_url": "swagger-ui.css",
        "swagger_favicon_url": "favicon.png",
    }
    page(
        "/docs",
        get_swagger_ui_html,
        swagger,
        oauth2_redirect_url=None,
        swagger_ui_parameters={"validatorUrl": None},
    )
    redoc = {"redoc_js_url": "redoc.standalone.js", "redoc_favicon_url": "favicon.png"}
    page(
        "/redoc",
        get_redoc_html,
        redoc,
        with_google_fonts=False,
    )
