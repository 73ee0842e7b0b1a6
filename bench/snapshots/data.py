"""What bench item 15's parts share (:mod:`bench.snapshots`): the same blocks and
batches, built and timed one way, so that every figure and its baseline are
measured on the same data with the same clock."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable

import msgspec

from indexer.core.events import GPU, BlockStored, EventBatch
from indexer.core.snapshot import Snapshot, SnapshotTier

SECTION = "15"
BATCH = 512  # hashes per BlockStored batch of the baselines
ENCODE = msgspec.msgpack.Encoder().encode


def blocks_of(quick: bool) -> int:
    return 200_000 if quick else 1_000_000


def hashes(n: int, kind: str, seed: int = 25) -> list:
    r = random.Random(seed)
    if kind == "int":
        return [r.getrandbits(64) for _ in range(n)]
    return [r.randbytes(32) for _ in range(n)]


def batches_of(blocks: list) -> list[EventBatch]:
    return [
        EventBatch(float(i), [BlockStored(blocks[i : i + BATCH], block_size=16)], 0)
        for i in range(0, len(blocks), BATCH)
    ]


def gpu_snapshot(blocks: list, batches: int) -> Snapshot:
    """The blocks as one GPU tier, as of the last of ``batches`` batches."""
    return Snapshot(batches - 1, float(batches - 1), [SnapshotTier(GPU, None, 0, None, blocks)])


def median_times(repeats: int, candidates: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each candidate times itself (so freeing what it built is not counted);
    medians of ``repeats`` interleaved runs."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            gc.collect()
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
