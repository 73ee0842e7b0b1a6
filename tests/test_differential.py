"""Differential tests: every store equals the pure reference after every batch.

The reference is :mod:`indexer.core` alone: per rank a
:class:`~indexer.core.residency.RankResidency` fed :func:`plan_batch`'s ops,
its own prefix walk (:meth:`RankResidency.match`, vLLM's hybrid rule
included) and the watermark rule (a seq at or below the last is dropped).
Random streams mix duplicates and holes, operator clears, engine restarts
(``reset_seq``), forgotten ranks, unknown removals, several ranks and
engines, several KV groups of every kind, and int and bytes hashes; after
each step the store's counts, anomalies, watermarks, ranks and prefix
answers must be the reference's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, EventBatch, RankId
from indexer.core.hybrid import HeldUnits
from indexer.stores import MemoryStore, Store, apply_events
from indexer.stores.memory.hybrids import HeldSlices
from indexer.stores.redis import RedisStore

from .conftest import redis_config
from .events import removed, stored
from .reference import EVENT, Reference, check_answers
from .servers import LocalCluster, RedisServer
from .test_store_conformance import DropsRemovals

RANKS = [RankId("a", 0), RankId("a", 1), RankId("b", 0)]
#: ("batch", rank, seq step (0: a duplicate, 2: a hole), events), a clear, a restart, a forget
_step = st.one_of(
    st.tuples(
        st.just("batch"),
        st.sampled_from(RANKS),
        st.sampled_from([1, 1, 1, 0, 2]),
        st.lists(EVENT, max_size=6),
    ),
    st.tuples(st.just("clear"), st.sampled_from(RANKS), st.sampled_from([[CPU], [GPU, CPU]])),
    st.tuples(st.just("restart"), st.sampled_from(RANKS)),
    st.tuples(st.just("forget"), st.sampled_from(RANKS)),
)
_streams = st.lists(_step, min_size=1, max_size=20)
_declared = st.sampled_from([None, 2, 3])


async def check_equal(
    store: Store, ref: Reference, engines: dict[str, int | None], at: int
) -> None:
    await check_answers(store, ref, RANKS, engines, at)
    for rank in RANKS:
        assert await store.watermark(rank) == ref.marks.get(rank), (at, rank)
    assert await store.ranks() == sorted(ref.states.keys() | ref.marks.keys()), at


async def run_stream(make: Callable[[], Store], steps: list[tuple], declared: int | None) -> None:
    store, ref = make(), Reference()
    engines = {"a": declared, "b": None}
    seqs = dict.fromkeys(RANKS, -1)
    ts = 0.0
    try:
        for at, (what, rank, *args) in enumerate(steps):
            if what == "batch":
                step, events = args
                seqs[rank] = max(0, seqs[rank] + step)
                ts += 1.0
                batch = EventBatch(ts, events, 0)
                applied = (await apply_events(store, rank, seqs[rank], batch)).applied
                assert applied == ref.apply(rank, seqs[rank], batch), at
            elif what == "clear":
                await store.clear(rank, args[0])
                ref.clear(rank, args[0], reset_seq=False)
            elif what == "restart":  # the engine numbers its batches from 0 again
                await store.clear(rank, [GPU, CPU], reset_seq=True)
                ref.clear(rank, [GPU, CPU], reset_seq=True)
                seqs[rank] = -1
            else:
                await store.forget(rank)
                ref.forget(rank)
                seqs[rank] = -1
            await check_equal(store, ref, engines, at)
    finally:
        await store.close()


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(_streams, _declared)
def test_the_memory_store_equals_the_reference_after_every_batch(steps, declared) -> None:
    asyncio.run(run_stream(MemoryStore, steps, declared))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(_streams, _declared)
def test_the_redis_store_equals_the_reference_after_every_batch(
    redis_server: RedisServer, steps, declared
) -> None:
    make = lambda: RedisStore(redis_config(redis_server.url))  # noqa: E731
    asyncio.run(run_stream(make, steps, declared))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(_streams, _declared)
def test_the_redis_cluster_store_equals_the_reference_after_every_batch(
    redis_cluster: LocalCluster, steps, declared
) -> None:
    make = lambda: RedisStore(redis_config(redis_cluster.url, cluster=True))  # noqa: E731
    asyncio.run(run_stream(make, steps, declared))


def test_a_store_that_drops_removals_differs_from_the_reference() -> None:
    steps = [("batch", RANKS[0], 1, [stored([1, 2])]), ("batch", RANKS[0], 1, [removed([1])])]
    with pytest.raises(AssertionError):
        asyncio.run(run_stream(DropsRemovals, steps, None))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.booleans(), min_size=12, max_size=12), max_size=3),
    st.integers(1, 5),
    st.integers(0, 12),
    st.integers(0, 12),
)
def test_the_memory_stores_slice_lookups_equal_the_plain_ones(held, need, start, cap) -> None:
    """The embedded store's fast lookups for hybrid walks answer as the reference's
    (on the units a walk asks about: from ``start`` to a cap at or past it)."""
    assume(start <= cap)
    keys = list(range(12))
    tables = [{k for k, on in zip(keys, row, strict=True) if on} for row in held]
    plain, fast = HeldUnits(tables, keys), HeldSlices(tables, keys)
    assert fast.leading_end(start, cap) == plain.leading_end(start, cap)
    assert fast.window_end(need, start, cap) == plain.window_end(need, start, cap)
    assert list(fast.flags(start, cap)) == list(map(int, plain.flags(start, cap)))
