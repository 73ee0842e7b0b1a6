"""Item 10: prefix match for a fleet of hybrid models, against the same fleet without.

The fleet's stream is turned into a hybrid model's: every store and removal
of the full-attention group is repeated for a second group, a sliding window
of 128 tokens (as gpt-oss runs its sliding layers), on every medium. Both
fleets are applied to their own embedded store and the same chains asked of
both in turn, every engine listed. The second group holds what the first
does, so answers are equal (checked) and the figure is what vLLM's hybrid
rule costs on top: each rank's walk of its sliding window and lower-tier
chunks. Goal: at most 1.3 times the full-attention fleet's query.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import msgspec

from bench import query
from bench.fleet import CHUNK_BLOCKS, Fleet
from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from indexer.model import RankId
from indexer.stores import MemoryStore
from indexer.wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

SECTION = "10"
WINDOW = 128
LENGTHS = (64, 512, 2048)


def hybrid_stream(stream: Sequence[tuple[RankId, int, bytes]]) -> Iterator[tuple]:
    """The stream, each group-0 event followed by its twin in the sliding-window group."""
    replace = msgspec.structs.replace
    for rank, seq, payload in stream:
        batch = decode_batch(payload)
        events: list = []
        for event in batch.events:
            events.append(event)
            if isinstance(event, BlockStored):
                events.append(
                    replace(
                        event,
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=WINDOW,
                    )
                )
            elif isinstance(event, BlockRemoved):
                events.append(replace(event, group_idx=1))
        yield rank, seq, encode_batch(EventBatch(batch.ts, events, batch.data_parallel_rank))


def run(report: Report, fleet: Fleet, store: MemoryStore, queries: int, rounds: int) -> dict:
    hybrid = MemoryStore()
    asyncio.run(query.load(hybrid, list(hybrid_stream(fleet.stream))))
    engines = {f"engine-{i:04d}": CHUNK_BLOCKS for i in range(fleet.config.engines)}
    candidates = {"full": query.ours(store, engines), "hybrid": query.ours(hybrid, engines)}
    details: dict = {"hybrid_ranks": len(hybrid._hybrids.states), "window_tokens": WINDOW}
    for blocks in LENGTHS:
        chains = fleet.chains(blocks, queries)
        for chain in chains:  # same residency per group: the hybrid rule changes nothing
            full, mixed = candidates["full"](chain), candidates["hybrid"](chain)
            if {r: m.gpu_blocks for r, m in full.items()} != {
                r: m.gpu_blocks for r, m in mixed.items()
            }:
                raise AssertionError("a hybrid fleet holding every window answered differently")
        samples = query.timed_calls(candidates, chains, rounds)
        figures = {name: latency_ms(s) for name, s in samples.items()}
        details[f"{blocks}_blocks"] = figures
        report.add(
            Figure(SECTION, f"query, hybrid fleet: {blocks}-block chain p50",
                   figures["hybrid"]["p50_ms"], "ms",
                   "same fleet, full attention only, p50", figures["full"]["p50_ms"],
                   Goal(1.3, at_least=False)),
        )  # fmt: skip
    return details
