"""A Redis that loses data while kvindex runs: never a silent wrong answer.

Real redis-server processes restarted under a running consumer (real ZMQ,
kvindex's vLLM-wire publisher with its replay buffer): restarted from an older
RDB snapshot (the store is behind what was applied: the lost batches are
applied again from replay, ending exact), restarted empty (every rank is
rebuilt from replay, exact when the buffer reaches seq 0, degraded with a
reason otherwise), and the engine registry of scale-out mode re-seeded by the
processes that knew it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import AsyncIterator

import msgspec
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from indexer.cluster.rebuilds import Rebuilds
from indexer.cluster.redis_registry import RedisRegistry
from indexer.cluster.scripts import REGISTER
from indexer.cluster.workers import Worker, WorkerSettings
from indexer.core.events import GPU, BlockStored
from indexer.engine_registry import EngineSpec
from indexer.ingest.subscriber import RankPool
from indexer.ingest.trace import apply_trace, load_trace
from indexer.stores import Fenced, StoreUnavailable, apply_events
from indexer.stores.redis import RedisConfig, RedisStore
from producer.publisher import Publisher

from .apikit import LiveApi
from .conftest import assert_matches_trace, free_ports, trace_batches, trace_path, wait_until
from .servers import RedisServer
from .test_e2e import until
from .test_store_conformance import RANK, check_trace_state, redis_config

pytestmark = pytest.mark.slow  # every test restarts or flushes real Redis servers

TRACE = "chat-clear"  # GPU + CPU offload and an AllBlocksCleared part-way


class Rank:
    """``RANK``'s engine publishing on fresh ports, consumed into Redis by ``kvindex serve``'s
    pipeline (subscriber and API)."""

    def __init__(self, url: str, buffer_steps: int = 10_000) -> None:
        self.store = RedisStore(redis_config(url))
        self.live = LiveApi(store=self.store)
        pub, replay = free_ports(), free_ports()
        self.spec = EngineSpec(
            RANK.engine, f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}"
        )
        self.publisher = Publisher(
            self.spec.endpoint, self.spec.replay_endpoint, bind=True, buffer_steps=buffer_steps
        )
        self.live.publishers.append(self.publisher)

    async def publish(self, batches) -> None:
        for batch in batches:
            assert self.publisher.publish(batch)
        assert await asyncio.to_thread(self.publisher.flush)
        await self.live.wait_applied(RANK.engine, [self.publisher.next_seq - 1])

    def status(self):
        return self.live.subscriber.rank_status(RANK.engine)[0]


@pytest.fixture
async def rank_over(request) -> AsyncIterator:
    made: list[Rank] = []

    async def make(url: str, **options) -> Rank:
        rank = Rank(url, **options)
        await rank.live.__aenter__()
        await rank.live.registry.add(rank.spec)
        made.append(rank)
        return rank

    yield make
    for rank in made:
        await rank.live.__aexit__()
        await rank.store.close()


def store_loss_gauge() -> float | None:
    labels = {"engine": RANK.engine, "dp_rank": "0"}
    return REGISTRY.get_sample_value("kvindex_ingest_store_loss", labels)


async def test_restart_from_an_older_snapshot_reapplies_the_lost_batches(
    volatile_redis: RedisServer, rank_over
) -> None:
    """SAVE at half the trace, restart from it after 90%: the consumer had applied 40%
    more than the store holds, which replay brings back; the end is vLLM's state."""
    batches = trace_batches(TRACE)
    half, most = len(batches) // 2, len(batches) * 9 // 10
    rank = await rank_over(volatile_redis.url)
    await rank.publish(batches[:half])
    await rank.store.client.execute([("SAVE",)])
    await rank.publish(batches[half:most])
    await asyncio.to_thread(volatile_redis.restart, signal.SIGKILL)  # back to the snapshot
    await wait_until(lambda: rank.store.last_loss() is not None, what="the loss to be noticed")
    assert not rank.store.last_loss().wiped
    await rank.publish(batches[most:])
    await wait_until(lambda: rank.status().store_loss is None, what="the rank to be rebuilt")
    await check_trace_state(rank.store, TRACE)  # counts and every probe: no over-report
    status = rank.status()
    assert not status.degraded and status.restarts == 0 and status.gaps_unfilled == 0


async def test_restart_to_empty_rebuilds_from_seq_0(volatile_redis, rank_over) -> None:
    batches = trace_batches(TRACE)
    rank = await rank_over(volatile_redis.url)
    await rank.publish(batches)
    await asyncio.to_thread(volatile_redis.restart)  # no persistence: everything is gone
    await wait_until(lambda: rank.store.last_loss() is not None, what="the loss to be noticed")
    assert rank.store.last_loss().wiped
    await wait_until(lambda: rank.status().store_loss is None, what="the rank to be rebuilt")
    await rank.live.wait_applied(RANK.engine, [len(batches) - 1])
    await assert_matches_trace(rank.store, RANK, TRACE)
    assert not rank.status().degraded
    assert (await rank.live.client.get("/readyz")).status_code == 200
    assert store_loss_gauge() == 0.0


