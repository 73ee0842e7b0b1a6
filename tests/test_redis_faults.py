"""The Redis store under failure: crashes part-way through a batch, racing indexers,
``kill -9``, Redis restarts and outages, and the garbage all of that leaves.

Every scenario ends the same way: the fixture trace is re-delivered from the
start (seqs at or below the Redis watermark are skipped, as after a restart)
and the index must hold exactly vLLM's final state — nothing lost, nothing
counted twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from indexer.core.events import MEDIA, AllBlocksCleared, EventBatch, RankId
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.trace import apply_trace, load_trace
from indexer.stores import StoreUnavailable, apply_events
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.stores.redis import plan as redis_plan
from indexer.stores.redis.scripts import APPLY_OPS, COMPARE_AND_SET

from .conftest import trace_path
from .servers import RedisServer, free_port
from .test_store_conformance import (
    RANK,
    batch,
    check_trace_state,
    counts,
    redis_config,
    server_for,
    stored,
)

TRACE = "chat-clear"  # GPU + CPU offload and an AllBlocksCleared part-way
TRACE_FILE = trace_path(TRACE)


class Crash(Exception):
    """The indexer died: the commands before it reached Redis, the rest never did."""


def crashing(store: RedisStore, budget: int) -> RedisStore:
    """Let ``store`` send ``budget`` more Redis commands, then die mid-pipeline."""
    run = store._run

    async def limited(commands):
        nonlocal budget
        sent, budget = commands[: max(budget, 0)], budget - len(commands)
        if budget >= 0:
            return await run(commands)
        if sent:
            await run(sent)
        raise Crash

    store._run = limited
    return store


async def crash_before_commit(config: RedisConfig, seq: int, crashed: EventBatch) -> None:
    """Apply ``crashed`` with a store that dies after its block writes, before its commit."""
    store = crashing_before_commit(RedisStore(config))
    with pytest.raises(Crash):
        await apply_events(store, RANK, seq, crashed)
    await store.close()


def crashing_before_commit(store: RedisStore) -> RedisStore:
    """Let ``store`` reserve ids and write a batch's blocks, then die before its commit."""
    run, wrote = store._run, False

    async def until_commit(commands):
        nonlocal wrote
        if wrote and commands[0][:2] == ("EVALSHA", COMPARE_AND_SET.sha):
            raise Crash
        wrote = wrote or commands[0][1] == APPLY_OPS.sha
        return await run(commands)

    store._run = until_commit
    return store


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "ops_per_call", "most_commands"),
    [("redis", 16, 60), ("cluster", redis_plan.OPS_PER_CALL, 300)],
)
async def test_crashes_at_random_points_then_redelivery_apply_each_op_once(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    ops_per_call: int,
    most_commands: int,
) -> None:
    """Batches span many script calls: one per bucket on a cluster and, with few
    operations per call, several on one server (a call holding a whole batch
    applies it atomically there, which leaves no partial state to test)."""
    monkeypatch.setattr(redis_plan, "OPS_PER_CALL", ops_per_call)
    server, trace = server_for(request, kind), load_trace(TRACE_FILE)
    config = redis_config(server.url, cluster=kind == "cluster")
    rng, crashes = random.Random(11), 0
    while True:
        store = crashing(await identified(config), rng.randint(1, most_commands))
        try:
            await apply_trace(store, RANK, trace)
            break
        except Crash:
            crashes += 1
        finally:
            await store.close()
    assert crashes >= 10
    async with reopened(config) as store:
        await check_trace_state(store, TRACE)


