"""An SGLang engine given by its server's URL, and its load from its ``/metrics``.

A real HTTP server answers ``/server_info`` (its ``kv_events`` descriptor) and
``/v1/models`` as SGLang 0.5.23's does, and publishers speaking SGLang's wire
bind the ports it announces; kvindex must follow every rank at its port + rank,
take the page size it states as the block size, and match SGLang's hashes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import Prompt
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import wait_until
from .engine_url_kit import AUTH, MODELS, TOKEN, EngineServer

SGLANG = catalog.adapter("sglang")
PAGE = 4
PROMPT = list(range(500, 500 + 5 * PAGE + 3))


def server_info(server: EngineServer, ranks: int, **kv: object) -> dict:
    """``/server_info`` as SGLang answers it (the fields kvindex reads, and some others)."""
    return {
        "version": "0.5.23",
        "page_size": PAGE,
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": server.pub,
            "topic": "kv",
            "block_size": PAGE,
            "dp_size": ranks,
            "replay_endpoint_port_base": server.replay,
            **kv,
        },
    }


@pytest.fixture
async def live() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(auth_token=TOKEN)) as api:
        yield api


async def test_an_sglang_url_is_followed_at_each_rank_with_its_page_size(live) -> None:
    server = EngineServer({"/v1/models": MODELS}, ranks=2)
    server.answers["/server_info"] = server_info(server, ranks=2)
    publisher = Publisher(
        f"tcp://*:{server.pub}", f"tcp://*:{server.replay}", topic="kv", data_parallel_rank=1,
        bind=True, adapter=SGLANG,
    )  # fmt: skip
    try:
        body = {"url": server.url, "adapter": "sglang"}
        created = await live.client.post("/engines", json=body, headers=AUTH)
        assert created.status_code == 201, created.text
        spec = created.json()
        assert (spec["dp_ranks"], spec["block_size"], spec["topic"], spec["model"]) == (
            2, PAGE, "kv", "tiny",
        )  # fmt: skip
        assert spec["endpoint"] == f"tcp://127.0.0.1:{server.pub}"
        hasher = SGLANG.hasher("sha256", None, PAGE)
        hashes = hasher.published(hasher.digests(Prompt(tuple(PROMPT))))
        full = PROMPT[: len(hashes) * PAGE]
        assert publisher.publish(EventBatch(1.0, [BlockStored(hashes, None, full, PAGE)], 1))

        def applied() -> bool:
            return live.subscriber.rank_status(server.name)[1].applied_seq == 0

        await wait_until(applied, 30, "rank 1 to apply SGLang's batch")
        answer = (await live.client.post("/prefix-match", json={"tokens": PROMPT})).json()
        rows = [(row["dp_rank"], row["gpu_blocks"]) for row in answer["engines"]]
        assert rows == [(1, len(PROMPT) // PAGE), (0, 0)]
    finally:
        publisher.close()
        server.close()


async def test_an_sglang_server_without_events_is_refused_saying_how(live) -> None:
    server = EngineServer({"/v1/models": MODELS, "/server_info": {"kv_events": None}})
    try:
        body = {"url": server.url, "adapter": "sglang"}
        refused = await live.client.post("/engines", json=body, headers=AUTH)
        assert refused.status_code >= 400
        assert "--kv-events-config" in refused.text and "/server_info" in refused.text
    finally:
        server.close()
