"""One suite, every store: memory, a standalone redis-server, a 3-master Redis Cluster.

Every residency rule is a check of :mod:`indexer.stores.conformance`, run here
once per backend (one test id per check and backend); a backend is done when
these pass unchanged. vLLM's fixture traces must also end in vLLM's own state
and answers. Redis-only tests are in ``test_redis_store.py``; random streams
against the reference in ``test_differential.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager

import msgspec
import pytest

from indexer.core.events import CPU, GPU, STORAGE, BlockRemoved, EventBatch, RankId
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.trace import answer_probes, apply_trace, load_expected, load_trace
from indexer.stores import ApplyResult, MemoryStore, Store, Watermark, conformance
from indexer.stores.conformance import RANK, batch, counts
from indexer.stores.redis import RedisStore

from .conftest import (
    HYBRID_TRACE_NAMES,
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


@CHECKS
async def test_redis_store(redis_server: RedisServer, check: str) -> None:
    await conformance.run_check(lambda: RedisStore(redis_config(redis_server.url)), check)


@CHECKS
async def test_redis_cluster_store(redis_cluster: LocalCluster, check: str) -> None:
    await conformance.run_check(lambda: RedisStore(redis_config(redis_cluster.url, True)), check)


# --- the suite has teeth ----------------------------------------------------------


class DropsRemovals(MemoryStore):
    """A store that never lets go of a block."""

    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult:
        kept = [e for e in batch.events if not isinstance(e, BlockRemoved)]
        return await super().apply_batch(rank, seq, msgspec.structs.replace(batch, events=kept))


class KeepsWatermarks(MemoryStore):
    """A store that ignores an engine restart: its new seq 0.. would be dropped."""

    async def clear(self, rank: RankId, media: Collection[str], *, reset_seq: bool = False) -> None:
        await super().clear(rank, media)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (DropsRemovals, "watermark_admits_each_seq_once_and_allows_holes"),
        (KeepsWatermarks, "reset_seq_takes_a_restarted_engines_stream_from_zero"),
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
    assert await store.block_counts(RANK) == {GPU: len(gpu), CPU: len(cpu), STORAGE: 0}
    for h in {*gpu, *cpu}:
        want = {m: table[h] for m, table in ((GPU, gpu), (CPU, cpu)) if h in table}
        assert await counts(store, int(h)) == want, h
    probes = load_expected(expected_path(name))
    answers = await answer_probes(store, RANK, probes.engine, probes.probes)
    assert answers == probe_answers(expected)
    assert await store.anomalies(RANK) == {"unknown_removals": 0}
    for group, table in expected["expected"].get("gpu_refcounts_by_group", {}).items():
        for h, n in table.items():
            rows = await store.block_residency(int(h))
            assert [r.count for r in rows if r.group_idx == int(group)] == [n], (group, h)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRACE_NAMES + HYBRID_TRACE_NAMES)
async def test_trace_ends_in_vllms_state_and_answers(store: Store, name: str) -> None:
    trace = load_trace(trace_path(name))
    stats = await apply_trace(store, RANK, trace)
    assert stats.batches == len(trace) and stats.block_ops > 0
    await check_trace_state(store, name)
    assert await store.watermark(RANK) == Watermark(trace[-1][0], decode_batch(trace[-1][1]).ts)


async def test_replaying_a_trace_twice_changes_nothing(store: Store) -> None:
    trace = load_trace(trace_path("chat-clear"))
    await apply_trace(store, RANK, trace)
    again = [await store.apply_batch(RANK, seq, decode_batch(p)) for seq, p in trace]
    assert not any(result.applied for result in again)
    await check_trace_state(store, "chat-clear")
