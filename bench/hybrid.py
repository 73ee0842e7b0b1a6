"""Item 10: prefix match for a fleet of hybrid models, against the same fleet without.

The fleet's stream is turned into a hybrid model's: every store and removal
of the full-attention group is repeated for a second group, a sliding window
of 128 tokens (as gpt-oss runs its sliding layers), on every medium. Both
fleets are applied to their own embedded store and the same chains asked of
both in turn, every engine listed. The second group holds what the first
does, so answers are equal (checked) and the figure is what vLLM's hybrid
rule costs on top: checking that the windows hold what the answers end
with. Goal: at most 1.3 times the full-attention fleet's query. A second
figure, without goal, keeps in the window group only the tail of each GPU
store (blocks that left the window evicted at once): many answers change
and their ranks are walked one by one, as vLLM's own scan does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import msgspec

from bench import query
from bench.fleet import CHUNK_BLOCKS, Fleet
from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockRemoved, BlockStored, EventBatch, RankId
from indexer.engines.vllm.wire import decode_batch, encode_batch
from indexer.stores import MemoryStore

SECTION = "10"
WINDOW = 128
TAIL = 12  # blocks a store leaves in the window group, in the variant that evicts early
LENGTHS = (64, 512, 2048)


def hybrid_stream(
    stream: Sequence[tuple[RankId, int, bytes]], tail: int | None = None
) -> Iterator[tuple]:
    """The stream, each group-0 event followed by its twin in the sliding-window group.

    ``tail``: the window group keeps only the last ``tail`` blocks of each GPU
    store (as if the blocks that left the window were evicted at once), and
    its GPU removals are of those only.
    """
    replace = msgspec.structs.replace
    held: dict[RankId, set] = {}
    for rank, seq, payload in stream:
        batch = decode_batch(payload)
        window = held.setdefault(rank, set())
        events: list = []
        for event in batch.events:
            events.append(event)
            gpu = event.medium in (None, "GPU")
            if isinstance(event, BlockStored):
                hashes = event.block_hashes[-tail:] if tail and gpu else event.block_hashes
                if gpu:
                    window.update(hashes)
                spec = {
                    "kv_cache_spec_kind": "sliding_window",
                    "kv_cache_spec_sliding_window": WINDOW,
                }
                events.append(replace(event, group_idx=1, block_hashes=hashes, **spec))
            elif isinstance(event, BlockRemoved):
                hashes = (
                    [h for h in event.block_hashes if h in window] if gpu else event.block_hashes
                )
                window.difference_update(hashes)
                if hashes:
                    events.append(replace(event, group_idx=1, block_hashes=hashes))
            elif tail:
                window.clear()
        yield rank, seq, encode_batch(EventBatch(batch.ts, events, batch.data_parallel_rank))


def _fleet(stream: Sequence, tail: int | None = None) -> MemoryStore:
    store = MemoryStore()
    asyncio.run(query.load(store, list(hybrid_stream(stream, tail))))
    return store


def run(report: Report, fleet: Fleet, store: MemoryStore, queries: int, rounds: int) -> dict:
    engines = {f"engine-{i:04d}": CHUNK_BLOCKS for i in range(fleet.config.engines)}
    hybrid, early = _fleet(fleet.stream), _fleet(fleet.stream, TAIL)
    candidates = {
        "full": query.ours(store, engines),
        "hybrid": query.ours(hybrid, engines),
        "early": query.ours(early, engines),
    }
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
        base = figures["full"]["p50_ms"]
        report.add(
            Figure(SECTION, f"query, hybrid fleet: {blocks}-block chain p50",
                   figures["hybrid"]["p50_ms"], "ms",
                   "same fleet, full attention only, p50", base, Goal(1.3, at_least=False)),
            Figure(SECTION, f"query, hybrid fleet, windows evicted early: {blocks}-block p50",
                   figures["early"]["p50_ms"], "ms",
                   "same fleet, full attention only, p50", base,
                   note=f"window group keeps the last {TAIL} blocks of each store"),
        )  # fmt: skip
    return details
