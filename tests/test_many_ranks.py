"""One process follows a thousand engine ranks, most of them silent.

ZeroMQ's default context takes 1,023 sockets and the consumer used four per
rank: the 255th engine was refused with "Too many open files". Silent ranks
(nothing listening on their endpoints) must cost next to nothing and say,
once each, that there is no publisher; the one live engine among them is
consumed exactly.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import httpx
import msgspec
import pytest

from api import ApiSettings
from indexer.core.events import RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.sockets import SocketLimit
from indexer.ingest.subscriber import Subscriber, raise_file_limit
from indexer.stores import MemoryStore
from kvindex.wiring import api_app

from .conftest import assert_matches_trace, free_ports, trace_batches, wait_until
from .test_subscriber import FAST, Engine, applied, publish, status

SILENT = 999


def silent_engines(count: int, taken: frozenset[int] = frozenset()) -> list[EngineSpec]:
    """Engines whose ports were free a moment ago: nothing listens there.

    ``taken`` holds ports a live publisher binds in this test; a silent rank
    that drew one of them would connect to it and never be reported.
    """
    specs = []
    while len(specs) < count:
        port = free_ports(2)
        if {port, port + 1} & taken:
            continue
        i = len(specs)
        specs.append(
            EngineSpec(
                f"silent-{i}",
                f"tcp://127.0.0.1:{port}",
                replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
            )
        )
    return specs


@pytest.mark.slow
async def test_a_thousand_ranks_in_one_process(caplog) -> None:
    live = Engine("live")
    registry = EngineRegistry()
    store = MemoryStore()
    settings = msgspec.structs.replace(FAST, no_publisher_after=3.0)
    sub = Subscriber(store, registry, settings)
    await sub.start()
    silent = silent_engines(SILENT, taken=frozenset({live.pub, live.replay}))
    try:
        with caplog.at_level(logging.WARNING, logger="kvindex.subscriber"):
            for spec in silent[: SILENT // 2]:
                await registry.add(spec)
            await registry.add(live.spec)
            for spec in silent[SILENT // 2 :]:
                await registry.add(spec)
            assert len(registry.all()) == SILENT + 1
            pub = live.publisher()
            await wait_until(lambda: status(sub, "live").connected, what="live connected")
            await publish(pub, trace_batches("chat-sha256"))
            await applied(sub, 249, engine="live")
            await assert_matches_trace(store, RankId("live", 0), "chat-sha256")
            await wait_until(
                lambda: all(sub.rank_status(s.name)[0].never_connected for s in silent),
                timeout=30,
                what="every silent rank reported",
            )
        live_status = status(sub, "live")
        assert live_status.connected and not live_status.never_connected
        assert not live_status.degraded
        warned = [r.endpoint for r in caplog.records if "no publisher at" in r.getMessage()]
        # one line per silent rank, never repeated; the live rank, whose publisher starts
        # only after every rank is added, may say so once if that took over 3 s (busy host)
        silent_warned = [endpoint for endpoint in warned if endpoint != live.spec.endpoint]
        assert sorted(silent_warned) == sorted(s.endpoint for s in silent)
        assert warned.count(live.spec.endpoint) <= 1
        assert all(sub.rank_status(s.name)[0].replays == 0 for s in silent)
    finally:
        await sub.stop()
        live.close()


async def test_the_socket_limit_is_named_when_reached() -> None:
    """A process that truly runs out of files says which limits to raise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    registry = EngineRegistry()
    sub = Subscriber(MemoryStore(), registry, FAST)
    await sub.start()
    specs = silent_engines(200)
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
    try:
        with pytest.raises(SocketLimit) as refused:
            for spec in specs:
                await registry.add(spec)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await sub.stop()
    message = str(refused.value)
    assert "open files are limited to 200" in message and f"hard limit {hard}" in message
    assert "ulimit -n" in message
    assert refused.value.errno == errno.EMFILE


def test_the_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        raised = raise_file_limit()
        assert raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raised == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
async def test_a_rank_without_publisher_is_named_once_and_in_readyz(caplog) -> None:
    """Nothing listening: one warning per rank naming the endpoint, ``never_connected``,
    and ``/readyz`` listing the ranks (503 only while no rank has a publisher)."""
    ghost = EngineSpec("ghost", f"tcp://127.0.0.1:{free_ports(2)}", dp_ranks=2)
    store, registry = MemoryStore(), EngineRegistry()
    sub = Subscriber(store, registry, msgspec.structs.replace(FAST, no_publisher_after=0.5))
    app = api_app(store, registry, sub, ApiSettings())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvindex")
    live = Engine("live")
    await sub.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvindex.subscriber"):
            await registry.add(ghost)
            await wait_until(lambda: all(s.never_connected for s in sub.rank_status("ghost")))
            refused = await client.get("/readyz")
            assert refused.status_code == 503
            endpoints = [f"ghost/{r} {ghost.rank_endpoint(r)}" for r in range(2)]
            assert (
                refused.json()["error"] == f"no engine rank has a publisher: {', '.join(endpoints)}"
            )

            await registry.add(live.spec)
            live.publisher()
            await wait_until(lambda: status(sub, "live").connected, what="live connected")
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json() == {"status": "ok", "no_publisher": endpoints}
            ranks = (await client.get("/engines/ghost")).json()["ranks"]
            assert [r["never_connected"] for r in ranks] == [True, True]
            metrics = (await client.get("/metrics")).text
            assert 'kvindex_ingest_never_connected{dp_rank="1",engine="ghost"} 1.0' in metrics
            assert 'kvindex_ingest_never_connected{dp_rank="0",engine="live"} 0.0' in metrics
            await asyncio.sleep(1.0)  # twice the threshold: the warning is not repeated
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sorted(w for w in warnings if "no publisher" in w) == [
            f"no publisher at {ghost.rank_endpoint(r)}: nothing answered in 0.5 s; check that"
            " the engine runs with --kv-events-config publishing on this host and port (or set"
            " bind: true if the engine connects to kvindex)"
            for r in range(2)
        ]
        assert not any("replay" in w for w in warnings)
    finally:
        await client.aclose()
        await sub.stop()
        live.close()
