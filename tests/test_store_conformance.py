"""One suite, every store: memory, a standalone redis-server, a 3-master Redis Cluster.

Every residency and fencing rule is a check of :mod:`indexer.stores.conformance`, run here
once per backend (one test id per check and backend); a backend is done when
these pass unchanged. vLLM's fixture traces must also end in vLLM's own state
and answers. Redis-only tests are in ``test_redis_store.py``; random streams
against the reference in ``test_differential.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager

import pytest

from indexer.cluster.scripts import REGISTER
from indexer.core.events import CPU, GPU, STORAGE, RankId
from indexer.core.residency import Op, TierOp
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.trace import answer_probes, apply_trace, load_expected, load_trace
from indexer.stores import ApplyResult, MemoryStore, Store, Watermark, apply_events, conformance
from indexer.stores.conformance import OWNER, RANK, batch, counts
from indexer.stores.redis import RedisStore

from .conftest import (
    HYBRID_TRACE_NAMES,
    LOOKAHEAD_TRACE_NAMES,
    STORAGE_TRACE_NAMES,
    TRACE_NAMES,
    expected_path,
    load_expected_json,
    probe_answers,
    redis_config,
    server_for,
    trace_path,
)
from .events import stored
from .servers import LocalCluster, RedisServer

# re-exported for the Redis fault and scale-out tests
__all__ = ["RANK", "batch", "check_trace_state", "counts", "redis_config", "server_for", "stored"]

CHECKS = pytest.mark.parametrize("check", list(conformance.CHECKS))


@CHECKS
async def test_memory_store(check: str) -> None:
    await conformance.run_check(MemoryStore, check)


@asynccontextmanager
async def registered_redis(url: str, cluster: bool = False) -> AsyncIterator[RedisStore]:
    """A Redis store whose registry holds the suite's engine as its claims present it
    (the Redis store grants a claim only to an engine registered so)."""
    store = RedisStore(redis_config(url, cluster))
    try:
        register = store.client.script(REGISTER, [store.layout.registry_key], [RANK.engine, OWNER])
        await store.client.execute([register])
        yield store
    finally:
        await store.close()


@CHECKS
async def test_redis_store(redis_server: RedisServer, check: str) -> None:
    await conformance.run_check(lambda: registered_redis(redis_server.url), check)


@CHECKS
async def test_redis_cluster_store(redis_cluster: LocalCluster, check: str) -> None:
    await conformance.run_check(lambda: registered_redis(redis_cluster.url, True), check)


# --- the suite has teeth ----------------------------------------------------------


class DropsRemovals(MemoryStore):
    """A store that never lets go of a block."""

    async def apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], *, fence: int | None = None
    ) -> ApplyResult:
        kept = [op for op in ops if not (isinstance(op, TierOp) and op.delta < 0)]
        return await super().apply(rank, seq, ts, kept, fence=fence)


class KeepsWatermarks(MemoryStore):
    """A store that ignores an engine restart: its new seq 0.. would be dropped."""

    async def clear(
        self,
        rank: RankId,
        media: Collection[str],
        *,
        reset_seq: bool = False,
        fence: int | None = None,
    ) -> None:
        await super().clear(rank, media, fence=fence)


class IgnoresFences(MemoryStore):
    """A store that lets a stale owner write on after a newer claim."""

    async def apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], *, fence: int | None = None
    ) -> ApplyResult:
        return await super().apply(rank, seq, ts, ops)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (DropsRemovals, "watermark_admits_each_seq_once_and_allows_holes"),
        (KeepsWatermarks, "reset_seq_takes_a_restarted_engines_stream_from_zero"),
        (IgnoresFences, "a_newer_claim_fences_writes_under_older_tokens"),
    ],
)
async def test_the_suite_fails_a_broken_store_naming_the_check(
    broken: type[MemoryStore], check: str
) -> None:
    with pytest.raises(AssertionError, match=f"conformance check '{check}' failed: "):
        await conformance.run(broken)


async def test_run_takes_a_context_manager_factory_and_passes_a_sound_store() -> None:
    opened: list[MemoryStore] = []

    @asynccontextmanager
    async def fresh() -> AsyncIterator[MemoryStore]:
        opened.append(MemoryStore())
        yield opened[-1]

    await conformance.run(fresh)
    assert len(opened) == len(conformance.CHECKS)  # a fresh store per check


# --- vLLM's fixture traces ------------------------------------------------------


async def check_trace_state(store: Store, name: str) -> None:
    expected = load_expected_json(name)
    gpu, cpu = expected["expected"]["gpu_refcounts"], expected["expected"]["cpu_refcounts"]
    storage = expected["expected"].get("storage_refcounts", {})
    assert await store.block_counts(RANK) == {GPU: len(gpu), CPU: len(cpu), STORAGE: len(storage)}
    for h in {*gpu, *cpu, *storage}:
        want = {m: table[h] for m, table in ((GPU, gpu), (CPU, cpu)) if h in table}
        held = await counts(store, int(h))
        # on STORAGE, held or not: vLLM's file-system tier rewrites a chunk's one file
        # when it stores the chunk again (and publishes that store again)
        on_storage = held.pop(STORAGE, 0) > 0
        assert (held, on_storage) == (want, h in storage), h
    probes = load_expected(expected_path(name))
    answers = await answer_probes(store, RANK, probes.engine, probes.probes)
    assert answers == probe_answers(expected)
    assert await store.anomalies(RANK) == {"unknown_removals": 0}
    for group, table in expected["expected"].get("gpu_refcounts_by_group", {}).items():
        for h, n in table.items():
            rows = await store.block_residency(int(h))
            on_gpu = [r.count for r in rows if (r.medium, r.group_idx) == (GPU, int(group))]
            assert on_gpu == [n], (group, h)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", TRACE_NAMES + HYBRID_TRACE_NAMES + LOOKAHEAD_TRACE_NAMES + STORAGE_TRACE_NAMES
)
async def test_trace_ends_in_vllms_state_and_answers(store: Store, name: str) -> None:
    trace = load_trace(trace_path(name))
    stats = await apply_trace(store, RANK, trace)
    assert stats.batches == len(trace) and stats.block_ops > 0
    await check_trace_state(store, name)
    assert await store.watermark(RANK) == Watermark(trace[-1][0], decode_batch(trace[-1][1]).ts)


async def test_replaying_a_trace_twice_changes_nothing(store: Store) -> None:
    trace = load_trace(trace_path("chat-clear"))
    await apply_trace(store, RANK, trace)
    again = [await apply_events(store, RANK, seq, decode_batch(p)) for seq, p in trace]
    assert not any(result.applied for result in again)
    await check_trace_state(store, "chat-clear")
