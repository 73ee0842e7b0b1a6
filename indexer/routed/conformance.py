"""One suite for every implementation of routed entries (``await run_check(factory,
name)`` per check): an implementation is done when it passes unchanged.

Deadlines run on each implementation's own clock (the process's, or the Redis
server's), so the timed checks sleep real time, a few tens of milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from indexer.core.events import CPU, BlockStored, EventBatch, RankId
from indexer.core.load import NEUTRAL, Placement
from indexer.core.matching import PrefixMatch, TierWeights
from indexer.core.routed import GPU_CLEARED, Candidate
from indexer.routed.base import RoutedEntries

A, B, C = RankId("e", 0), RankId("e", 1), RankId("f", 0)
CHAIN = [101, 102, 103, 104, 105, 106]
OTHER = [201, 202, 203, 204]
TTL, BOUND, WEIGHTS = 30.0, 1000, TierWeights()


def _stored(hashes: list, medium: str | None = None) -> EventBatch:
    return EventBatch(1.0, [BlockStored(hashes, medium=medium)])


def _candidate(rank: RankId, gpu_blocks: int = 0, where: Placement = NEUTRAL) -> Candidate:
    match = PrefixMatch(gpu_blocks, prefix_blocks=gpu_blocks)
    return Candidate(rank.engine, rank.dp_rank, match, BOUND, where)


async def _balanced(entries: RoutedEntries) -> dict[str, int]:
    """The counts, checked to add up: every entry recorded is live or ended once."""
    c = await entries.counts()
    ended = c["confirmed"] + c["expired"] + c["evicted"] + c["cleared"]
    assert c["live"] == c["recorded"] - ended, c
    return c


async def record_then_lookup(entries: RoutedEntries) -> None:
    assert await entries.record(A, CHAIN[:4], TTL, BOUND) == 4
    assert await entries.record(A, CHAIN[:2], TTL, BOUND) == 0  # routed again: not new
    assert await entries.lookup(CHAIN, {}, ["e"]) == {A: 4}
    assert await entries.lookup(CHAIN, {A: 3}, ["e", "f"]) == {A: 4}
    assert await entries.lookup(CHAIN, {A: 4}, ["e"]) == {}  # nothing beyond the exact run
    assert await entries.lookup(CHAIN, {}, ["f"]) == {}
    assert await entries.lookup(OTHER, {}, ["e"]) == {}
    assert (await _balanced(entries))["live"] == 4


async def routed_blocks_extend_the_exact_run(entries: RoutedEntries) -> None:
    await entries.record(B, CHAIN[2:5], TTL, BOUND)
    assert await entries.lookup(CHAIN, {}, ["e"]) == {}  # block 0 is neither exact nor routed
    assert await entries.lookup(CHAIN, {B: 2}, ["e"]) == {B: 5}
    assert await entries.lookup(CHAIN, {B: 1}, ["e"]) == {}


async def bytes_hashes(entries: RoutedEntries) -> None:
    chain = [bytes([i]) * 32 for i in range(3)]
    await entries.record(A, chain, TTL, BOUND)
    assert await entries.lookup(chain, {}, ["e"]) == {A: 3}
    await entries.confirm(A, chain[:1])
    assert await entries.lookup(chain, {A: 1}, ["e"]) == {A: 3}


async def entries_expire(entries: RoutedEntries) -> None:
    await entries.record(A, CHAIN[:3], 0.05, BOUND)
    await entries.record(B, CHAIN[:3], TTL, BOUND)
    await asyncio.sleep(0.12)
    assert await entries.lookup(CHAIN, {}, ["e"]) == {B: 3}
    c = await _balanced(entries)
    assert (c["expired"], c["live"]) == (3, 3)


async def events_confirm(entries: RoutedEntries) -> None:
    await entries.record(A, CHAIN[:4], TTL, BOUND)
    await entries.confirm(A, CHAIN[:2])
    assert await entries.lookup(CHAIN, {A: 2}, ["e"]) == {A: 4}
    entries.observe(A, _stored(CHAIN[2:3], CPU))  # a CPU copy confirms nothing
    entries.observe(A, _stored(CHAIN[2:4]))
    entries.observe(B, _stored(CHAIN[:4], "GPU"))  # another rank's blocks
    c = await _balanced(entries)
    assert (c["confirmed"], c["live"]) == (4, 0)
    assert await entries.lookup(CHAIN, {A: 2}, ["e"]) == {}


async def bound_evicts_what_ends_first(entries: RoutedEntries) -> None:
    assert await entries.record(A, CHAIN, TTL, 4) == 6
    assert await entries.lookup(CHAIN, {}, ["e"]) == {A: 4}  # the tail went, not the prefix
    await asyncio.sleep(0.01)
    await entries.record(A, OTHER, TTL, 4)
    assert await entries.lookup(CHAIN, {}, ["e"]) == {}
    assert await entries.lookup(OTHER, {}, ["e"]) == {A: 4}
    await asyncio.sleep(0.01)
    await entries.record(A, CHAIN[:1], TTL, 4)  # routed again: the newest, OTHER's tail goes
    assert await entries.lookup(OTHER, {}, ["e"]) == {A: 3}
    c = await _balanced(entries)
    assert (c["evicted"], c["live"]) == (7, 4)


async def clears_restarts_and_removals_end_entries(entries: RoutedEntries) -> None:
    for rank in (A, B, C):
        await entries.record(rank, CHAIN[:3], TTL, BOUND)
    entries.observe(A, GPU_CLEARED)  # a clear, or the ingest layer's restart
    assert await entries.lookup(CHAIN, {}, ["e", "f"]) == {B: 3, C: 3}
    await entries.clear(C)
    await entries.forget("e")
    assert await entries.lookup(CHAIN, {}, ["e", "f"]) == {}
    c = await _balanced(entries)
    assert (c["cleared"], c["live"]) == (9, 0)


async def route_prefers_held_then_least_loaded(entries: RoutedEntries) -> None:
    pick, runs, _ = await entries.route(CHAIN, [_candidate(A), _candidate(B)], WEIGHTS, TTL)
    assert pick is not None and (pick.engine, pick.dp_rank) == A  # a tie: the first
    assert runs == {}  # as weighed: nothing was routed yet
    pick, runs, _ = await entries.route(CHAIN, [_candidate(A), _candidate(B)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == A and runs == {A: 6}  # routed there already
    pick, runs, _ = await entries.route(OTHER, [_candidate(A), _candidate(B)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == B  # a tie again: B holds fewer entries
    # An exact GPU run outscores routed entries: B records only the blocks beyond it.
    pick, runs, _ = await entries.route(CHAIN, [_candidate(A), _candidate(B, 5)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == B and runs == {A: 6}
    assert await entries.lookup(CHAIN, {B: 5}, ["e"]) == {A: 6, B: 6}
    assert await entries.lookup(CHAIN, {B: 4}, ["e"]) == {A: 6}
    assert (await _balanced(entries))["live"] == 6 + 4 + 1


async def concurrent_routes_agree(entries: RoutedEntries) -> None:
    candidates = [_candidate(B), _candidate(A)]
    routes = await asyncio.gather(
        *(entries.route(CHAIN, candidates, WEIGHTS, TTL) for _ in range(8))
    )
    assert {(pick.engine, pick.dp_rank) for pick, _, _ in routes} == {B}


async def route_weighs_load_against_the_prefix(entries: RoutedEntries) -> None:
    """The lowest cost wins (indexer.core.load.cost): A holds the whole chain, B none."""
    busy = Placement(load_cost=len(CHAIN) + 0.5)  # the queue is worth more than the prefill
    pick, _, _ = await entries.route(CHAIN, [_candidate(A, 6, busy), _candidate(B)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == B  # a second copy of the prefix pays
    queued = Placement(load_cost=len(CHAIN) - 0.5)
    pick, _, _ = await entries.route(CHAIN, [_candidate(A, 6, queued), _candidate(C)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == A  # (not B: the first pick routed CHAIN there)
    # A cost tie goes to the better score; a fuller cache makes a miss cost more.
    even = Placement(load_cost=len(CHAIN))
    pick, _, _ = await entries.route(CHAIN, [_candidate(C), _candidate(A, 6, even)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == A
    full = Placement(miss_factor=1.5)
    pick, _, _ = await entries.route(OTHER, [_candidate(C, 0, full), _candidate(B)], WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == B


async def route_weighs_other_routed_entries_as_queued_work(entries: RoutedEntries) -> None:
    """A rank's live entries are blocks routed there and not yet stored: prefill queued
    ahead of the prompt, at ``per_block`` each, but for those of the prompt's own chain."""
    per_block = Placement(per_block=1.0)
    await entries.record(A, OTHER, TTL, BOUND)  # 4 blocks of another prompt wait on A
    await entries.record(B, CHAIN[:2], TTL, BOUND)  # 2 of this one's own on B
    candidates = [_candidate(A, 3, per_block), _candidate(B, 0, per_block)]
    # A: 3 uncached + 4 queued = 7; B: 6 - 2 * 0.8 uncached + 0 queued = 4.4
    pick, runs, queues = await entries.route(CHAIN, candidates, WEIGHTS, TTL)
    assert (pick.engine, pick.dp_rank) == B
    assert (runs, queues) == ({B: 2}, {A: 4})
    await entries.confirm(A, OTHER[:3])  # A's engine stored 3 of them: 1 left
    pick, _, queues = await entries.route(OTHER[:1] + CHAIN[1:], [*candidates[:1], _candidate(C)],
                                          WEIGHTS, TTL)  # fmt: skip
    assert (pick.engine, pick.dp_rank) == A and queues == {A: 1}  # 3 uncached + 1 < 6


async def route_with_no_candidates(entries: RoutedEntries) -> None:
    assert await entries.route(CHAIN, [], WEIGHTS, TTL) == (None, {}, {})


CHECKS: dict[str, Callable[[RoutedEntries], Awaitable[None]]] = {
    f.__name__: f
    for f in (
        record_then_lookup,
        routed_blocks_extend_the_exact_run,
        bytes_hashes,
        entries_expire,
        events_confirm,
        bound_evicts_what_ends_first,
        clears_restarts_and_removals_end_entries,
        route_prefers_held_then_least_loaded,
        concurrent_routes_agree,
        route_weighs_load_against_the_prefix,
        route_weighs_other_routed_entries_as_queued_work,
        route_with_no_candidates,
    )
}


async def run_check(factory: Callable[[], RoutedEntries], name: str) -> None:
    """Run one check against a fresh implementation from ``factory``."""
    entries = factory()
    try:
        await CHECKS[name](entries)
    finally:
        await entries.close()