async def test_restart_to_empty_beyond_the_replay_buffer_stays_degraded_and_says_why(
    volatile_redis, rank_over
) -> None:
    """The engine kept only its last 20 batches: what the store lost cannot all come
    back. The rank under-reports, flagged, until the engine restarts."""
    batches = trace_batches(TRACE)
    rank = await rank_over(volatile_redis.url, buffer_steps=20)
    await rank.publish(batches)
    before = await rank.store.block_counts(RANK)
    await asyncio.to_thread(volatile_redis.restart)
    await wait_until(lambda: rank.status().degraded, what="the rank to be degraded")
    await wait_until(
        lambda: "could not apply" in (rank.status().store_loss or ""), what="rebuild to give up"
    )
    engine = (await rank.live.client.get(f"/engines/{RANK.engine}")).json()
    (state,) = engine["ranks"]
    assert state["degraded"] and "lost the store's identity" in state["store_loss"]
    assert state["store_loss"].endswith(f"(batches 0..{len(batches) - 21} missing)")
    ready = await rank.live.client.get("/readyz")
    assert ready.status_code == 503 and "store lost data" in ready.json()["error"]
    assert store_loss_gauge() == 1.0
    after = await rank.store.block_counts(RANK)
    assert all(after[m] <= before[m] for m in before), (before, after)  # under, never over
    held = await held_gpu_hash(rank.store, batches[-20:])  # re-applied, yet not trusted:
    answer = (await rank.live.client.get(f"/prefix-match?block_hashes={held}")).json()
    (match,) = answer["engines"]
    assert match["degraded"] and (match["gpu_blocks"], match["prefix_blocks"]) == (0, 0)

    rank.publisher.close()  # the engine restarts: its new stream is whole from seq 0
    rank.publisher = Publisher(rank.spec.endpoint, rank.spec.replay_endpoint, bind=True)
    rank.live.publishers.append(rank.publisher)
    later = batches[-1].ts + 1.0
    await rank.publish([msgspec.structs.replace(b, ts=later + b.ts) for b in batches])
    # Up to subscriber.reconnect_max (10 s) for the sockets to find the new publisher.
    restarted = "the restart to clear the flag"
    await wait_until(lambda: not rank.status().degraded, timeout=30, what=restarted)
    assert rank.status().restarts == 1
    assert rank.status().store_loss is None and store_loss_gauge() == 0.0
    assert (await rank.live.client.get("/readyz")).status_code == 200
    await assert_matches_trace(rank.store, RANK, TRACE)


class ScaledOut:
    """``RANK``'s engine, a ``kvindex indexer`` worker and an API replica's registry, in
    process, over one Redis."""

    def __init__(self, url: str, buffer_steps: int) -> None:
        config = redis_config(url)
        self.store, self.replica_store = RedisStore(config), RedisStore(config)
        pub, replay = free_ports(), free_ports()
        self.spec = EngineSpec(
            RANK.engine, f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}"
        )
        self.replica = RedisRegistry(self.replica_store.client)
        settings = WorkerSettings(lease_ttl=1.0)
        registry = RedisRegistry(self.store.client)
        self.worker = Worker(self.store, registry, RankPool(), settings, "w")
        self.publisher = Publisher(
            self.spec.endpoint, self.spec.replay_endpoint, bind=True, buffer_steps=buffer_steps
        )

    async def publish(self, batches) -> None:
        for batch in batches:
            assert self.publisher.publish(batch)
        assert await asyncio.to_thread(self.publisher.flush)
        last = self.publisher.next_seq - 1

        async def applied() -> bool:
            mark = await answered(self.store.watermark(RANK))
            return mark is not None and mark.seq == last

        await until(applied, 20, f"seq {last} to be applied")

    def status(self):
        """The rank's status, once this worker consumes it."""
        statuses = self.worker._pool.statuses()
        return next((s for e, s in statuses if (e, s.dp_rank) == RANK), None)


@pytest.fixture
async def scaled_out(volatile_redis) -> AsyncIterator:
    made: list[ScaledOut] = []

    async def make(buffer_steps: int = 10_000) -> ScaledOut:
        made.append(top := ScaledOut(volatile_redis.url, buffer_steps))
        await top.replica.add(top.spec)
        await top.worker.start()
        return top

    yield make
    for top in made:
        await top.worker.stop()
        top.publisher.close()
        await top.store.close()
        await top.replica_store.close()