async def test_cancelled_apply_tasks_then_redelivery(redis_server: RedisServer) -> None:
    """Cancel until it sticks: Python 3.11's ``asyncio.wait_for`` (used by redis-py to
    send) drops a cancel that lands as the send completes, and the task runs on."""
    trace, rng = load_trace(TRACE_FILE), random.Random(5)
    config, cancelled, restarts = redis_config(redis_server.url), 0, 0
    while True:
        async with reopened(config) as store:
            task = asyncio.create_task(apply_trace(store, RANK, trace))
            # A window of a few loop turns (the task advances one await a turn at most,
            # however loaded the machine and late its timers), so every attempt is cut
            # within a few batches and the trace needs many of them.
            for _ in range(rng.randrange(1, 16)):
                await asyncio.sleep(0)
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.001)
            if not task.cancelled():
                task.result()
                if cancelled >= 5:
                    break
                # Every cancel was dropped until the trace ran through (a loaded machine
                # can make each land as a send completes): start the rank over.
                restarts += 1
                assert restarts <= 50, f"{cancelled} cancels took in {restarts} runs"
                await store.clear(RANK, MEDIA, reset_seq=True)
                continue
            cancelled += 1
    async with reopened(config) as store:
        await check_trace_state(store, TRACE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_racing_indexers_apply_each_batch_once(
    request: pytest.FixtureRequest, kind: str
) -> None:
    server, trace = server_for(request, kind), load_trace(TRACE_FILE)
    config = redis_config(server.url, cluster=kind == "cluster")
    stores = [RedisStore(config) for _ in range(3)]
    rng = random.Random(2)

    async def indexer(store: RedisStore) -> int:
        applied = 0
        for seq, payload in trace:
            applied += (await apply_events(store, RANK, seq, decode_batch(payload))).applied
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        return applied

    try:
        applied = await asyncio.gather(*(indexer(s) for s in stores))
    finally:
        for store in stores:
            await store.close()
    assert sum(applied) >= len(trace)
    async with reopened(config) as store:
        await check_trace_state(store, TRACE)


WORKER = """
import asyncio, sys
from indexer.core.events import RankId
from indexer.stores import apply_events
from indexer.stores.redis import RedisConfig, RedisStore
from indexer.ingest.trace import load_trace
from indexer.engines.vllm.wire import decode_batch

async def main():
    store = RedisStore(RedisConfig(sys.argv[1], prefix=sys.argv[2], sweep_interval=None))
    rank = RankId(sys.argv[4], int(sys.argv[5]))
    for seq, payload in load_trace(sys.argv[3]):
        await apply_events(store, rank, seq, decode_batch(payload))
        print(seq, flush=True)
        if seq == int(sys.argv[6]):  # the test is in step here: it kills us in what follows
            sys.stdin.readline()

asyncio.run(main())
"""


@pytest.mark.slow
async def test_kill_9_of_an_indexer_process_then_redelivery(redis_server: RedisServer) -> None:
    """Each worker resumes from the Redis watermark; it is killed as it passes a target
    seq, somewhere in the batches it applies next. The worker waits at the target until
    the test reads it (its output is a pipe: on a busy machine the test would read old
    lines while the worker ran to the end), and the test's own reads wait out a Redis
    kept busy by the load."""
    trace = load_trace(TRACE_FILE)
    config = dataclasses.replace(redis_config(redis_server.url), socket_timeout=60.0)
    args = [redis_server.url, config.prefix, str(TRACE_FILE), RANK.engine, "0"]
    async with reopened(config) as store:
        for target in (30, 90, 150):
            worker = subprocess.Popen(
                [sys.executable, "-c", WORKER, *args, str(target)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            while int(worker.stdout.readline()) < target:
                pass
            worker.stdin.write("go\n")
            worker.stdin.flush()
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            worker.stdin.close()
            worker.stdout.close()
            mark = await store.watermark(RANK)
            assert target <= mark.seq < trace[-1][0], "not killed part-way"
        await apply_trace(store, RANK, trace)
        await check_trace_state(store, TRACE)


async def test_redis_restart_mid_stream_loses_and_doubles_nothing(
    durable_redis: RedisServer,
) -> None:
    """kill -9 of redis-server (AOF, fsync always) while batches are being applied."""
    trace = load_trace(TRACE_FILE)
    config = dataclasses.replace(
        redis_config(durable_redis.url), retries=0, socket_timeout=1.0, connect_timeout=0.5
    )
    outages, restart = 0, None
    async with reopened(config) as store:
        for i, (seq, payload) in enumerate(trace):
            if i == len(trace) // 3:
                restart = asyncio.create_task(
                    asyncio.to_thread(durable_redis.restart, signal.SIGKILL)
                )
            while True:
                try:
                    await apply_events(store, RANK, seq, decode_batch(payload))
                    break
                except StoreUnavailable:
                    outages += 1
                    await asyncio.sleep(0.02)
        await restart
        assert outages > 0, "the restart did not interrupt the stream"
        await check_trace_state(store, TRACE)


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_more_concurrent_batches_than_connections_wait_for_one(request, kind: str) -> None:
    """Ranks outnumbering the pool, on a server that has not loaded the scripts yet."""
    server = server_for(request, kind)
    client = Redis.from_url(server.url)
    await client.script_flush()  # every node of a cluster: the first writes all reload them
    await client.aclose()
    config = dataclasses.replace(
        redis_config(server.url, cluster=kind == "cluster"), max_connections=2
    )
    store = RedisStore(config)
    ranks = [RankId(f"e{i}", 0) for i in range(24)]
    try:
        results = await asyncio.gather(
            *(apply_events(store, rank, 0, batch(stored([i + 1]))) for i, rank in enumerate(ranks))
        )
        assert all(result.applied for result in results)
        assert [(await store.block_counts(rank))["GPU"] for rank in ranks] == [1] * len(ranks)
    finally:
        await store.close()


async def test_pooled_connections_redis_closed_are_replaced_on_first_use(
    durable_redis: RedisServer,
) -> None:
    """A restart closes every pooled connection: the next commands reconnect instead
    of failing with "Connection closed by server" (which /stats answered as a 503)."""
    config = redis_config(durable_redis.url)
    ranks = [RankId(f"e{i}", 0) for i in range(config.max_connections)]
    async with reopened(config) as store:
        assert (await apply_events(store, RANK, 0, batch(stored([1])))).applied
        await asyncio.gather(*(store.anomalies(rank) for rank in ranks))  # a pool of them
        await asyncio.to_thread(durable_redis.restart)
        replies = await asyncio.gather(*(store.anomalies(rank) for rank in [RANK, *ranks]))
        assert replies == [{"unknown_removals": 0}] * (len(ranks) + 1)
        assert await counts(store, 1) == {"GPU": 1}


async def test_unreachable_redis_raises_store_unavailable() -> None:
    port = free_port()
    for cluster in (False, True):
        config = RedisConfig(f"redis://127.0.0.1:{port}", cluster=cluster, retries=0)
        store = RedisStore(config)
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
            await store.ping()
        with pytest.raises(StoreUnavailable):
            await apply_events(store, RANK, 0, batch(stored([1])))
        with pytest.raises(StoreUnavailable):
            await store.prefix_match([1], {RANK.engine: None})
        await store.close()


async def test_a_hung_redis_times_out_then_recovers(durable_redis: RedisServer) -> None:
    config = dataclasses.replace(redis_config(durable_redis.url), retries=0, socket_timeout=0.3)
    async with reopened(config) as store:
        assert (await apply_events(store, RANK, 0, batch(stored([1])))).applied
        durable_redis.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="unavailable"):
                await apply_events(store, RANK, 1, batch(stored([2])))
            assert time.monotonic() - started < 3
        finally:
            durable_redis.proc.send_signal(signal.SIGCONT)
        # The timed-out batch may have run once Redis woke up: then it is not run again.
        await apply_events(store, RANK, 1, batch(stored([2])))
        assert (await apply_events(store, RANK, 2, batch(stored([2])))).applied
        assert (await store.watermark(RANK)).seq == 2
        assert await counts(store, 2) == {"GPU": 2}


# --- garbage ----------------------------------------------------------------------


async def test_sweep_removes_every_dead_field_and_nothing_else(redis_server: RedisServer) -> None:
    config = redis_config(redis_server.url)
    async with reopened(config) as store:
        await apply_trace(store, RANK, load_trace(TRACE_FILE))  # a cleared GPU generation
        gone = RankId("gone", 0)
        await apply_events(store, gone, 0, batch(stored(range(50)), stored([7], "CPU")))
        await store.forget(gone)
        assert await store.sweep() > 0
        await check_trace_state(store, TRACE)
        assert await store.sweep() == 0
        blocks = await store.block_counts(RANK)
        assert await resident_fields(redis_server.url, config.prefix) == sum(blocks.values())


async def test_sweep_between_a_crash_and_redelivery_keeps_reserved_ids(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_plan, "OPS_PER_CALL", 1)  # commit apart from the writes
    config = redis_config(redis_server.url)
    async with reopened(config) as store:
        await apply_events(store, RANK, 0, batch(stored([1, 2]), stored([3], "CPU")))
    cleared = batch(stored([4]), AllBlocksCleared(), stored([2, 5]), stored([6], "CPU"))
    await crash_before_commit(config, 1, cleared)
    async with reopened(config) as store:
        assert await counts(store, 6) == {"CPU": 1}  # the crash came after the block writes
        await store.sweep()
        assert (await apply_events(store, RANK, 1, cleared)).applied
        assert await store.block_counts(RANK) == {"GPU": 2, "CPU": 2, "STORAGE": 0}
        assert [r.count for r in await store.block_residency(2)] == [1]
        assert await store.anomalies(RANK) == {"unknown_removals": 0}


async def test_a_clear_between_a_crash_and_redelivery_counts_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crashed batch brought a new tier into the medium that is then cleared."""
    monkeypatch.setattr(redis_plan, "OPS_PER_CALL", 1)  # commit apart from the writes
    config = redis_config(redis_server.url)
    async with reopened(config) as store:
        await apply_events(store, RANK, 0, batch(stored([1]), stored([9], "CPU")))
    new_tier = batch(stored([2, 3], group=1), stored([4], "CPU"))
    await crash_before_commit(config, 1, new_tier)
    async with reopened(config) as store:
        assert await counts(store, 4) == {"CPU": 1}  # the crash came after the block writes
        await store.clear(RANK, ["GPU"])
        assert (await apply_events(store, RANK, 1, new_tier)).applied
        assert await counts(store, 2) == {"GPU": 1}
        assert await counts(store, 4) == {"CPU": 1}
        assert await store.block_counts(RANK) == {"GPU": 2, "CPU": 2, "STORAGE": 0}


# --- helpers ----------------------------------------------------------------------


async def identified(config: RedisConfig) -> RedisStore:
    """A fresh store that has looked up the store's identity (so that a crash budget
    is spent on applying batches, not on that first look)."""
    store = RedisStore(config)
    await store.check()
    return store


@contextlib.asynccontextmanager
async def reopened(config: RedisConfig) -> AsyncIterator[RedisStore]:
    """A fresh store (an indexer process that just started) for the block's duration."""
    store = RedisStore(config)
    try:
        yield store
    finally:
        await store.close()


async def resident_fields(url: str, prefix: str) -> int:
    """Block fields under a prefix: every one should be a live residency after a sweep."""
    client = Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:{{*}}:*")]
        return sum([await client.hlen(k) for k in keys])
    finally:
        await client.aclose()
