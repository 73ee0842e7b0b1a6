"""Filters that cannot apply are refused, not ignored.

A query parameter an endpoint does not take (a misspelt ``engine=`` for
``engines=``) and a model no registered engine serves would otherwise
answer as if no filter had been given, or with nothing at all, and look
right. GET agrees with POST, which already refuses unknown body fields.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from .apikit import Api, engine

HEALTH = {"/healthz", "/readyz", "/metrics"}


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    api = Api()
    await api.add(engine("a", model="m"))
    await api.add(engine("b", model="other"))
    yield api
    await api.close()


def _refusal(response, *names: str) -> str:
    assert response.status_code == 422, response.text
    assert set(response.json()) == {"error"}
    message = response.json()["error"]
    assert all(repr(name) in message for name in names), message
    return message


def _api_operations(api: Api) -> list[tuple[str, str]]:
    """Every (method, path) of the schema but the probes, path parameters filled in."""
    paths = api.app.openapi()["paths"]
    filled = {"{name}": "a", "{block_hash}": "1"}
    operations = []
    for path, methods in paths.items():
        if path in HEALTH:
            continue
        for placeholder, value in filled.items():
            path = path.replace(placeholder, value)
        operations += [(method.upper(), path) for method in methods]
    return operations


async def test_every_api_endpoint_refuses_a_query_parameter_it_does_not_take(api: Api) -> None:
    operations = _api_operations(api)
    assert len(operations) >= 7  # the schema was read, not an empty list
    for method, path in operations:
        response = await api.client.request(method, path, params={"tokens": "1", "bogus": "x"})
        if (method, path) != ("GET", "/prefix-match"):
            _refusal(response, "tokens", "bogus")  # POST takes its fields in the body
        else:
            message = _refusal(response, "bogus")
            assert "takes block_hashes, block_size" in message  # names what it takes


async def test_the_schema_documents_the_refusal(api: Api) -> None:
    paths = api.app.openapi()["paths"]
    for method, path in _api_operations(api):
        key = re.sub(r"/a(?=/|$)", "/{name}", path).replace("/blocks/1", "/blocks/{block_hash}")
        assert (
            "unknown query parameter"
            in paths[key][method.lower()]["responses"]["422"]["description"]
        )


async def test_a_misspelt_filter_is_refused_not_ignored(api: Api) -> None:
    response = await api.client.get("/prefix-match", params={"tokens": "1", "engine": "a"})
    assert "unknown query parameter 'engine'" in _refusal(response, "engine")
    by_post = await api.client.post("/prefix-match", json={"tokens": [1], "engine": "a"})
    assert by_post.status_code == 422 and "engine" in by_post.json()["error"]
    listed = await api.client.get("/engines", params={"model": "m"})
    assert "takes no query parameters" in _refusal(listed, "model")
    # The same queries without the stray parameter are answered.
    assert (await api.client.get("/prefix-match", params={"tokens": "1"})).status_code == 200
    assert (await api.client.get("/engines")).status_code == 200


async def test_several_unknown_parameters_are_named_once_each(api: Api) -> None:
    response = await api.client.get("/stats?x=1&y=2&x=3")
    message = _refusal(response, "x", "y")
    assert message.count("'x'") == 1 and "parameters" in message


async def test_probes_ignore_query_parameters(api: Api) -> None:
    """Load balancers and scrapers may add their own; a probe must not fail on them."""
    assert (await api.client.get("/healthz", params={"probe": "lb"})).status_code == 200
    assert (await api.client.get("/metrics", params={"name[]": "x"})).status_code == 200


# --- the model filter ------------------------------------------------------------


@pytest.mark.parametrize("how", ["GET", "POST"])
async def test_a_model_no_engine_serves_is_a_404(api: Api, how: str) -> None:
    if how == "GET":
        response = await api.client.get("/prefix-match", params={"tokens": "1", "model": "nope"})
    else:
        response = await api.client.post("/prefix-match", json={"tokens": [1], "model": "nope"})
    assert response.status_code == 404, response.text
    assert response.json() == {"error": "unknown model 'nope': no registered engine serves it"}


async def test_a_served_model_filters_and_may_leave_nothing(api: Api) -> None:
    served = await api.client.get("/prefix-match", params={"tokens": "1", "model": "m"})
    assert [e["engine"] for e in served.json()["engines"]] == ["a"]
    # "other" is served (by b), just not by the engines asked for: an empty answer.
    narrowed = {"tokens": "1", "model": "other", "engines": "a"}
    response = await api.client.get("/prefix-match", params=narrowed)
    assert response.status_code == 200
    assert response.json()["engines"] == []
