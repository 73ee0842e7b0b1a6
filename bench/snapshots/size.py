"""Bench item 15, part 1 (:mod:`bench.snapshots`): what a snapshot saves over the
same blocks sent as ``BlockStored`` batches, on the wire, in the codec and in
each store's apply, so a reader can see whether restoring a rank beats replaying it."""

from __future__ import annotations

import asyncio
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import Figure, Report
from bench.snapshots.data import (
    BATCH,
    ENCODE,
    SECTION,
    batches_of,
    gpu_snapshot,
    hashes,
    median_times,
    timed,
)
from indexer.core.events import GPU, EventBatch, RankId
from indexer.core.snapshot import Snapshot, decode_snapshot, encode_snapshot
from indexer.engines.vllm.wire import decode_batch
from indexer.stores import MemoryStore, apply_events
from indexer.stores.base import Store, apply_snapshot
from tests.servers import RedisServer, free_port

RANK = RankId("snap", 0)
KINDS = ("int", "bytes")  # 64-bit ints (vLLM's default on the wire), 32-byte digests
#: The Redis client's socket timeout of the timed applies (kvindex's default is 5 s).
LONG_SOCKET_TIMEOUT = 300.0


def _codec(blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    snapshot = gpu_snapshot(blocks, len(batches))
    payload = encode_snapshot(snapshot)
    wire = [ENCODE(b) for b in batches]
    assert decode_snapshot(payload).blocks == len(blocks)
    times = median_times(
        repeats,
        {
            "snapshot_encode": lambda: timed(lambda: encode_snapshot(snapshot)),
            "batches_encode": lambda: timed(lambda: [ENCODE(b) for b in batches]),
            "snapshot_decode": lambda: timed(lambda: decode_snapshot(payload)),
            "batches_decode": lambda: timed(lambda: [decode_batch(p, tokens=False) for p in wire]),
        },
    )
    return {
        "snapshot_bytes": len(payload),
        "batches_bytes": sum(map(len, wire)),
        "seconds": times,
    }


async def _snapshot_into(store: Store, snapshot: Snapshot) -> float:
    started = time.perf_counter()
    result = await apply_snapshot(store, RANK, snapshot)
    took = time.perf_counter() - started
    assert result.applied, result
    return took


async def _batches_into(store: Store, batches: list[EventBatch]) -> float:
    started = time.perf_counter()
    for seq, batch in enumerate(batches):
        await apply_events(store, RANK, seq, batch)
    return time.perf_counter() - started


def _memory_apply(blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    snapshot = gpu_snapshot(blocks, len(batches))
    kept: dict[str, MemoryStore] = {}

    def run(name: str, apply: Callable[[MemoryStore], object]) -> float:
        kept.pop(name, None)  # the previous repeat's store is freed before timing
        gc.collect()
        kept[name] = store = MemoryStore()
        return asyncio.run(apply(store))

    times = median_times(
        repeats,
        {
            "snapshot": lambda: run("snapshot", lambda s: _snapshot_into(s, snapshot)),
            "batches": lambda: run("batches", lambda s: _batches_into(s, batches)),
        },
    )
    counts = {name: asyncio.run(s.block_counts(RANK)) for name, s in kept.items()}
    assert counts["snapshot"] == counts["batches"] and counts["snapshot"][GPU] == len(blocks)
    return {"seconds": times, "gpu_blocks": counts["snapshot"][GPU]}


async def _redis_apply(url: str, blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    from redis.asyncio import Redis

    from indexer.errors import StoreUnavailable
    from indexer.stores.redis import RedisConfig, RedisStore

    snapshot = gpu_snapshot(blocks, len(batches))
    client = Redis.from_url(url)
    times: dict[str, list[float]] = {"snapshot": [], "batches": []}
    counts: dict[str, dict] = {}
    try:
        # First as kvindex is configured by default: the whole snapshot is one apply,
        # its calls sent in round trips that must each answer within ``socket_timeout``.
        store = RedisStore(RedisConfig(url, prefix="snap-default", sweep_interval=None))
        try:
            default: dict = {"seconds": await _snapshot_into(store, snapshot)}
        except StoreUnavailable as e:
            default = {"failed": str(e)}
        finally:
            await store.close()
        # Then timed with a socket timeout no apply reaches, so both sides complete.
        for i in range(repeats):
            for name in times:
                await client.flushall()
                gc.collect()
                config = RedisConfig(url, prefix=f"snap-{i}", sweep_interval=None,
                                     socket_timeout=LONG_SOCKET_TIMEOUT)  # fmt: skip
                store = RedisStore(config)
                try:
                    if name == "snapshot":
                        times[name].append(await _snapshot_into(store, snapshot))
                    else:
                        times[name].append(await _batches_into(store, batches))
                    counts[name] = await store.block_counts(RANK)
                finally:
                    await store.close()
        await client.flushall()
    finally:
        await client.aclose()
    assert counts["snapshot"] == counts["batches"] and counts["snapshot"][GPU] == len(blocks)
    return {
        "seconds": {name: statistics.median(t) for name, t in times.items()},
        "default_config": default,
        "socket_timeout": LONG_SOCKET_TIMEOUT,
    }


def size_and_time(report: Report, n: int, quick: bool) -> dict:
    repeats = 3 if quick else 5
    redis_repeats = 1 if quick else 2
    workdir = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    redis = RedisServer(workdir, free_port()).start() if shutil.which("redis-server") else None
    out: dict[str, dict] = {}
    try:
        for kind in KINDS:
            blocks = hashes(n, kind)
            batches = batches_of(blocks)
            out[kind] = {
                "codec": _codec(blocks, batches, repeats),
                "memory": _memory_apply(blocks, batches, repeats),
            }
            if redis is not None:
                out[kind]["redis"] = asyncio.run(
                    _redis_apply(redis.url, blocks, batches, redis_repeats)
                )
            del blocks, batches
            gc.collect()
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    label = f"{n / 1e6:g}M"
    base = f"same blocks as BlockStored batches of {BATCH}"
    for kind, d in out.items():
        what = "64-bit int" if kind == "int" else "32-byte"
        codec, s = d["codec"], d["codec"]["seconds"]
        report.add(
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: encoded size",
                   codec["snapshot_bytes"] / 1e6, "MB", f"{base}, on the wire",
                   codec["batches_bytes"] / 1e6,
                   note=f"{codec['snapshot_bytes'] / n:.2f} B/block "
                   f"(batches: {codec['batches_bytes'] / n:.2f})"),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: encode",
                   1000 * s["snapshot_encode"], "ms", f"{base}: encode",
                   1000 * s["batches_encode"]),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: decode",
                   1000 * s["snapshot_decode"], "ms", f"{base}: typed decode (no token ids)",
                   1000 * s["batches_decode"]),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: apply_snapshot, "
                   "embedded store", 1000 * d["memory"]["seconds"]["snapshot"], "ms",
                   f"{base}: apply_events one by one", 1000 * d["memory"]["seconds"]["batches"]),
        )  # fmt: skip
        if "redis" in d:
            r, default = d["redis"]["seconds"], d["redis"]["default_config"]
            verdict = (
                f"FAILED with the default socket_timeout (5 s): {default['failed']}"
                if "failed" in default
                else f"with the default socket_timeout (5 s): {1000 * default['seconds']:.0f} ms"
            )
            report.add(
                Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: apply_snapshot, "
                       "Redis (standalone)", 1000 * r["snapshot"], "ms",
                       f"{base}: apply_events one by one", 1000 * r["batches"],
                       note=f"timed with socket_timeout {LONG_SOCKET_TIMEOUT:g} s; {verdict}"),
            )  # fmt: skip
            if "failed" in default:
                report.notes.append(
                    f"item 15: apply_snapshot of {n:,} {what}-hash blocks into Redis {verdict}"
                )
    if redis is None:
        report.notes.append("item 15: Redis apply skipped, redis-server not found")
    return out
