"""HTTP prefix-match latency: 64 engines, 8k-token prompts, against a real server.

Run (from the repo root, venv active)::

    python bench/bench_http.py                      # defaults: 64 engines, 8192 tokens
    python bench/bench_http.py --concurrency 1 16 --requests 2000 --json bench/results/http.json

The script starts a uvicorn server in a child process (a memory store filled
with every engine's GPU and CPU residency of the benchmark prompts plus
unrelated blocks), then drives it from this process over keep-alive
connections at a fixed concurrency with a minimal HTTP/1.1 client, so that
client overhead stays small next to the server's. Each scenario reports
p50/p99 latency and requests per second, and their ratio to ``GET /bare``:
an endpoint of the same app (same middleware, same server, same run) that
does no work, so the ratios isolate what prefix matching costs. It also
reports in-process token hashing cost per 1k tokens for every algorithm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import uvicorn

from api import ApiSettings, create_app
from indexer.engines import EngineRegistry, EngineSpec, RankStatus
from indexer.hashing import HASH_ALGOS, HashSpec, block_hashes
from indexer.model import RankId
from indexer.stores import MemoryStore
from indexer.wire import BlockStored, EventBatch

BLOCK_SIZE = 16
CHUNK = 4
PROMPTS = 16
NOISE_BLOCKS = 4096  # unrelated resident blocks per engine


def prompts(tokens: int) -> list[list[int]]:
    """Benchmark prompts: one shared system prefix, then per-prompt tokens."""
    rng = random.Random(0)
    shared = [rng.randrange(150_000) for _ in range(tokens // 4)]
    return [
        shared + [rng.randrange(150_000) for _ in range(tokens - len(shared))]
        for _ in range(PROMPTS)
    ]


class AllConnected:
    """The consumer view of a healthy fleet: every rank connected, nothing degraded."""

    def rank_status(self, engine: str) -> list[RankStatus]:
        return [RankStatus(dp_rank=0, connected=True)]

    def running(self) -> bool:
        return True


async def populate(store: MemoryStore, registry: EngineRegistry, engines: int, tokens: int) -> None:
    """Engine i holds a different share of every prompt on GPU and more of it on CPU."""
    spec = HashSpec("sha256", None, BLOCK_SIZE)
    chains = [block_hashes(spec, p) for p in prompts(tokens)]
    rng = random.Random(1)
    for i in range(engines):
        name = f"vllm-{i:02d}"
        await registry.add(
            EngineSpec(name=name, endpoint="tcp://127.0.0.1:1", model="m", blocks_per_chunk=CHUNK)
        )
        events = [BlockStored([rng.getrandbits(64) for _ in range(NOISE_BLOCKS)], medium="GPU")]
        for chain in chains:
            gpu = rng.randrange(len(chain) + 1)
            cpu = min(len(chain), gpu + rng.randrange(len(chain) // 2)) // CHUNK * CHUNK
            events.append(BlockStored(chain[:gpu], medium="GPU"))
            events += [
                BlockStored(chain[j : j + CHUNK], token_ids=[0] * CHUNK * BLOCK_SIZE,
                            block_size=BLOCK_SIZE, medium="CPU")
                for j in range(0, cpu, CHUNK)
            ]  # fmt: skip
        await store.apply_batch(RankId(name, 0), 0, EventBatch(time.time(), events, 0))


def serve(port: int, engines: int, tokens: int) -> None:
    """The server child: the app over a filled store, plus ``GET /bare``."""
    store, registry = MemoryStore(), EngineRegistry()
    asyncio.run(populate(store, registry, engines, tokens))
    app = create_app(store, registry, AllConnected(), ApiSettings())

    @app.get("/bare", include_in_schema=False)
    async def bare() -> dict:
        return {}

    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        h11_max_incomplete_event_size=1 << 20,  # 8k-token GET query strings
    )
    server = uvicorn.Server(config)
    print("READY", flush=True)
    server.run()


# --- client --------------------------------------------------------------------


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes) -> float:
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
    elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"HTTP {status}")
    return elapsed


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
    wall = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "req_per_s": len(latencies) / wall,
    }


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()


def post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def requests_for(tokens: int) -> dict[str, list[bytes]]:
    spec = HashSpec("sha256", None, BLOCK_SIZE)
    ps = prompts(tokens)
    csv = [",".join(map(str, p)) for p in ps]
    hashes = [",".join(map(str, block_hashes(spec, p))) for p in ps]
    return {
        "bare": [get("/bare")],
        "GET tokens": [get(f"/prefix-match?tokens={quote(c, safe=',')}") for c in csv],
        "GET block_hashes": [get(f"/prefix-match?block_hashes={h}") for h in hashes],
        "POST tokens": [post("/prefix-match", {"tokens": p}) for p in ps],
    }


def hashing_cost() -> dict[str, float]:
    """Microseconds to hash 1k tokens (64 blocks of 16), per algorithm, in process."""
    tokens = list(range(100_000, 101_024))
    cost = {}
    for algo in HASH_ALGOS:
        spec = HashSpec(algo, "0", BLOCK_SIZE)
        block_hashes(spec, tokens)
        rounds = 200
        started = time.perf_counter()
        for _ in range(rounds):
            block_hashes(spec, tokens)
        cost[algo] = 1e6 * (time.perf_counter() - started) / rounds
    return cost


async def drive(port: int, args: argparse.Namespace, concurrency: int) -> dict:
    results = {}
    for name, raws in requests_for(args.tokens).items():
        await scenario(port, raws, concurrency, max(20, args.requests // 10))  # warm up
        results[name] = await scenario(port, raws, concurrency, args.requests)
    bare = results["bare"]
    for r in results.values():
        r["p50_x_bare"] = r["p50_ms"] / bare["p50_ms"]
        r["p99_x_bare"] = r["p99_ms"] / bare["p99_ms"]
        r["rps_x_bare"] = r["req_per_s"] / bare["req_per_s"]
    return results


async def store_cost(engines: int, tokens: int) -> float:
    """Milliseconds of one ``store.prefix_match`` over all engines, in process: the
    part of a query the API does not control."""
    store, registry = MemoryStore(), EngineRegistry()
    await populate(store, registry, engines, tokens)
    spec = HashSpec("sha256", None, BLOCK_SIZE)
    chains = [block_hashes(spec, p) for p in prompts(tokens)]
    declared = {s.name: s.blocks_per_chunk for s in registry.all()}
    started = time.perf_counter()
    for chain in chains:
        await store.prefix_match(chain, declared)
    return 1000 * (time.perf_counter() - started) / len(chains)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=1000, help="per scenario")
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.engines, args.tokens)
        return 0
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", *sys.argv[1:]], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        time.sleep(1.0)  # uvicorn binds after printing READY
        results = {c: asyncio.run(drive(args.port, args, c)) for c in args.concurrency}
    finally:
        child.terminate()
        child.wait(10)
    report = {
        "engines": args.engines,
        "tokens": args.tokens,
        "requests": args.requests,
        "by_concurrency": results,
        "store_prefix_match_ms": asyncio.run(store_cost(args.engines, args.tokens)),
        "hash_us_per_1k_tokens": hashing_cost(),
    }
    print(f"{args.engines} engines, {args.tokens}-token prompts, {args.requests} requests each")
    print(f"{'conc':>4} {'scenario':18} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'p50 x':>7}"
          f" {'p99 x':>7} {'rps x':>7}")  # fmt: skip
    for concurrency, scenarios in results.items():
        for name, r in scenarios.items():
            print(
                f"{concurrency:4} {name:18} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
                f" {r['req_per_s']:8.0f} {r['p50_x_bare']:7.1f} {r['p99_x_bare']:7.1f}"
                f" {r['rps_x_bare']:7.3f}"
            )
    print(f"store.prefix_match alone, in process: {report['store_prefix_match_ms']:.2f} ms")
    print(
        "hashing, us per 1k tokens:",
        {k: round(v) for k, v in report["hash_us_per_1k_tokens"].items()},
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
