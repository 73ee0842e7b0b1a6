"""Exact from any moment, inside vLLM 0.33.0's own engine: snapshots of two
data-parallel ranks with CPU offloading, answered by kvindex's plugin.

Each rank is an engine core built from vLLM's real scheduler side: its
``Scheduler`` with the ``KVCacheManager`` over a small GPU pool (it evicts) and
the ``OffloadingConnector``'s scheduler half, whose ``CPUOffloadingManager``
(LRU, a small CPU tier: it evicts too) stores finished chunks and whose
``OffloadingEventsTracker`` makes the offload events self-describing; the
scheduler publishes each step's events through vLLM's ``ZmqEventPublisher``
(rank r at port + r, a 10-batch replay buffer), which kvindex's plugin mirrors
without reuse reports (+1000) and answers snapshots beside (+2000). Only the
model is a stand-in: a scheduled prefill "runs" at once and samples one token,
and the offloading worker completes transfers when vLLM's does (a store in the
step after the one that scheduled it, a load in its own), reporting them
through vLLM's job bookkeeping.

Each engine core runs vLLM's busy loop on a thread of its own: requests arrive
on its input queue, are handled by ``EngineCoreProc._handle_client_request``
(with the plugin's wrapper, as ``register`` installs it), and the scheduler
steps. Both ranks live in this one process, each with its own snapshot service
(the plugin gives each publisher the engine core attached before it).

``kvindex serve`` over a real Redis starts only after each rank published more
than three replay buffers' worth; it must then answer exactly what vLLM holds,
per rank and tier (each block's count against the block pool's copies and the
CPU tier's chunks, and prefix-match against vLLM's own GPU and CPU hits),
from a snapshot taken while the engine keeps stepping, and again after Redis
loses everything and after Redis comes back from an older dump, each without
restarting the engine.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from producer.vllm_plugin import reports, snapshots
from producer.vllm_plugin.settings import PluginSettings
from tests.servers import REDIS_SERVER, RedisServer
from tests.servers import free_port as free_redis_port
from tests.vllm_tier.conftest import TOKEN
from tests.vllm_tier.snapshot_engine import BLOCK, BUFFER, LAYER, OFFSET, RANKS, Chats, engine_ports
from tests.vllm_tier.snapshot_kvindex import Kvindex, assert_exact, redis_cli
from tests.vllm_tier.snapshot_rank import Fleet, Rank


@pytest.fixture
def fleet(model_dir, monkeypatch) -> Iterator[Fleet]:
    """Two ranks with the plugin installed as ``register`` installs it, with the token."""
    monkeypatch.setattr(reports, "_SETTINGS", reports._SETTINGS)  # the next tests' again after
    reports.install(PluginSettings(announce_token=TOKEN, events_port_offset=OFFSET))
    handle = EngineCoreProc._handle_client_request
    if not getattr(handle, "_kvindex", False):
        monkeypatch.setattr(
            EngineCoreProc, "_handle_client_request", snapshots.handling_requests(handle)
        )
    base = engine_ports()
    ranks: list[Rank] = []
    try:
        for rank in range(RANKS):
            ranks.append(Rank(model_dir, base, rank))
        yield Fleet(ranks)
    finally:
        for rank in ranks:
            rank.close()


@pytest.fixture
def redis(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (no automatic saves: an RDB only on SAVE)."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server not installed: run make setup (scripts/ensure-redis.sh)")
    server = RedisServer(tmp_path / "redis", free_redis_port()).start()
    yield server
    server.stop()


@pytest.fixture
def kvindex_late(tmp_path) -> Iterator:
    """Starts ``kvindex serve`` when the test says (``redis``: its store)."""
    started: list[Kvindex] = []

    def start(redis: RedisServer | None = None) -> Kvindex:
        started.append(Kvindex(tmp_path, redis))
        return started[-1]

    yield start
    for made in started:
        made.close()


def test_a_late_kvindex_is_exact_from_snapshots_and_again_after_redis_loses_data(
    fleet, kvindex_late, redis
) -> None:
    fleet.serve(32)  # a chat workload: the GPU pool and the CPU tier both evict
    assert min(fleet.batches()) >= 3 * BUFFER, "batches 0.. are long gone from replay"
    for rank in fleet.ranks:
        assert rank.removed["GPU"] and rank.removed["CPU"], rank.removed
        assert rank.stand_in.loads, "some prompts were read back from the CPU tier"

    kvindex = kvindex_late(redis)
    with fleet.stepping():  # the snapshots are taken while the ranks keep stepping
        kvindex.register(fleet)
        status = kvindex.restored(1)
        time.sleep(0.3)  # and step on a while after them
    for rank in fleet.ranks:
        [(seq, thread, client_on)] = rank.taken
        assert thread == rank.thread.name, "taken on the engine core's own thread"
        assert client_on and seq < rank.last_seq, "the rank stepped on past its snapshot"
    assert all(r["gaps_unfilled"] >= 1 and r["snapshot_error"] is None for r in status), status
    status = assert_exact(kvindex, fleet, restores=1)
    anomalies = [r["anomalies"] for r in status]

    fleet.serve(6)  # applied on top of the snapshot, batch by batch
    for rank in fleet.ranks:  # and a second physical copy of a block, as it comes
        rank.serve_now(Chats.SYSTEM[1]), rank.serve_now(Chats.SYSTEM[1])
    status = assert_exact(kvindex, fleet, restores=1)
    assert all(rank.copies_checked for rank in fleet.ranks)
    assert [r["anomalies"] for r in status] == anomalies, "no removal of a block not held"

    # Redis loses everything: each rank restores from a new snapshot
    assert redis_cli(redis, "FLUSHALL") == "OK"
    with fleet.stepping():
        time.sleep(0.5)
    assert_exact(kvindex, fleet, restores=2)
    assert [len(rank.taken) for rank in fleet.ranks] == [2, 2]

    # Redis comes back from an older dump, more than a replay buffer behind
    assert redis_cli(redis, "SAVE") == "OK"
    before = fleet.batches()
    fleet.serve(8)
    assert min(b - a for a, b in zip(before, fleet.batches(), strict=True)) > BUFFER
    kvindex.caught_up(fleet, restores=2)  # applied them all: the dump is behind them
    redis.restart(signal.SIGKILL)
    assert int(redis_cli(redis, "DBSIZE")) > 0, "back from the dump, not empty"
    with fleet.stepping():
        time.sleep(0.5)
    assert_exact(kvindex, fleet, restores=3)
    assert [len(rank.taken) for rank in fleet.ranks] == [3, 3]


def test_an_idle_engine_is_woken_for_its_snapshot(fleet, kvindex_late) -> None:
    """Nothing is published while kvindex asks: the snapshot server wakes each
    engine core through its input queue, and the rank is exact with its last batch."""
    fleet.serve(32)
    for rank in fleet.ranks:
        system = Chats.SYSTEM[0]
        rank.serve_now(system)
        last = rank.serve_now(system)[-1]  # cached: vLLM computes its last block again
        assert rank.gpu_counts()[maybe_convert_block_hash(last)] >= 2
    kvindex = kvindex_late()  # embedded
    kvindex.register(fleet)
    kvindex.restored(1)
    for rank in fleet.ranks:
        [(seq, thread, client_on)] = rank.taken
        assert thread == rank.thread.name and not client_on
        assert seq == rank.last_seq, "taken between steps, with everything published"
    assert_exact(kvindex, fleet, restores=1)
    assert all(rank.copies_checked for rank in fleet.ranks)


def test_a_snapshot_asked_while_a_step_is_in_flight_is_exact(fleet, kvindex_late) -> None:
    """vLLM 0.34 handles new requests, aborts and wake-ups while the model runs
    (``_wait_for_output``), so the plugin's hook runs mid-step too: asked there, with
    the step's changes to the pool not yet published, the snapshot waits for the
    step's batch, and kvindex is exact from it while requests come and are aborted."""
    fleet.serve(16)
    for rank in fleet.ranks:
        rank.mid_step = True
        rank.hold.set()
    kvindex = kvindex_late()
    with fleet.stepping(aborts=True):
        kvindex.register(fleet)
        kvindex.restored(1)
    for rank in fleet.ranks:
        assert not rank.hold.is_set() and rank.hooked_mid_step, "the hook ran mid-step"
        [(seq, thread, _)] = rank.taken
        assert thread == rank.thread.name and seq == rank.held_after + 1, "after the step"
    anomalies = [r["anomalies"] for r in assert_exact(kvindex, fleet, restores=1)]
    before, deadline = fleet.batches(), time.monotonic() + 60
    with fleet.stepping(aborts=True):  # five batches more each, inputs handled mid-step
        while min(b - a for a, b in zip(before, fleet.batches(), strict=True)) < 5:
            assert time.monotonic() < deadline, "the ranks stopped publishing"
            time.sleep(0.01)
    status = assert_exact(kvindex, fleet, restores=1)
    assert [r["anomalies"] for r in status] == anomalies, "no removal of a block not held"