async def test_a_lost_registry_is_registered_again_and_workers_resume(
    volatile_redis, scaled_out
) -> None:
    """Scale-out: Redis restarts empty under a worker and an API replica. The registry
    comes back from what they knew, the worker claims its rank again and rebuilds it
    from replay: ingestion resumes by itself and ends in vLLM's state."""
    top = await scaled_out()
    batches = trace_batches(TRACE)
    half = len(batches) // 2

    async def replica_lists_it() -> bool:
        await answered(top.replica.refresh())
        return top.replica.all() == [top.spec]

    await top.publish(batches[:half])
    await asyncio.to_thread(volatile_redis.restart)
    await until(replica_lists_it, 15, "the registry to be registered again")
    await top.publish(batches[half:])
    await assert_matches_trace(top.store, RANK, TRACE)
    await wait_until(lambda: top.status() is not None and top.status().store_loss is None)
    assert not top.status().degraded


async def test_a_worker_flags_the_ranks_it_cannot_rebuild(volatile_redis, scaled_out) -> None:
    """The engine's buffer no longer reaches seq 0: the rank claimed anew after the loss
    is degraded, saying why, in the status API replicas read."""
    top = await scaled_out(buffer_steps=20)
    batches = trace_batches(TRACE)
    await top.publish(batches)
    await asyncio.to_thread(volatile_redis.restart)

    def flagged() -> bool:
        status = top.status()
        return status is not None and "could not apply" in (status.store_loss or "")

    await wait_until(flagged, timeout=20, what="the rank to be flagged")
    # found by the identity check, or first by a write (the processes race to it)
    found_by = ("lost the store's identity", "a write found the store behind")
    assert top.status().degraded
    assert any(why in top.status().store_loss for why in found_by), top.status().store_loss


async def test_a_rebuild_outlives_its_consumer(scaled_out) -> None:
    """A worker stops while it rebuilds a rank after a loss (its lease lost on a loaded
    machine): the next owner resumes from the store's older watermark, and the rank
    stays degraded, saying why, until it has applied again what the first had to."""
    top, batches = await scaled_out(), trace_batches(TRACE)
    half, rebuilds = len(batches) // 2, Rebuilds(top.store.client)
    await top.publish(batches[:half])
    await top.worker.stop()
    target = half + 5  # the stopped consumer's: it had reached further than the store
    await rebuilds.keep({RANK: (target, "the store lost data")})
    registry = RedisRegistry(top.store.client)
    top.worker = Worker(top.store, registry, RankPool(), WorkerSettings(lease_ttl=1.0), "w2")
    await top.worker.start()
    await wait_until(lambda: top.status() is not None, what="the next owner to claim the rank")
    assert top.status().degraded and "the store lost data" in top.status().store_loss
    await top.publish(batches[half:target])
    assert top.status().degraded  # seq target-1 applied: one batch short
    await top.publish(batches[target:])
    await wait_until(lambda: not top.status().degraded, what="the rebuild to end")
    assert top.status().store_loss is None

    async def forgotten() -> bool:  # at the next status publication
        return await answered(rebuilds.pending(RANK)) is None

    await until(forgotten, 10, "the ended rebuild to be deleted")


async def held_gpu_hash(store: RedisStore, batches) -> int:
    """A hash the batches store on GPU that the store holds for ``RANK`` now."""
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == GPU:
                for h in event.block_hashes:
                    if any(r.medium == GPU for r in await store.block_residency(h)):
                        return h
    pytest.fail("no GPU block of these batches is held")


async def answered(call):
    """The call's answer, or None while Redis is restarting."""
    try:
        return await call
    except StoreUnavailable:
        return None


def unwatched(url: str) -> RedisConfig:
    """A config whose store never checks for losses by itself: only what it reads or
    writes can notice one."""
    return dataclasses.replace(redis_config(url), identity_check=None)


async def test_a_prefix_match_of_a_wiped_store_records_the_loss_before_it_answers(
    redis_server: RedisServer,
) -> None:
    """Its statuses then flag the ranks (tests/test_redis_outage.py): an answer read from
    the empty store never goes out as if nothing happened."""
    async with opened(unwatched(redis_server.url)) as store:
        heard = []
        store.on_loss(heard.append)
        (first, *_) = trace_batches(TRACE)
        assert (await apply_events(store, RANK, 0, first)).applied
        await store.client.execute([("FLUSHALL",)])
        assert heard == []
        chain = next(e.block_hashes for e in first.events if isinstance(e, BlockStored))
        assert await store.prefix_match(chain, {RANK.engine: None}) == {}
        assert [loss.wiped for loss in heard] == [True]


