"""Redis store: apply rate, prefix-match latency, memory per entry — against baselines
measured in the same run on the same redis-server.

Run: ``.venv/bin/python -m bench.bench_redis [--entries 1000000] [--engines 64]``
(needs ``redis-server`` and ``redis-benchmark`` on PATH; starts a private
redis-server on a free port, without persistence, and stops it at exit;
a few minutes on 2 cores).

1. Apply rate: every vLLM fixture trace replayed by ``--ranks`` engine ranks at
   once through one RedisStore (decode, plan, apply, commit; one process), in
   block-ops/s, as a ratio to ``redis-benchmark -P 64`` running HINCRBY on
   the same server (the better of a run before and one after; goal >= 0.5).
   The bulk load of step 2 gives a second rate, for large store-only batches.
2. Prefix match: ``--engines`` ranks hold GPU prefixes and CPU chunks of
   shared 512-block prompts, ``--entries`` resident entries in all, loaded
   through ``apply_batch``. Latency of ``prefix_match`` for 512-block prompts
   with every engine listed, against 512 pipelined HGETALLs of the same block
   keys (goal: p50 within 2x).
3. Memory: growth of Redis ``used_memory`` over the load of step 2, per
   resident entry (goal <= 100 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from indexer.model import RankId
from indexer.replay import apply_trace, load_trace
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.wire import BlockStored, EventBatch
from tests.servers import RedisServer, free_port

TRACES = Path(__file__).resolve().parents[1].parent / "shared/fixtures/vllm-0.33.0/traces"
CHAIN = 512  # blocks per prompt
CHUNK = 16  # blocks per CPU chunk


async def apply_rate(url: str, ranks: int) -> dict:
    traces = [load_trace(p) for p in sorted(TRACES.glob("*.frames.msgpack"))]
    store = RedisStore(RedisConfig(url, prefix="bench-apply", sweep_interval=None))
    started = time.perf_counter()
    stats = await asyncio.gather(
        *(apply_trace(store, RankId(f"e{i}", 0), traces[i % len(traces)]) for i in range(ranks))
    )
    seconds = time.perf_counter() - started
    await store.close()
    ops = sum(s.block_ops for s in stats)
    return {"ranks": ranks, "block_ops": ops, "block_ops_per_s": round(ops / seconds)}


def hincrby_rate(port: int, requests: int) -> float:
    """``redis-benchmark -P 64`` HINCRBY on random hashes of one field: requests/s."""
    command = ["redis-benchmark", "-p", str(port), "-P", "64", "-n", str(requests)]
    command += ["-r", "1000000", "--csv", "HINCRBY", "bench-hincrby:__rand_int__", "f", "1"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    return float(rows[-1]["rps"])


def workload(engines: int, entries: int, seed: int = 7) -> tuple[list[list[int]], dict]:
    """Prompts (hash chains) and, per engine, (prompt, GPU depth, CPU depth) it holds.

    Depths are uniform, CPU depth in whole chunks and at least the GPU depth;
    engines take prompts until they hold ``entries / engines`` entries.
    """
    rng = random.Random(seed)
    prompts = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(max(64, engines * 4))]
    held: dict[int, list[tuple[int, int, int]]] = {}
    for e in range(engines):
        held[e], total = [], 0
        for p in rng.sample(range(len(prompts)), len(prompts)):
            if total >= entries // engines:
                break
            gpu = rng.randint(0, CHAIN)
            cpu = rng.randint(gpu // CHUNK, CHAIN // CHUNK) * CHUNK
            held[e].append((p, gpu, cpu))
            total += gpu + cpu
    return prompts, held


def batches(prompt: list[int], gpu: int, cpu: int) -> EventBatch:
    """One prompt's blocks as an engine announces them: GPU blocks, then CPU chunks."""
    tokens = [1] * 16
    events = [BlockStored(prompt[:gpu], None, tokens * gpu, 16, medium="GPU")] if gpu else []
    for j in range(0, cpu, CHUNK):
        chunk = prompt[j : j + CHUNK]
        events.append(BlockStored(chunk, None, tokens * CHUNK, 16, medium="CPU"))
    return EventBatch(time.time(), events, 0)


