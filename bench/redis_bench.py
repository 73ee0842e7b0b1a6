"""Items 2, 5 and 7 (Redis): ingest, prefix match and memory of the Redis store.

A private ``redis-server`` (no persistence, a free port) serves one run; the
baselines come from the same server in the same run:

- ingest: the fleet's stream applied through one :class:`RedisStore` by every
  engine rank at once (decode, plan, exactly-once apply and commit), in
  block-ops/s, against ``redis-benchmark -P 64`` HINCRBY (the better of a run
  before and one after: the conservative ratio; goal >= 0.6). A second
  figure applies the fleet's final residency as a few large batches per rank
  (bulk loads, e.g. a restarted indexer catching up). A third applies the
  same stream to a local 3-master Redis Cluster (child processes, as the
  tests start it) and compares the Redis CPU it costs per block operation
  (``INFO cpu`` of every master, user + system) with the standalone
  server's over the same stream (goal: within 1.3x);
- query: ``prefix_match`` of chains of each length with every engine listed,
  against the same number of pipelined HGETALLs of the chain's block keys
  (goal: p50 within 2x);
- memory: growth of ``used_memory`` over the bulk load, per resident entry;
  and over bulk loads of the embedded store's synthetic fills (1M entries,
  and 10M in a full run; see :mod:`bench.memory`).
"""

from __future__ import annotations

import asyncio
import csv
import io
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from redis.asyncio import Redis

from bench.fleet import CHUNK_BLOCKS, Fleet
from bench.measure import latency_ms
from bench.memory import SIZES, synthetic_batches
from bench.query import LENGTHS, entries
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engines.vllm.wire import decode_batch
from indexer.stores import MemoryStore, apply_events
from indexer.stores.redis import RedisConfig, RedisStore
from tests.servers import LocalCluster, RedisServer, free_port

SECTION_INGEST, SECTION_QUERY, SECTION_MEMORY = "2", "5", "7"


def available() -> bool:
    return bool(shutil.which("redis-server") and shutil.which("redis-benchmark"))


