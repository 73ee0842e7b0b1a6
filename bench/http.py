"""Item 6: GET /prefix-match over HTTP, by tokens and by block hashes, 8k-token prompts.

A uvicorn server runs in a forked child with the whole fleet applied to its
memory store and every engine registered (sha256, as the simulated engines
hash, so ``tokens`` queries are hashed server-side). This process drives it
over keep-alive connections at a fixed concurrency with a minimal HTTP/1.1
client, so the client costs little next to the server. Each scenario gives
requests/s and p50/p99 (medians of rounds of every scenario in turn), against
``GET /bare``: an endpoint of the same app (same middleware, server and run)
that does no work. With ``--profile`` the server runs under pyinstrument.
Token hashing cost per 1k tokens is measured in process for every algorithm,
the compiled core against the pure-Python reference, interleaved.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from urllib.parse import quote

import uvicorn

from api import ApiSettings
from bench.fleet import BLOCK_SIZE, CHUNK_BLOCKS, Fleet, rank_of
from bench.measure import interleaved, latency_ms
from bench.query import load
from bench.report import Figure, Goal, Report
from indexer.engine_registry import EngineRegistry, EngineSpec, RankStatus
from indexer.engines.vllm import native
from indexer.engines.vllm.hashing import HASH_ALGOS, HashSpec, block_hashes
from indexer.stores import MemoryStore
from kvindex.wiring import api_app
from tests.servers import free_port

SECTION = "6"
TOKENS = 8192
#: The compiled token hashing must be at least 5x faster than the reference.
HASHING_GOAL = Goal(1 / 5, at_least=False)
#: Issue 16: req/s of a prefix match against the bare endpoint's, by what the query sends.
REQ_PER_S_GOALS = {"block_hashes": Goal(0.5), "tokens": Goal(0.35)}
#: Rounds of every scenario in turn; each figure is the median over them.
ROUNDS = 3


class AllConnected:
    """The consumer view of a healthy fleet: every rank connected, nothing degraded."""

    def rank_status(self, engine: str) -> list[RankStatus]:
        return [RankStatus(dp_rank=0, connected=True)]

    def running(self) -> bool:
        return True


def _serve(fleet: Fleet, port: int, profile: Path | None) -> None:
    store, registry = MemoryStore(), EngineRegistry()

    async def fill() -> None:
        await load(store, fleet.stream)
        for e in range(fleet.config.engines):
            name = rank_of(e).engine
            spec = EngineSpec(name, "tcp://127.0.0.1:1", "m", blocks_per_chunk=CHUNK_BLOCKS)
            await registry.add(spec)

    asyncio.run(fill())
    app = api_app(store, registry, AllConnected(), ApiSettings())

    @app.get("/bare", include_in_schema=False)
    async def bare() -> dict:
        return {}

    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", h11_max_incomplete_event_size=1 << 20
    )
    server = uvicorn.Server(config)
    if profile is None:
        server.run()
    else:
        _profiled(server.run, profile)


def _profiled(serve: Callable[[], None], out: Path) -> None:
    """``serve`` under pyinstrument (1 ms samples: little next to a request's cost), the
    profile written to ``out`` once the parent stops the server."""
    from pyinstrument import Profiler  # the bench extra; needed only for --profile

    # uvicorn shuts down on SIGTERM, then raises it again: leave through the finally below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    profiler = Profiler(interval=0.001)
    profiler.start()
    try:
        serve()
    finally:
        profiler.stop()
        out.write_text(profiler.output_text(unicode=False, show_all=False))


async def _request(reader, writer, raw: bytes) -> float:
    started = time.perf_counter()
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    if status != 200:
        raise RuntimeError(f"HTTP {status}")
    return time.perf_counter() - started


async def scenario(port: int, raws: list[bytes], concurrency: int, requests: int) -> dict:
    """``requests`` requests over ``concurrency`` keep-alive connections."""
    latencies: list[float] = []
    todo = iter(range(requests))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        for n in todo:
            latencies.append(await _request(reader, writer, raws[n % len(raws)]))
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {**latency_ms(latencies), "req_per_s": len(latencies) / (time.perf_counter() - started)}


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()


def requests_for(fleet: Fleet, count: int) -> dict[str, list[bytes]]:
    prompts = fleet.prompts(TOKENS, count)
    spec = fleet.spec()
    tokens = [",".join(map(str, p)) for p in prompts]
    hashes = [",".join(map(str, block_hashes(spec, p))) for p in prompts]
    return {
        "bare": [_get("/bare")],
        "tokens": [_get(f"/prefix-match?tokens={quote(t, safe=',')}") for t in tokens],
        "block_hashes": [_get(f"/prefix-match?block_hashes={h}") for h in hashes],
    }


def hashing_us_per_1k_tokens(rounds: int = 200, repeats: int = 7) -> dict[str, dict[str, float]]:
    """Microseconds to hash 1k tokens (64 blocks of 16) per algorithm, in process:
    ``block_hashes`` (the compiled core when built) and the pure-Python reference."""
    tokens = list(range(100_000, 101_024))
    cost = {}
    for algo in HASH_ALGOS:
        spec = HashSpec(algo, "0", BLOCK_SIZE)

        def rounds_of(hashes, spec=spec):
            def run() -> None:
                for _ in range(rounds):
                    hashes(spec, tokens)

            return run

        medians = interleaved(
            repeats,
            {
                "compiled": rounds_of(block_hashes),
                "reference": rounds_of(partial(block_hashes, compiled=False)),
            },
        )
        cost[algo] = {name: 1e6 * s / rounds for name, s in medians.items()}
    return cost


async def _listening(port: int) -> None:
    for _ in range(200):  # the child loads the fleet before it listens
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.2)


async def _drive(
    port: int, server: int, raws: dict[str, list[bytes]], concurrency: int, requests: int
) -> dict:
    """Each scenario warmed up, then ROUNDS rounds of all in turn (a slow moment of the shared
    machine hits every scenario alike); per figure, the median over the rounds, and the
    ``server`` process's CPU per request over all rounds (what a busy machine's waits leave out).
    """
    await _listening(port)
    for batch in raws.values():
        await scenario(port, batch, concurrency, max(20, requests // 10))
    rounds: dict[str, list[dict]] = {name: [] for name in raws}
    cpu = dict.fromkeys(raws, 0.0)
    for _ in range(ROUNDS):
        for name, batch in raws.items():
            before = _cpu_seconds(server)
            rounds[name].append(await scenario(port, batch, concurrency, requests // ROUNDS))
            cpu[name] += _cpu_seconds(server) - before
    per_request = ROUNDS * (requests // ROUNDS)
    return {
        name: {**_medians(r), "server_cpu_us": 1e6 * cpu[name] / per_request}
        for name, r in rounds.items()
    }


def _medians(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    report: Report, fleet: Fleet, concurrency: int, requests: int, profile: Path | None = None
) -> dict:
    """Measure, add the figures, return the raw numbers; with ``profile``, the server's
    profile over every scenario (warm-ups included) goes there."""
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_serve, args=(fleet, port, profile))
    child.start()
    try:
        raws = requests_for(fleet, 16)
        results = asyncio.run(_drive(port, child.pid, raws, concurrency, requests))
    finally:
        child.terminate()
        child.join(10)
    bare = results["bare"]
    for by in ("tokens", "block_hashes"):
        r = results[by]
        report.add(
            Figure(SECTION, f"HTTP GET by {by}, 8k tokens, c={concurrency}: req/s", r["req_per_s"],
                   "req/s", "bare endpoint, same server", bare["req_per_s"], REQ_PER_S_GOALS[by]),
            Figure(SECTION, f"HTTP GET by {by}, 8k tokens, c={concurrency}: p50", r["p50_ms"], "ms",
                   "bare endpoint p50", bare["p50_ms"]),
            Figure(SECTION, f"HTTP GET by {by}, 8k tokens, c={concurrency}: p99", r["p99_ms"], "ms",
                   "bare endpoint p99", bare["p99_ms"]),
            Figure(SECTION, f"HTTP GET by {by}, 8k tokens: server CPU per request",
                   r["server_cpu_us"], "us", "bare endpoint, same server", bare["server_cpu_us"],
                   note=f"1 / ratio = {bare['server_cpu_us'] / r['server_cpu_us']:.3g}: the req/s "
                   "ratio a server with a core to itself would give"),
        )  # fmt: skip
    hashing = hashing_us_per_1k_tokens()
    core = "compiled" if native.PART.available else "NOT compiled (extension missing)"
    for algo, us in hashing.items():
        report.add(
            Figure(SECTION, f"token hashing, {algo}, {core}", us["compiled"], "us/1k tokens",
                   "pure-Python reference, same run", us["reference"], HASHING_GOAL,
                   "goal: >= 5x faster, bit-exact"),
        )  # fmt: skip
    return {
        "concurrency": concurrency,
        "requests": requests,
        "scenarios": results,
        "hash_us_per_1k_tokens": hashing,
        "compiled_core": native.PART.status(),
    }
