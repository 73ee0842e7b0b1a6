"""Item 12: routed entries. ``POST /routed`` over HTTP against the bare endpoint, and
the prefix-match cost with 10k live routed entries against none.

- ``POST /routed``: a uvicorn server in a forked child (the fleet's engines
  registered, routed entries in process) takes 4k-token prompts as block hashes
  (256 each), each to another engine, over keep-alive connections at a fixed
  concurrency; ``GET /bare`` of the same app, server and run is the baseline.
- Prefix match: the API's matcher, in process, over the fleet's embedded store,
  every engine asked; once with no routed entry, once with ~10k live ones
  (20 fleet prompts routed each to a rank of its own, the rest prompts nobody
  served on other ranks). Two query sets: the routed prompts themselves (each
  lookup walks its rank's whole routed run beyond the exact one, and the runs
  of the ranks whose routed prompts share its system prompt), and other
  prompts of the fleet (what most queries are).
  Interleaved, query by query, so a noisy moment hits both.
- In Redis (scale-out): a private ``redis-server`` holding the fleet's final
  residency and the same ~10k routed entries; the routed lookup of a query
  (one script) against the store's own prefix match of it, query by query.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from api import ApiSettings
from bench import redis_bench
from bench.fleet import BLOCK_SIZE, CHUNK_BLOCKS, Fleet, rank_of
from bench.http import AllConnected, scenario
from bench.measure import latency_ms
from bench.query import timed_calls
from bench.redis_bench import bulk_load, residency_batches
from bench.report import Figure, Goal, Report
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.engines.vllm.hashing import block_hashes
from indexer.loads import LoadBoard
from indexer.query import LoadAwarePicker, Query, ReadPath
from indexer.routed import MemoryRouted, RedisRouted
from indexer.stores import MemoryStore
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.token_index import TokenIndex
from kvindex.wiring import api_app
from tests.servers import RedisServer, free_port

SECTION = "12"
BLOCKS = 256  # a 4k-token prompt in blocks of 16
LIVE = 10_000
RECORD_GOAL = Goal(0.5)
MATCH_GOAL = Goal(1.2, at_least=False)
REDIS_GOAL = Goal(1.0, at_least=False)


def _specs(fleet: Fleet) -> list[EngineSpec]:
    return [
        EngineSpec(rank_of(e).engine, "tcp://127.0.0.1:1", "m", blocks_per_chunk=CHUNK_BLOCKS)
        for e in range(fleet.config.engines)
    ]


def _serve(fleet: Fleet, port: int) -> None:
    registry = EngineRegistry()

    async def fill() -> None:
        for spec in _specs(fleet):
            await registry.add(spec)

    asyncio.run(fill())
    app = api_app(MemoryStore(), registry, AllConnected(), ApiSettings())

    @app.get("/bare", include_in_schema=False)
    async def bare() -> dict:
        return {}

    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data


async def _drive(port: int, raws: dict[str, list[bytes]], concurrency: int, requests: int) -> dict:
    for _ in range(200):  # the child registers the fleet before it listens
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.2)
    out: dict[str, dict] = {name: {} for name in raws}
    for _ in range(3):  # interleaved: bare, routed, bare, routed, ...; the best of 3
        for name, batch in raws.items():
            got = await scenario(port, batch, concurrency, requests)
            if got["req_per_s"] > out[name].get("req_per_s", 0):
                out[name] = got
    return out


def record_rate(fleet: Fleet, concurrency: int, requests: int) -> dict:
    chains = fleet.chains(BLOCKS, 32)
    engines = [rank_of(e).engine for e in range(fleet.config.engines)]
    raws = {
        "bare": [b"GET /bare HTTP/1.1\r\nHost: bench\r\n\r\n"],
        "routed": [
            _post("/routed", {"engine": engines[i % len(engines)], "block_hashes": chain})
            for i, chain in enumerate(chains)
        ],
    }
    port = free_port()
    child = multiprocessing.get_context("fork").Process(target=_serve, args=(fleet, port))
    child.start()
    try:
        return asyncio.run(_drive(port, raws, concurrency, requests))
    finally:
        child.terminate()
        child.join(10)


def _matcher(store: MemoryStore, fleet: Fleet, routed: MemoryRouted) -> Callable:
    registry = EngineRegistry()

    async def fill() -> None:
        for spec in _specs(fleet):
            await registry.add(spec)

    asyncio.run(fill())
    settings = ApiSettings()
    loads = LoadBoard(registry, store, settings.load)
    picker = LoadAwarePicker(routed, loads, settings.routed).route
    # the read path alone, over the bare store: no app around it
    matcher = ReadPath(
        store,
        registry,
        AllConnected(),
        TokenIndex(1024, lambda engine: False),
        routed,
        picker,
        settings.weights,
    )

    def call(chain: list[int]) -> object:
        coroutine = matcher.match(Query(chain=chain))
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        raise RuntimeError("match suspended")

    return call


def _random_chains(fleet: Fleet, count: int, seed: int) -> list[list[int]]:
    """Chains of prompts nobody served (no block of them held or routed by chance)."""
    spec, rng = fleet.spec(), random.Random(seed)
    tokens = BLOCKS * BLOCK_SIZE
    return [
        block_hashes(spec, [rng.randrange(32_000) for _ in range(tokens)]) for _ in range(count)
    ]


def match_cost(fleet: Fleet, store: MemoryStore, queries: int, rounds: int) -> dict:
    """p50/p99 of matches with no routed entry and with ~10k, for queries whose prompts
    are routed (each to a rank of its own) and for queries of other prompts."""
    routed_prompts = fleet.chains(BLOCKS, queries)
    other_prompts = fleet.chains(BLOCKS, queries, seed=23)
    routed = MemoryRouted()
    engines = fleet.config.engines
    for i, chain in enumerate(routed_prompts):
        asyncio.run(routed.record(rank_of(i % engines), chain, 3600.0, 100_000))
    for i, chain in enumerate(_random_chains(fleet, LIVE // BLOCKS - queries + 1, 11)):
        asyncio.run(routed.record(rank_of((i + queries) % engines), chain, 3600.0, 100_000))
    candidates = {
        "none": _matcher(store, fleet, MemoryRouted()),
        "routed": _matcher(store, fleet, routed),
    }
    out: dict = {"live_entries": routed.local_counts()["live"]}
    for name, chains in (("routed_prompts", routed_prompts), ("other_prompts", other_prompts)):
        samples = timed_calls(candidates, chains, rounds)
        out[name] = {label: latency_ms(s) for label, s in samples.items()}
    return out


async def _redis_cost(url: str, fleet: Fleet, reference: MemoryStore, queries: int) -> dict:
    config = RedisConfig(url, prefix="bench-routed", sweep_interval=None)
    store, routed = RedisStore(config), RedisRouted(config)
    try:
        await bulk_load(store, await residency_batches(reference))
        chains = fleet.chains(BLOCKS, queries)
        engines = {rank_of(e).engine: CHUNK_BLOCKS for e in range(fleet.config.engines)}
        for i, chain in enumerate(chains):
            await routed.record(rank_of(i % len(engines)), chain, 3600.0, 100_000)
        for i, chain in enumerate(_random_chains(fleet, LIVE // BLOCKS - queries + 1, 11)):
            await routed.record(rank_of((i + queries) % len(engines)), chain, 3600.0, 100_000)
        samples: dict[str, list[float]] = {"store": [], "routed": []}
        for _ in range(5):
            for chain in chains:
                started = time.perf_counter()
                found = await store.prefix_match(chain, engines)
                middle = time.perf_counter()
                starts = {rank: m.gpu_blocks for rank, m in found.items() if m.gpu_blocks}
                await routed.lookup(chain, starts, engines.keys())
                samples["store"].append(middle - started)
                samples["routed"].append(time.perf_counter() - middle)
        live = (await routed.counts())["live"]
        return {"live_entries": live, **{name: latency_ms(s) for name, s in samples.items()}}
    finally:
        await routed.close()
        await store.close()


def redis_cost(fleet: Fleet, reference: MemoryStore, queries: int) -> dict | None:
    """The Redis figures, or None without a redis-server to run."""
    if not redis_bench.available():
        return None
    workdir = Path(tempfile.mkdtemp(prefix="bench-routed-"))
    server = RedisServer(workdir, free_port()).start()
    try:
        return asyncio.run(_redis_cost(server.url, fleet, reference, queries))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def run(report: Report, fleet: Fleet, store: MemoryStore, quick: bool) -> dict:
    concurrency, requests = 8, (300 if quick else 2000)
    rates = record_rate(fleet, concurrency, requests)
    cost = match_cost(fleet, store, 20, 3 if quick else 10)
    bare, routed = rates["bare"], rates["routed"]
    live = cost["live_entries"]
    report.add(
        Figure(SECTION, f"POST /routed, 256 blocks, c={concurrency}: req/s", routed["req_per_s"],
               "req/s", "bare endpoint, same server", bare["req_per_s"], RECORD_GOAL),
        Figure(SECTION, f"POST /routed, 256 blocks, c={concurrency}: p50", routed["p50_ms"], "ms",
               "bare endpoint p50", bare["p50_ms"]),
    )  # fmt: skip
    for case, what in (("routed_prompts", "prompts routed"), ("other_prompts", "other prompts")):
        none, held = cost[case]["none"], cost[case]["routed"]
        name = f"prefix match, {BLOCKS}-block chain, {what}, {live:,} routed entries"
        report.add(
            Figure(SECTION, f"{name}: p50", held["p50_ms"], "ms", "no routed entries p50",
                   none["p50_ms"], MATCH_GOAL),
            Figure(SECTION, f"{name}: p99", held["p99_ms"], "ms", "no routed entries p99",
                   none["p99_ms"]),
        )  # fmt: skip
    in_redis = redis_cost(fleet, store, 20)
    if in_redis is None:
        report.notes.append("item 12 in Redis skipped: redis-server not found")
    else:
        report.add(
            Figure(SECTION, f"Redis: routed lookup, {BLOCKS}-block chain, "
                   f"{in_redis['live_entries']:,} entries: p50", in_redis["routed"]["p50_ms"], "ms",
                   "the Redis store's prefix match p50", in_redis["store"]["p50_ms"], REDIS_GOAL,
                   "goal: within a prefix match's budget"),
        )  # fmt: skip
    return {
        "concurrency": concurrency,
        "requests": requests,
        "http": rates,
        "match": cost,
        "redis": in_redis,
    }
