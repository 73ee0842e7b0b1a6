"""Item 4: prefix match in the embedded store, in process, against Dynamo's RadixTree.

The fleet's whole stream is applied to a MemoryStore (on the compiled core),
to one on the pure-Python reference (each rank walked by the core's rule, what
runs without the build) and to a Dynamo RadixTree (see :mod:`bench.dynamo`); then chains
of each length are asked of all, in turn, with every engine listed. Figures are
p50/p99 of single calls. Dynamo answers GPU residency only (one tier per
worker); kvindex answers every tier of every engine, with lower tiers in whole
chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from bench import dynamo
from bench.fleet import CHUNK_BLOCKS, Fleet
from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from indexer.engines.vllm.wire import decode_batch
from indexer.stores import MemoryStore, apply_events
from indexer.stores.memory import compiled

SECTION = "4"
LENGTHS = (64, 512, 2048)
#: Issue 27: a p50 at most a fifth of Dynamo's `find_matches` at every length (issue 16: half).
DYNAMO_GOAL = Goal(0.2, at_least=False)


async def load(store: MemoryStore, stream: Sequence) -> None:
    for rank, seq, payload in stream:
        await apply_events(store, rank, seq, decode_batch(payload, tokens=False))


def entries(store: MemoryStore) -> int:
    """Resident (rank, medium, hash) entries."""

    async def count() -> int:
        total = 0
        for rank in await store.ranks():
            total += sum((await store.block_counts(rank)).values())
        return total

    return asyncio.run(count())


def timed_calls(
    candidates: dict[str, Callable[[list[int]], object]], chains: list[list[int]], rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, alternating candidates chain by chain."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for chain in chains:
            for name, call in candidates.items():
                started = time.perf_counter()
                call(chain)
                samples[name].append(time.perf_counter() - started)
    return samples


def ours(store: MemoryStore, engines: dict[str, int | None]) -> Callable[[list[int]], object]:
    """A synchronous prefix_match: the coroutine never suspends, so drive it by hand."""

    def call(chain: list[int]) -> object:
        coroutine = store.prefix_match(chain, engines)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        raise RuntimeError("prefix_match suspended")

    return call


def reference_store(stream: Sequence) -> MemoryStore:
    """A MemoryStore on the pure-Python reference (the core's rule), fed ``stream``."""
    store = MemoryStore(core=compiled.REFERENCE)
    asyncio.run(load(store, stream))
    return store


def run(report: Report, fleet: Fleet, store: MemoryStore, queries: int, rounds: int) -> dict:
    engines = {f"engine-{i:04d}": CHUNK_BLOCKS for i in range(fleet.config.engines)}
    candidates = {
        "kvindex": ours(store, engines),
        "reference": ours(reference_store(fleet.stream), engines),
    }
    details: dict = {"engines": fleet.config.engines, "resident_entries": entries(store)}
    if dynamo.available():
        tree = dynamo.Tree()
        tree.apply(dynamo.convert(fleet.stream))
        candidates["dynamo"] = tree.find
        details["dynamo_refused_events"] = tree.refused
    for blocks in LENGTHS:
        samples = timed_calls(candidates, fleet.chains(blocks, queries), rounds)
        figures = {name: latency_ms(s) for name, s in samples.items()}
        details[f"{blocks}_blocks"] = figures
        mine, before = figures["kvindex"], figures["reference"]
        report.add(
            Figure(SECTION, f"query, embedded: {blocks}-block chain p50, compiled core",
                   mine["p50_ms"], "ms", "same, pure-Python reference core", before["p50_ms"]),
        )  # fmt: skip
        if "dynamo" in figures:
            theirs = figures["dynamo"]
            report.add(
                Figure(SECTION, f"query, embedded: {blocks}-block chain p50", mine["p50_ms"],
                       "ms", "Dynamo find_matches (binding) p50", theirs["p50_ms"],
                       DYNAMO_GOAL),
                Figure(SECTION, f"query, embedded: {blocks}-block chain p99", mine["p99_ms"],
                       "ms", "Dynamo find_matches (binding) p99", theirs["p99_ms"]),
                Figure(SECTION, f"query, embedded: {blocks}-block chain p50, reference core",
                       before["p50_ms"], "ms", "Dynamo find_matches (binding) p50",
                       theirs["p50_ms"], note="the core's rule, rank by rank"),
            )  # fmt: skip
    return details
