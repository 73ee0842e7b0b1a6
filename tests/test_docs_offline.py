"""/docs, /redoc and the operator page need nothing but kvindex itself.

A GPU cluster usually has no route to the internet, so every page kvindex
serves must reference only its own URLs, and each of those must answer.
(tests/test_ui.py renders them in a real browser that cannot resolve any
other host.)
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import pytest

from .apikit import Api

BASE = "http://kvindex"
PAGES = ("/docs", "/redoc", "/ui/")
#: A URL with a scheme or a protocol-relative one: anything that may leave the host.
ABSOLUTE = re.compile(r"""(?:https?:|wss?:)?//[^\s"'<>)]+""")


class References(HTMLParser):
    """Every URL a page makes the browser load or link to: src, href, spec-url."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("src", "href", "spec-url") and v]


def references(html: str) -> list[str]:
    parser = References()
    parser.feed(html)
    return parser.urls


@pytest.fixture
async def api():
    api = Api()
    yield api
    await api.close()


@pytest.mark.parametrize("page", PAGES)
async def test_a_page_references_no_other_host(api: Api, page: str) -> None:
    answer = await api.client.get(page)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/html")
    assert ABSOLUTE.findall(answer.text) == []  # no CDN, no web font, no remote favicon
    urls = [u for u in references(answer.text) if not u.startswith(("data:", "#"))]
    assert urls, f"{page} references nothing: the test would prove nothing"
    for url in urls:
        full = urljoin(BASE + page, url)
        assert urlsplit(full).netloc == "kvindex", url
        asset = await api.client.get(full)
        assert asset.status_code == 200, f"{page} references {url}: {asset.status_code}"


async def test_the_docs_load_the_local_bundles_and_schema(api: Api) -> None:
    swagger = (await api.client.get("/docs")).text
    assert '<script src="/assets/docs/swagger-ui-bundle.js">' in swagger
    assert "url: '/openapi.json'" in swagger
    assert '"validatorUrl": null' in swagger  # never sends the schema to a public validator
    for page in ("/docs", "/redoc"):  # the browser may load nothing from elsewhere either
        csp = (await api.client.get(page)).headers["content-security-policy"]
        assert csp.startswith("default-src 'self';") and "http" not in csp
    assert 'spec-url="/openapi.json"' in (await api.client.get("/redoc")).text
    bundle = await api.client.get("/assets/docs/redoc.standalone.js")
    assert bundle.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert len(bundle.content) > 100_000  # the real bundle, not a stub
    assert (await api.client.get("/openapi.json")).json()["info"]["title"] == "kvindex"


async def test_the_root_and_ui_redirect_to_the_page(api: Api) -> None:
    for path in ("/", "/ui"):
        answer = await api.client.get(path)
        assert answer.status_code == 307
        assert urljoin(BASE + path, answer.headers["location"]) == f"{BASE}/ui/"
    page = await api.client.get("/", follow_redirects=True)
    assert page.url == f"{BASE}/ui/" and "<title>kvindex</title>" in page.text


async def test_page_files_are_outside_the_api_contract(api: Api) -> None:
    missing = await api.client.get("/ui/nothing-here.js")
    assert missing.status_code == 404
    assert missing.json() == {"error": "Not Found"}  # the API's one error shape
    paths = (await api.client.get("/openapi.json")).json()["paths"]
    assert not [p for p in paths if p in ("/", "/ui", "/docs", "/redoc") or p.startswith("/ass")]


async def test_the_page_is_confined_to_its_own_files_and_revalidated(api: Api) -> None:
    for path in ("/ui/", "/ui/app.js", "/ui/ui.css"):
        headers = (await api.client.get(path)).headers
        assert headers["content-security-policy"] == "default-src 'self'; img-src 'self' data:"
        assert headers["cache-control"] == "no-cache"  # an upgrade never meets a stale script
        again = await api.client.get(path, headers={"if-none-match": headers["etag"]})
        assert again.status_code == 304
