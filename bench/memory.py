"""Item 7 (embedded store): bytes per resident entry, and how it grows.

An entry is one resident ``(rank, medium, hash)``. Each measurement runs in
a forked child (a clean heap to count in) that fills a fresh MemoryStore
under ``tracemalloc`` and reports the Python memory still allocated at the
end, divided by the entries resident then. Transient input (events being
decoded and applied) is freed by then and not counted.

Synthetic fills give the sizes the issue asks for: each engine holds half
its blocks on GPU and half on CPU; a third of them are system-prompt blocks
shared fleet-wide (Zipf-popular), the rest its own. The fleet's own state
(from the simulated engines) is measured too. The 1M-entry fill is measured on
the pure-Python reference core as well (dict counts per rank and no holder
index: what runs without the build); the compiled tables allocate through Python's allocator, so
``tracemalloc`` counts them like the dicts they replace.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import random
import tracemalloc
from collections.abc import Callable, Iterator

from bench.fleet import Fleet, rank_of
from bench.query import entries, load
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.stores import MemoryStore, apply_events
from indexer.stores.memory import compiled

SECTION = "7"
#: Issue 16's sizes, measured in quick runs too: the 10M fill takes seconds and ~0.6 GB in its
#: child. (The Redis store's quick run fills the first only.)
SIZES = (1_000_000, 10_000_000)
#: The issue's goal for the embedded store, bytes per resident entry.
GOAL_BYTES = 48
Batch = tuple[RankId, int, EventBatch]
#: Sixteen system prompts of 2048 distinct blocks each (one generator per prompt).
_SHARED_PROMPTS = [[r.getrandbits(64) for _ in range(2048)] for r in map(random.Random, range(16))]


def _in_child(fill: Callable[[MemoryStore], None], core: compiled.StoreCore, pipe) -> None:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = MemoryStore(core=core)
    fill(store)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    pipe.send((grown, entries(store)))


def measured(fill: Callable[[MemoryStore], None], core: compiled.StoreCore = compiled.CORE) -> dict:
    """Bytes per entry of a store on ``core`` filled by ``fill``, in a fresh forked child."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_in_child, args=(fill, core, theirs))
    child.start()
    grown, count = mine.recv()
    child.join()
    return {"entries": count, "bytes": grown, "bytes_per_entry": grown / max(1, count)}


def synthetic_batches(engines: int, blocks: int, seed: int = 1) -> Iterator[Batch]:
    """``engines`` ranks, each storing ``blocks`` entries (half GPU, half CPU) in one batch."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(len(_SHARED_PROMPTS))]
    for e in range(engines):
        half = blocks // 2
        (prompt,) = rng.choices(_SHARED_PROMPTS, weights)
        shared = prompt[: min(len(prompt), half // 3)]
        chain = shared + [rng.getrandbits(64) for _ in range(half - len(shared))]
        events = [BlockStored(chain, medium="GPU"), BlockStored(chain, medium="CPU")]
        yield rank_of(e), 0, EventBatch(0.0, events, 0)


def synthetic(engines: int, blocks: int, seed: int = 1) -> Callable[[MemoryStore], None]:
    """Fill: :func:`synthetic_batches` applied in turn."""

    async def go(store: MemoryStore) -> None:
        for batch in synthetic_batches(engines, blocks, seed):
            await apply_events(store, *batch)

    return lambda store: asyncio.run(go(store))


def fleet_fill(fleet: Fleet) -> Callable[[MemoryStore], None]:
    return lambda store: asyncio.run(load(store, fleet.stream))


def run(report: Report, fleet: Fleet) -> dict:
    details: dict = {"fleet": measured(fleet_fill(fleet))}
    for size in SIZES:
        details[f"synthetic_{size}"] = measured(synthetic(64, size // 64))
    before = details["synthetic_reference"] = measured(
        synthetic(64, SIZES[0] // 64), compiled.REFERENCE
    )
    details["by_engines"] = {e: measured(synthetic(e, 4096)) for e in (8, 32, 128, 512)}
    details["by_blocks"] = {b: measured(synthetic(64, b)) for b in (1024, 4096, 16384)}
    f = details["fleet"]
    report.add(
        Figure(SECTION, f"memory, embedded: fleet state ({f['entries']:,} entries)",
               f["bytes_per_entry"], "B/entry"),
    )  # fmt: skip
    for size in SIZES:
        m = details[f"synthetic_{size}"]
        report.add(
            Figure(SECTION, f"memory, embedded: {size / 1e6:g}M entries, 64 engines",
                   m["bytes_per_entry"], "B/entry", f"the goal, {GOAL_BYTES} B/entry",
                   GOAL_BYTES, Goal(1.0, at_least=False)),
        )  # fmt: skip
    m = details[f"synthetic_{SIZES[0]}"]
    report.add(
        Figure(SECTION, f"memory, embedded: {SIZES[0] / 1e6:g}M entries, compiled core",
               m["bytes_per_entry"], "B/entry", "same, pure-Python reference core",
               before["bytes_per_entry"]),
    )  # fmt: skip
    return details