def test_copies_restored_from_a_snapshot_then_evicted_stay_exact(fleet, kvindex_late) -> None:
    """A block the pool holds more than once is restored with every copy (vLLM 0.34
    keeps the ids of a key's further copies apart from its table), so evicting the
    copies one by one leaves kvindex holding exactly what vLLM holds, and no removal
    is of a block kvindex does not hold."""
    fleet.serve(16)
    held: dict[int, int] = {}
    for rank in fleet.ranks:
        rank.serve_now(Chats.SYSTEM[1])
        held[rank.rank] = maybe_convert_block_hash(rank.serve_now(Chats.SYSTEM[1])[-1])
        assert rank.gpu_counts()[held[rank.rank]] >= 2, "a second physical copy"
    kvindex = kvindex_late()
    kvindex.register(fleet)
    kvindex.restored(1)
    anomalies = [r["anomalies"] for r in assert_exact(kvindex, fleet, restores=1)]
    assert all(rank.copies_checked for rank in fleet.ranks)
    rng = random.Random(5)

    def copies() -> list[int]:
        return [rank.gpu_counts().get(held[rank.rank], 0) for rank in fleet.ranks]

    left = copies()
    while any(left):  # new prompts evict the pool's blocks; check each time copies go
        for rank, n in zip(fleet.ranks, left, strict=True):
            if n:
                rank.serve_now([rng.randrange(1, 4000) for _ in range(BLOCK * 3)])
        if copies() != left:
            left = copies()
            status = assert_exact(kvindex, fleet, restores=1)
            assert [r["anomalies"] for r in status] == anomalies, "no removal of a block not held"


