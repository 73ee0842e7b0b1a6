"""The API against its own OpenAPI schema (schemathesis): never a 5xx, always as documented.

Every operation is fuzzed with valid and invalid inputs, and each answer is
checked against the schema (status, content type, body). The app serves a
fixture trace so that positive cases walk real residency, not empty tables.

One check is left out: ``positive_data_acceptance`` expects every
schema-valid request to succeed, but OpenAPI cannot say "exactly one of two
query parameters", "lora_name and lora_path together", a uint64 ceiling on
decimal text, or the configured prompt maximum; those are documented 4xx
answers, not failures. And ``POST /engines`` by ``url`` asks the engine's
server, which no fuzzed url names: its documented 502/503 ("engine server
URL: ...") are its answer then, not a server error of kvindex's.
"""

from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from api import ApiSettings
from indexer.core.events import RankId
from indexer.ingest.trace import load_trace

from .apikit import Api, engine
from .conftest import trace_path

TOKEN = "t0ken"
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


async def _populated(settings: ApiSettings) -> Api:
    api = Api(settings)
    await api.add(engine("vllm-a", model="m", blocks_per_chunk=4))
    await api.add(engine("secret", model="m", hash_algo="xxhash", dp_ranks=2))
    await api.consumers.apply_trace(RankId("vllm-a", 0), load_trace(trace_path("chat-sha256")))
    return api


def _schema(settings: ApiSettings) -> schemathesis.BaseSchema:
    api = asyncio.run(_populated(settings))
    return schemathesis.openapi.from_asgi("/openapi.json", api.app)


# Built when a test runs, not when the module is imported: collecting (or
# deselecting) these tests then costs nothing.
@pytest.fixture(scope="module")
def open_schema() -> schemathesis.BaseSchema:
    return _schema(ApiSettings())


@pytest.fixture(scope="module")
def guarded_schema() -> schemathesis.BaseSchema:
    return _schema(ApiSettings(auth_token=TOKEN))


@pytest.fixture(autouse=True)
def _node_id_for_the_lazy_loader(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32's lazy loader reads and sets ``Node._nodeid`` to label each
    operation's subtest; pytest 9 keeps the id elsewhere, so give it the attribute."""
    request.node._nodeid = request.node.nodeid


OPEN = schemathesis.pytest.from_fixture("open_schema")
GUARDED = schemathesis.pytest.from_fixture("guarded_schema")
NOT_CHECKED = [schemathesis.checks.positive_data_acceptance]


def _call_and_validate(case: schemathesis.Case, **kwargs: object) -> None:
    response = case.call(**kwargs)
    excluded = NOT_CHECKED
    if response.status_code in (502, 503) and response.json()["error"].startswith("engine server"):
        excluded = [*NOT_CHECKED, schemathesis.checks.not_a_server_error]
    case.validate_response(response, excluded_checks=excluded, **kwargs)


@pytest.mark.slow
@OPEN.parametrize()
@FUZZ
def test_api_conforms_to_its_schema(case: schemathesis.Case) -> None:
    _call_and_validate(case)


@pytest.mark.slow
@GUARDED.parametrize()
@FUZZ
def test_api_with_a_token_conforms_and_enforces_it(case: schemathesis.Case) -> None:
    """With the token the fuzzer reaches the handlers; schemathesis also retries without it."""
    _call_and_validate(case, headers={"Authorization": f"Bearer {TOKEN}"})