async def test_a_health_check_notices_a_roll_back(volatile_redis: RedisServer) -> None:
    async with opened(unwatched(volatile_redis.url)) as store:
        batches = trace_batches(TRACE)
        await apply_events(store, RANK, 0, batches[0])
        await store.client.execute([("SAVE",)])
        await apply_events(store, RANK, 1, batches[1])
        await asyncio.to_thread(volatile_redis.restart, signal.SIGKILL)  # back to the snapshot
        await store.ping()
        assert store.last_loss() is not None and not store.last_loss().wiped


async def test_a_store_that_lost_nothing_says_so(store) -> None:
    """Every store (memory, Redis, cluster): no loss on record, no listener called."""
    heard = []
    store.on_loss(heard.append)
    assert (await apply_events(store, RANK, 0, trace_batches(TRACE)[0])).applied
    assert store.last_loss() is None and heard == []


async def test_a_claim_made_before_a_loss_is_void(volatile_redis: RedisServer) -> None:
    """Fence tokens can go with the data (the next claims then start below them again):
    a write under a token claimed before a loss the store noticed is refused; a claim
    made after it writes, even when it got the same number."""
    async with opened(redis_config(volatile_redis.url)) as store:
        register = store.client.script(REGISTER, [store.layout.registry_key], [RANK.engine, b"e"])
        await store.client.execute([register])
        token = await store.claim(RANK, b"e")
        batches = trace_batches(TRACE)
        assert (await apply_events(store, RANK, 0, batches[0], fence=token)).applied
        await store.client.execute([("FLUSHALL",)])
        await store.check()
        assert store.last_loss().wiped
        with pytest.raises(Fenced, match="lost data since token"):
            await apply_events(store, RANK, 0, batches[0], fence=token)
        await store.client.execute([register])
        again = await store.claim(RANK, b"e")
        assert again == token  # the tokens were lost with the data
        assert await store.watermark(RANK) is None  # where the new owner resumes from
        assert (await apply_events(store, RANK, 0, batches[0], fence=again)).applied


# --- a cluster master losing data on its own ---------------------------------------------


async def test_a_cluster_master_losing_the_metadata_is_a_fresh_store_with_no_stale_ids(
    redis_cluster,
) -> None:
    """The master holding P:meta loses the index's keys; the others keep their buckets,
    whose fields are named by ids the new metadata would allocate again unless told
    (and another stream, applied after, would then find them: its batches taken for
    applied, its counts added to the old ones)."""
    config = redis_config(redis_cluster.url, cluster=True)
    async with opened(config) as store:
        await apply_trace(store, RANK, load_trace(trace_path(TRACE)))
        await wipe_node_of(redis_cluster.url, config.prefix, store.layout.meta_key)
        await store.check()
        assert store.last_loss().wiped and "P:meta lost" in store.last_loss().reason
        assert await store.watermark(RANK) is None
        await apply_trace(store, RANK, load_trace(trace_path("chat-sha256")))  # from seq 0
        await check_trace_state(store, "chat-sha256")


async def test_a_cluster_bucket_coming_back_older_starts_every_rank_again(redis_cluster) -> None:
    """One bucket restored to what it held at half the trace (a failover to a replica
    that missed writes): counts across masters no longer agree, so ranks start again."""
    config = redis_config(redis_cluster.url, cluster=True)
    trace = load_trace(trace_path(TRACE))
    async with opened(config) as store:
        buckets = store.layout.bucket_keys
        bucket = next(k for k in buckets if key_slot(k.encode()) != meta_slot(store))
        await apply_trace(store, RANK, trace[: len(trace) // 2])
        (older,) = await store.client.execute([("DUMP", bucket)])
        await apply_trace(store, RANK, trace)
        await store.client.execute([("RESTORE", bucket, 0, older, "REPLACE")])
        await store.check()
        assert store.last_loss().wiped and "older buckets" in store.last_loss().reason
        assert await store.watermark(RANK) is None
        await apply_trace(store, RANK, trace)
        await check_trace_state(store, TRACE)


def meta_slot(store: RedisStore) -> int:
    return key_slot(store.layout.meta_key.encode())


@contextlib.asynccontextmanager
async def opened(config):
    store = RedisStore(config)
    try:
        yield store
    finally:
        await store.close()


async def wipe_node_of(url: str, prefix: str, key: str) -> None:
    """Delete every key of the index held by the master that serves ``key``."""
    cluster = RedisCluster.from_url(url)
    await cluster.initialize()
    node = cluster.get_node_from_key(key)
    master = Redis(host=node.host, port=node.port)
    try:
        keys = [k async for k in master.scan_iter(match=f"*{prefix}*")]
        assert keys
        for key_ in keys:  # one by one: they are in many slots
            await master.delete(key_)
    finally:
        await master.aclose()
        await cluster.aclose()