def test_a_connector_reset_drops_the_cpu_tier_in_kvindex_too(fleet, kvindex_late) -> None:
    """A prefix-cache reset with the connector's (as sleep asks) empties vLLM's CPU tier
    and publishes no event of it; kvindex's stream from the plugin says so, and
    kvindex holds exactly what vLLM holds after it."""
    fleet.serve(16)
    kvindex = kvindex_late()
    kvindex.register(fleet)
    kvindex.restored(1)
    anomalies = [r["anomalies"] for r in assert_exact(kvindex, fleet, restores=1)]
    for rank in fleet.ranks:  # settled: nothing steps while the engine core resets
        assert rank.cpu_counts()
        assert rank.core.reset_prefix_cache(reset_connector=True)
        assert not rank.cpu_counts(), "vLLM's CPU tier is empty"
    fleet.serve(8)  # the next batches, and new chunks stored
    status = assert_exact(kvindex, fleet, restores=1)
    assert [r["anomalies"] for r in status] == anomalies, "no removal of a block not held"


def test_a_failure_counting_a_batch_stops_the_snapshots_not_the_engine(monkeypatch) -> None:
    """The plugin counts each batch inside vLLM's publish, on the engine's thread: a bug
    there must cost the snapshots, never the engine's step."""
    reports.install(PluginSettings(announce_token=TOKEN, events_port_offset=OFFSET))
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**LAYER))]
    no_connector = SimpleNamespace(kv_transfer_config=None)
    service = snapshots.attach(SimpleNamespace(), no_connector, KVCacheConfig(11, [], groups))
    base = engine_ports()
    publisher = ZmqEventPublisher(0, f"tcp://*:{base}", f"tcp://*:{base + 2}", topic="kv")
    try:
        assert getattr(publisher, reports._SNAPSHOTS) is service

        def broken(seq: int, batch: object) -> None:
            raise RuntimeError("a bug in the counting")

        monkeypatch.setattr(service, "published", broken)
        publisher.publish(KVEventBatch(1.0, []))  # raises nothing into vLLM
        assert not hasattr(publisher, reports._SNAPSHOTS)
        publisher.publish(KVEventBatch(2.0, []))
        mirror = getattr(publisher, reports._MIRROR)
        assert mirror.flush() and mirror.last_offered_seq == 1  # the stream goes on
    finally:
        publisher.shutdown()
