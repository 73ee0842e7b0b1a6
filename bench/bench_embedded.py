"""Embedded store: replay rate on vLLM's largest fixture trace, and memory per entry.

Run: ``.venv/bin/python -m bench.bench_embedded [--entries 1000000]``

Replay rate is decode + apply of every batch of the largest trace into a
fresh MemoryStore, reported as block-ops/s and as a ratio to decoding the
same payloads with no apply (the floor), both measured here, best of N.
Memory per resident entry is the traced allocation growth of a MemoryStore
holding ``--entries`` resident (engine, GPU, hash) entries that arrived as
real encoded batches, spread over 64 engines.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
import tracemalloc
from pathlib import Path

from indexer.model import RankId
from indexer.replay import apply_trace, load_trace
from indexer.stores import MemoryStore
from indexer.wire import BlockStored, EventBatch, decode_batch, encode_batch

TRACES = Path(__file__).resolve().parents[1].parent / "shared/fixtures/vllm-0.33.0/traces"


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def replay_rate(runs: int) -> dict:
    path = max(TRACES.glob("*.frames.msgpack"), key=lambda p: p.stat().st_size)
    trace = load_trace(path)
    ops = asyncio.run(apply_trace(MemoryStore(), RankId("e", 0), trace)).block_ops
    floor = best_of(runs, lambda: [decode_batch(p) for _, p in trace])
    full = best_of(runs, lambda: asyncio.run(apply_trace(MemoryStore(), RankId("e", 0), trace)))
    return {
        "trace": path.name,
        "block_ops": ops,
        "block_ops_per_s": round(ops / full),
        "decode_only_block_ops_per_s": round(ops / floor),
        "ratio_to_decode_floor": round(floor / full, 3),
    }


def payloads(entries: int, engines: int, per_batch: int = 512) -> list[tuple[RankId, bytes]]:
    rng = random.Random(7)
    out = []
    for i in range(entries // per_batch):
        hashes = [rng.getrandbits(64) for _ in range(per_batch)]
        event = BlockStored(
            hashes,
            None,
            [1] * 16 * per_batch,
            16,
            medium="GPU",
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        out.append((RankId(f"engine-{i % engines}", 0), encode_batch(EventBatch(0.0, [event], 0))))
    return out


def memory_per_entry(entries: int, engines: int = 64) -> dict:
    batches = payloads(entries, engines)
    store = MemoryStore()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]

    async def fill() -> None:
        for seq, (rank, payload) in enumerate(batches):
            await store.apply_batch(rank, seq, decode_batch(payload))

    asyncio.run(fill())
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    resident = sum(
        asyncio.run(store.block_counts(rank))["GPU"] for rank in asyncio.run(store.ranks())
    )
    return {"entries": resident, "engines": engines, "bytes_per_entry": round(grown / resident, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("replay", replay_rate(args.runs))
    print("memory", memory_per_entry(args.entries))


if __name__ == "__main__":
    main()