async def load(store: RedisStore, prompts: list[list[int]], held: dict) -> dict:
    async def engine(e: int) -> int:
        rank, ops = RankId(f"engine-{e}", 0), 0
        for seq, (p, gpu, cpu) in enumerate(held[e]):
            ops += (await store.apply_batch(rank, seq, batches(prompts[p], gpu, cpu))).block_ops
        return ops

    started = time.perf_counter()
    ops = sum(await asyncio.gather(*(engine(e) for e in held)))
    return {"block_ops": ops, "block_ops_per_s": round(ops / (time.perf_counter() - started))}


async def match_latency(store: RedisStore, url: str, prompts, engines: int, queries: int) -> dict:
    listed = {f"engine-{e}": None for e in range(engines)}
    client = Redis.from_url(url)
    rng = random.Random(3)
    ours, baseline, matched = [], [], 0
    for _ in range(queries):
        chain = rng.choice(prompts)
        started = time.perf_counter()
        found = await store.prefix_match(chain, listed)
        ours.append(time.perf_counter() - started)
        matched += sum(m.prefix_blocks for m in found.values())
        pipe = client.pipeline(transaction=False)
        for h in chain:
            pipe.hgetall(store.block_key(h))
        started = time.perf_counter()
        await pipe.execute()
        baseline.append(time.perf_counter() - started)
    await client.aclose()

    def ms(samples: list[float], q: int) -> float:
        return round(statistics.quantiles(samples, n=100)[q - 1] * 1000, 2)

    return {
        "queries": queries,
        "mean_matched_blocks_per_engine": round(matched / queries / engines, 1),
        "p50_ms": ms(ours, 50),
        "p99_ms": ms(ours, 99),
        "hgetall_512_p50_ms": ms(baseline, 50),
        "hgetall_512_p99_ms": ms(baseline, 99),
        "p50_ratio_to_hgetall": round(ms(ours, 50) / ms(baseline, 50), 2),
    }


async def run(server: RedisServer, args: argparse.Namespace) -> None:
    client = Redis.from_url(server.url)
    # The baseline is the better of a run before and one after (the conservative ratio).
    before = hincrby_rate(server.port, args.hincrby_requests)
    rate = await apply_rate(server.url, args.ranks)
    hincrby = max(before, hincrby_rate(server.port, args.hincrby_requests))
    print("apply", {**rate, "ratio_to_hincrby_p64": round(rate["block_ops_per_s"] / hincrby, 3)})
    print("hincrby", {"redis_benchmark_P64_rps": round(hincrby)})
    await client.flushall()

    prompts, held = workload(args.engines, args.entries)
    store = RedisStore(RedisConfig(server.url, prefix="bench", sweep_interval=None))
    before = (await client.info("memory"))["used_memory"]
    bulk = await load(store, prompts, held)
    grown = (await client.info("memory"))["used_memory"] - before
    resident = 0
    for rank in await store.ranks():
        counts = await store.block_counts(rank)
        resident += counts["GPU"] + counts["CPU"]
    bulk["ratio_to_hincrby_p64"] = round(bulk["block_ops_per_s"] / hincrby, 3)
    print("bulk_load", bulk)
    print("memory", {"entries": resident, "bytes_per_entry": round(grown / resident, 1)})
    latency = await match_latency(store, server.url, prompts, args.engines, args.queries)
    print("prefix_match", latency)
    await store.close()
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=16, help="ranks replaying traces at once")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--hincrby-requests", type=int, default=2_000_000)
    args = parser.parse_args()
    if not shutil.which("redis-benchmark"):
        parser.error("redis-benchmark not found on PATH")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-")), free_port()).start()
    try:
        asyncio.run(run(server, args))
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