def hincrby_rate(port: int, requests: int) -> float:
    """``redis-benchmark -P 64`` HINCRBY on random hashes of one field: requests/s."""
    command = ["redis-benchmark", "-p", str(port), "-P", "64", "-n", str(requests)]
    command += ["-r", "1000000", "--csv", "HINCRBY", "bench-hincrby:__rand_int__", "f", "1"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(list(csv.DictReader(io.StringIO(out)))[-1]["rps"])


#: Hashes per event and block operations per batch of a bulk load: one script call stays
#: well inside the client's socket timeout even with every rank's call queued at the server.
BULK_EVENT, BULK_BATCH = 4096, 16_384


async def redis_cpu(urls: list[str]) -> float:
    """CPU seconds (user + system) the servers at ``urls`` have used since they started."""
    total = 0.0
    for url in urls:
        client = Redis.from_url(url)
        try:
            info = await client.info("cpu")
        finally:
            await client.aclose()
        total += info["used_cpu_user"] + info["used_cpu_sys"]
    return total


async def measured_stream(store: RedisStore, stream: list, urls: list[str]) -> dict:
    """:func:`apply_stream`, with the Redis CPU it cost on the servers at ``urls``."""
    before = await redis_cpu(urls)
    ops, seconds = await apply_stream(store, stream)
    cpu = await redis_cpu(urls) - before
    return {
        "block_ops": ops,
        "block_ops_per_s": ops / seconds,
        "redis_cpu_us_per_op": cpu / ops * 1e6,
    }


async def cluster_stream(workdir: Path, stream: list) -> dict:
    """The stream applied to a fresh local 3-master cluster (:func:`measured_stream`)."""
    cluster = LocalCluster.start(workdir / "cluster")
    try:
        urls = [node.url for node in cluster.nodes]
        config = RedisConfig(cluster.url, prefix="bench-stream", sweep_interval=None, cluster=True)
        store = RedisStore(config)
        # redis-py's cluster client fails commands sent concurrently before its first one
        # has returned (it is still discovering the slots): one first, alone.
        await store.ranks()
        try:
            return await measured_stream(store, stream, urls)
        finally:
            await store.close()
    finally:
        cluster.stop()


async def apply_stream(store: RedisStore, stream: list) -> tuple[int, float]:
    """Every rank's batches in order, all ranks at once; (block ops, seconds)."""
    by_rank: dict[RankId, list] = {}
    for rank, seq, payload in stream:
        by_rank.setdefault(rank, []).append((seq, payload))
    return await _in_order(store, by_rank, lambda payload: decode_batch(payload, tokens=False))


async def bulk_load(store: RedisStore, batches: list) -> tuple[int, float]:
    """Each rank's stores, cut into bounded batches (seq 0, 1, ...), all ranks at once."""
    by_rank: dict[RankId, list] = {}
    for rank, _, batch in batches:
        events = [
            msgspec.structs.replace(e, block_hashes=e.block_hashes[i : i + BULK_EVENT])
            for e in batch.events
            for i in range(0, len(e.block_hashes), BULK_EVENT)
        ]
        per = BULK_BATCH // BULK_EVENT
        cut = by_rank.setdefault(rank, [])
        for i in range(0, len(events), per):
            cut.append((len(cut), EventBatch(batch.ts, events[i : i + per], 0)))
    return await _in_order(store, by_rank, lambda batch: batch)


async def _in_order(
    store: RedisStore, by_rank: dict[RankId, list], batch_of: Callable[[Any], EventBatch]
) -> tuple[int, float]:
    """Apply ``(seq, item)`` lists rank by rank in order, all ranks at once; (ops, seconds)."""

    async def one(rank: RankId, batches: list) -> int:
        ops = 0
        for seq, item in batches:
            ops += (await apply_events(store, rank, seq, batch_of(item))).block_ops
        return ops

    started = time.perf_counter()
    ops = sum(await asyncio.gather(*(one(r, b) for r, b in by_rank.items())))
    return ops, time.perf_counter() - started


async def residency_batches(reference: MemoryStore) -> list:
    """A store's final residency as one batch per rank: a placeholder store per tier."""
    stream = []
    for rank, state in reference._ranks.items():
        events = [
            BlockStored(list(table.counts), medium=tier.medium)
            for tier, table in state.tables.items()
        ]
        stream.append((rank, 0, EventBatch(time.time(), events, 0)))
    return stream


async def query(
    store: RedisStore, reference: MemoryStore, url: str, fleet: Fleet, queries: int
) -> dict:
    """Per chain length: the Redis store's prefix match, the pipelined HGETALLs of its
    blocks, and the embedded store holding the same residency, query by query."""
    listed = {f"engine-{i:04d}": CHUNK_BLOCKS for i in range(fleet.config.engines)}
    client = Redis.from_url(url)
    out = {}
    try:
        for blocks in LENGTHS:
            ours, baseline, embedded = [], [], []
            for chain in fleet.chains(blocks, queries):
                started = time.perf_counter()
                await store.prefix_match(chain, listed)
                ours.append(time.perf_counter() - started)
                started = time.perf_counter()
                await reference.prefix_match(chain, listed)
                embedded.append(time.perf_counter() - started)
                pipe = client.pipeline(transaction=False)
                for h in chain:
                    pipe.hgetall(store.layout.block_key(h))
                started = time.perf_counter()
                await pipe.execute()
                baseline.append(time.perf_counter() - started)
            out[blocks] = {
                "kvindex": latency_ms(ours),
                "hgetall": latency_ms(baseline),
                "embedded": latency_ms(embedded),
            }
    finally:
        await client.aclose()
    return out


async def _run(
    server: RedisServer, fleet: Fleet, reference: MemoryStore, resident: int, quick: bool
) -> dict:
    requests = 500_000 if quick else 2_000_000
    client = Redis.from_url(server.url)
    before = hincrby_rate(server.port, requests)
    store = RedisStore(RedisConfig(server.url, prefix="bench-stream", sweep_interval=None))
    stream = fleet.stream_of(16 if quick else fleet.config.engines)
    standalone = await measured_stream(store, stream, [server.url])
    await store.close()
    hincrby = max(before, hincrby_rate(server.port, requests))
    await client.flushall()
    cluster = await cluster_stream(server.workdir, stream)

    store = RedisStore(RedisConfig(server.url, prefix="bench", sweep_interval=None))
    memory_before = (await client.info("memory"))["used_memory"]
    bulk_ops, bulk_seconds = await bulk_load(store, await residency_batches(reference))
    grown = (await client.info("memory"))["used_memory"] - memory_before
    latency = await query(store, reference, server.url, fleet, 30 if quick else 100)
    await store.close()
    synthetic = {}
    for size in SIZES[:1] if quick else SIZES:
        await client.flushall()
        synthetic[size] = await synthetic_memory(server.url, client, size)
    await client.aclose()
    return {
        "synthetic_memory": synthetic,
        "hincrby_P64_per_s": hincrby,
        "stream": standalone,
        "cluster_stream": cluster,
        "bulk": {"block_ops": bulk_ops, "block_ops_per_s": bulk_ops / bulk_seconds},
        "memory": {"entries": resident, "bytes_per_entry": grown / resident},
        "query": latency,
    }


async def synthetic_memory(url: str, client: Redis, size: int) -> dict:
    """``used_memory`` growth over a bulk load of ``size`` synthetic entries (64 engines)."""
    batches = list(synthetic_batches(64, size // 64))
    count = sum(len(e.block_hashes) for _, _, batch in batches for e in batch.events)
    store = RedisStore(RedisConfig(url, prefix="bench-memory", sweep_interval=None))
    before = (await client.info("memory"))["used_memory"]
    await bulk_load(store, batches)
    grown = (await client.info("memory"))["used_memory"] - before
    await store.close()
    return {"entries": count, "bytes_per_entry": grown / count}


def run(report: Report, fleet: Fleet, reference: MemoryStore, quick: bool) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    server = RedisServer(workdir, free_port()).start()
    try:
        details = asyncio.run(_run(server, fleet, reference, entries(reference), quick))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    hincrby = details["hincrby_P64_per_s"]
    report.add(
        Figure(SECTION_INGEST, "ingest, Redis: fleet stream, block-ops/s (exactly-once)",
               details["stream"]["block_ops_per_s"], "ops/s", "redis-benchmark -P 64 HINCRBY",
               hincrby, Goal(0.6)),
        Figure(SECTION_INGEST, "ingest, Redis: bulk load (4096-hash events), block-ops/s",
               details["bulk"]["block_ops_per_s"], "ops/s", "redis-benchmark -P 64 HINCRBY",
               hincrby, Goal(0.5)),
        Figure(SECTION_INGEST, "ingest, Redis Cluster (3 masters): fleet stream, Redis CPU per "
               "block-op", details["cluster_stream"]["redis_cpu_us_per_op"], "us",
               "standalone Redis, same stream", details["stream"]["redis_cpu_us_per_op"],
               Goal(1.3, at_least=False)),
    )  # fmt: skip
    for blocks, q in details["query"].items():
        report.add(
            Figure(SECTION_QUERY, f"query, Redis: {blocks}-block chain p50", q["kvindex"]["p50_ms"],
                   "ms", f"{blocks} pipelined HGETALL p50", q["hgetall"]["p50_ms"],
                   Goal(2.0, at_least=False)),
            Figure(SECTION_QUERY, f"query, Redis: {blocks}-block chain p99", q["kvindex"]["p99_ms"],
                   "ms", f"{blocks} pipelined HGETALL p99", q["hgetall"]["p99_ms"]),
            Figure(SECTION_QUERY, f"query, Redis store vs embedded: {blocks}-block chain p50",
                   q["kvindex"]["p50_ms"], "ms", "the embedded store, same residency: p50",
                   q["embedded"]["p50_ms"]),
        )  # fmt: skip
    m = details["memory"]
    report.add(
        Figure(SECTION_MEMORY, f"memory, Redis: fleet state ({m['entries']:,} entries)",
               m["bytes_per_entry"], "B/entry"),
    )  # fmt: skip
    for size, m in details["synthetic_memory"].items():
        report.add(
            Figure(SECTION_MEMORY, f"memory, Redis: {size / 1e6:g}M entries, 64 engines",
                   m["bytes_per_entry"], "B/entry"),
        )  # fmt: skip
    return details
