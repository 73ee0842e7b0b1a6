"""The HTTP API served for real: over uvicorn's real HTTP, and fed by the real
subscriber from a publisher, since the app alone cannot show the line limits
or the whole path from an engine's events to an answer."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import pytest
import uvicorn

from api import ApiSettings
from indexer.core.events import RankId
from indexer.engine_registry import EngineRegistry
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.stores import MemoryStore
from kvindex.wiring import api_app

from .api_cases import ENGINE_BODY, _tier_tokens, batch, gpu
from .apikit import FakeConsumers, LiveApi, csv, engine
from .conftest import TRACE_NAMES, free_ports, load_expected_json, trace_batches

# --- a real server ---------------------------------------------------------------


@contextlib.contextmanager
def _listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


async def test_a_real_uvicorn_server_answers_long_get_prompts() -> None:
    """Over real HTTP: 8k-token GET query strings must fit (h11's line limit is raised)."""
    store, registry = MemoryStore(), EngineRegistry()
    consumers = FakeConsumers(store)
    app = api_app(store, registry, consumers, ApiSettings())
    await registry.add(engine("a"))
    tokens = list(range(100_000, 108_192))
    chain = block_hashes(HashSpec("sha256", None, 16), tokens)
    await consumers.apply(RankId("a", 0), 0, batch(gpu(chain[:100])))
    port = free_ports()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", h11_max_incomplete_event_size=1 << 20
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            got = await client.get(f"/prefix-match?tokens={csv(tokens)}")  # commas unescaped
            assert got.status_code == 200, got.text
            assert got.json()["engines"][0]["gpu_blocks"] == 100
            posted = await client.post("/prefix-match", json={"block_hashes": chain})
            assert posted.json()["engines"][0]["gpu_blocks"] == 100
    finally:
        server.should_exit = True
        await task


# --- through the real subscriber -------------------------------------------------


@pytest.mark.parametrize("name", TRACE_NAMES)
async def test_traces_fed_through_the_subscriber_answer_like_vllm(name: str) -> None:
    """Publisher -> ZMQ -> subscriber -> store and token index -> HTTP, by tokens and hashes."""
    expected = load_expected_json(name)
    cfg = expected["engine"]
    batches = trace_batches(name)
    last = len(batches) - 1  # the publisher numbers them 0.., as the trace does
    # capped (the default) holds one reference per GPU block: where vLLM holds a block
    # twice, the engine is run as one whose clients ask no reports (none did here)
    copies = max(expected["expected"]["gpu_refcounts"].values()) > 1
    async with LiveApi() as live:
        (publisher,) = await live.add_published(
            "vllm-a",
            block_size=cfg["block_size"],
            blocks_per_chunk=cfg["blocks_per_chunk"],
            reuse_reports="counted" if copies else "capped",
        )
        assert all(publisher.publish(batch) for batch in batches)
        await live.wait_applied("vllm-a", [last])
        for probe in expected["probes"]:
            want = {k: probe[k] for k in ("gpu_tokens", "cpu_prefix_tokens")}
            for params in (
                {"tokens": csv(probe["tokens"])},
                {"block_hashes": csv(probe["hashes"])},
            ):
                answer = (await live.client.get("/prefix-match", params=params)).json()
                assert _tier_tokens(answer) == want, probe
                assert not answer["engines"][0]["degraded"]
        state = (await live.client.get("/engines/vllm-a")).json()
        assert state["ranks"][0]["applied_seq"] == last
        assert state["ranks"][0]["blocks"] == {
            "GPU": len(expected["expected"]["gpu_refcounts"]),
            "CPU": len(expected["expected"]["cpu_refcounts"]),
            "STORAGE": 0,
        }
        assert (await live.client.get("/readyz")).status_code == 200
        assert (await live.client.delete("/engines/vllm-a")).status_code == 200
        assert await live.store.ranks() == []  # the subscriber forgot the engine


async def test_an_engine_the_subscriber_cannot_consume_is_refused() -> None:
    """The subscriber must bind this endpoint, but the port is taken."""
    with _listening() as port:
        async with LiveApi() as live:
            endpoint = f"tcp://127.0.0.1:{port}"
            body = ENGINE_BODY | {"endpoint": endpoint, "replay_endpoint": None, "bind": True}
            refused = await live.client.post("/engines", json=body)
            assert refused.status_code == 422
            assert "cannot consume engine 'vllm-a'" in refused.json()["error"]
            assert (await live.client.get("/engines")).json() == []
