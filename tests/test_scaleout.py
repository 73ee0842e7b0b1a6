"""Scale-out: indexer workers sharing engines through Redis, and stateless API replicas.

First the pieces against real Redis (fencing tokens, claims, leases), then
the whole topology as real processes on loopback: a 3-master Redis Cluster,
``kvindex indexer`` workers, two ``kvindex api`` replicas and twelve
simulated engines publishing throughout. Workers are killed with SIGKILL
mid-stream, one after another, a worker joins, an engine restarts; in the
end both replicas answer every engine's ground truth, and the ownership
stream shows that no two workers ever owned a rank at once.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec
import pytest

from indexer.cluster.leases import Leases, live_workers
from indexer.cluster.redis_registry import RedisRegistry
from indexer.cluster.workers import Worker, WorkerSettings
from indexer.core.events import RankId
from indexer.engine_registry import EngineSpec, UnknownEngine
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.subscriber import RankPool
from indexer.ingest.trace import load_trace
from indexer.stores.base import Fenced, apply_events
from indexer.stores.redis import RedisConfig, RedisStore
from producer.publisher import Publisher
from producer.sim import SimConfig
from producer.simcli import Layout, engine_spec
from producer.workload import Workload

from .conftest import EXIT_WITHIN, WAIT_WITHIN, free_ports, trace_path
from .test_e2e import WORKLOAD, SimRank, answers, until
from .test_store_conformance import RANK, check_trace_state, redis_config, server_for

TRACE = "chat-clear"
ENGINE = EngineSpec(RANK.engine, "tcp://127.0.0.1:1")


async def registered(store: RedisStore, spec: EngineSpec = ENGINE) -> bytes:
    """Register ``spec`` in the store's registry; its entry, as a claim presents it."""
    registry = RedisRegistry(store.client)
    await registry.add(spec)
    return registry.entries()[spec.name][1]


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_a_new_owner_fences_the_old_one(request: pytest.FixtureRequest, kind: str) -> None:
    """A stale owner's next write is refused, in the one-call commit (standalone) and in
    the per-bucket scripts (cluster); the new owner carries on from the watermark."""
    config = redis_config(server_for(request, kind).url, cluster=kind == "cluster")
    batches = [(seq, decode_batch(p)) for seq, p in load_trace(trace_path(TRACE))]
    half = len(batches) // 2
    old_store, new_store = RedisStore(config), RedisStore(config)
    try:
        entry = await registered(old_store)
        old = await old_store.claim(RANK, entry)
        for seq, batch in batches[:half]:
            assert (await apply_events(old_store, RANK, seq, batch, fence=old)).applied
        new = await new_store.claim(RANK, entry)
        assert new > old
        seq, batch = batches[half]
        with pytest.raises(Fenced):
            await apply_events(old_store, RANK, seq, batch, fence=old)
        with pytest.raises(Fenced):
            await old_store.clear(RANK, ["GPU"], fence=old)
        assert (await new_store.watermark(RANK)).seq == batches[half - 1][0]
        for seq, batch in batches[half:]:
            assert (await apply_events(new_store, RANK, seq, batch, fence=new)).applied
        await check_trace_state(new_store, TRACE)
    finally:
        await old_store.close()
        await new_store.close()


async def test_claims_need_the_engine_registered_and_removal_fences_its_owner(
    redis_cluster,
) -> None:
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    try:
        registry = RedisRegistry(store.client)
        assert await store.claim(RANK, msgspec.json.encode(ENGINE)) is None  # not registered
        entry = await registered(store)
        assert await store.claim(RANK, entry.replace(b"tcp", b"ipc")) is None  # not that spec
        token = await store.claim(RANK, entry)
        (seq, payload), *_ = load_trace(trace_path(TRACE))
        assert (await apply_events(store, RANK, seq, decode_batch(payload), fence=token)).applied
        await registry.remove(RANK.engine)
        with pytest.raises(Fenced):
            await apply_events(store, RANK, seq + 1, decode_batch(payload), fence=token)
        assert await store.ranks() == []
        with pytest.raises(UnknownEngine):
            registry.get(RANK.engine)
    finally:
        await store.close()


@pytest.mark.slow
async def test_leases_are_exclusive_renewable_and_expire(redis_cluster) -> None:
    """Waits on conditions, not on sleeps: a lease renewed in time stays, whatever the
    machine's load, and one left alone expires after its time to live."""
    ttl = 3.0
    store = RedisStore(redis_config(redis_cluster.url, cluster=True))
    a, b = Leases(store.client, "a", ttl=ttl), Leases(store.client, "b", ttl=ttl)
    ranks = [RankId(f"e{i}", 0) for i in range(4)]
    try:
        assert await a.acquire(ranks[:2]) == ranks[:2]
        assert await b.acquire(ranks) == ranks[2:]
        assert await a.free(ranks) == []
        assert sorted(await live_workers(store.client)) == []
        assert await a.heartbeat() == ["a"]
        await a.release(ranks[0])
        assert await b.acquire(ranks[:1]) == ranks[:1]
        assert await a.renew() == ([ranks[1]], [])

        async def bs_expired() -> bool:  # a renews meanwhile, as its worker does
            assert (await a.renew())[1] == []
            return set(await a.free(ranks)) == {ranks[0], *ranks[2:]}

        await until(bs_expired, 20 * ttl, "b's leases to expire")
        renewed, lost = await b.renew()
        assert renewed == [] and set(lost) == {ranks[0], *ranks[2:]}

        async def no_heartbeat() -> bool:  # a's, sent once
            return await live_workers(store.client) == []

        await until(no_heartbeat, 20 * ttl, "a's heartbeat to expire")
    finally:
        await store.close()


@pytest.mark.slow
async def test_a_worker_stops_within_half_a_lease_when_redis_freezes(durable_redis) -> None:
    """SIGSTOP the Redis: the worker stops its rank by itself before its lease can
    expire (no one else could have it yet); after SIGCONT it claims it anew."""
    ttl = 1.0
    config = RedisConfig(durable_redis.url, prefix="freeze", socket_timeout=0.5, retries=0)
    store = RedisStore(config)
    pub, replay = free_ports(), free_ports()
    spec = EngineSpec("e", f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}")
    registry = RedisRegistry(store.client)
    pool = RankPool()
    worker = Worker(store, registry, pool, WorkerSettings(lease_ttl=ttl), "w")
    with Publisher(spec.endpoint, spec.replay_endpoint, bind=True):
        await registry.add(spec)
        await worker.start()
        try:
            await until(lambda: _consumes(pool, True), 10, "the rank to be claimed")
            assert await _claim_tokens(store) == ["1"]
            durable_redis.proc.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            await until(lambda: _consumes(pool, False), 5, "the rank to be stopped")
            assert time.monotonic() - frozen <= ttl / 2 + 0.2
            durable_redis.proc.send_signal(signal.SIGCONT)
            await until(lambda: _consumes(pool, True), 10, "the rank to be claimed again")
            assert await _claim_tokens(store) == ["1", "2"]
        finally:
            durable_redis.proc.send_signal(signal.SIGCONT)
            await worker.stop()
            await store.close()


async def _consumes(pool: RankPool, running: bool) -> bool:
    """Whether the worker's pool runs a consumer of engine e (read locally: Redis may be frozen)."""
    return any(engine == "e" for engine, _ in pool.statuses()) == running


async def _claim_tokens(store: RedisStore) -> list[str]:
    """The fencing tokens of the claims in the ownership stream, oldest first."""
    (entries,) = await store.client.execute([("XRANGE", store.layout.owners_key, "-", "+")])
    return [fields[b"token"].decode() for _, fields in entries if fields[b"event"] == b"claimed"]


# --- the topology as processes ---------------------------------------------------------

KVINDEX = (sys.executable, "-m", "kvindex.cli", "--log-level", "INFO")
ENGINES = 12
LEASE_TTL = 2.0
CONFIGS = [
    SimConfig(gpu_blocks=64, cpu_chunks=40),
    SimConfig(gpu_blocks=64, cpu_chunks=24, storage_chunks=64),
    SimConfig(gpu_blocks=64, cpu_chunks=40, self_describing=False),
]
RESTARTED = 5


class Process:
    """A ``kvindex`` child process writing its log to a file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen([*KVINDEX, *args], stderr=out, stdout=out)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=EXIT_WITHIN) == 0, self.log.read_text()[-3000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)


class Topology:
    """Workers and API replicas over one Redis index, and the engines they follow."""

    def __init__(self, tmp: Path, url: str, prefix: str) -> None:
        self.tmp, self.redis = (
            tmp,
            ("--redis-url", url, "--redis-cluster", "--redis-prefix", prefix),
        )
        self.store = RedisStore(RedisConfig(url, prefix=prefix, cluster=True, sweep_interval=None))
        self.workers: dict[str, Process] = {}
        self.apis: list[tuple[Process, httpx.AsyncClient]] = []
        layout = Layout(ENGINES, free_ports(2 * ENGINES))
        self.engines = [SimRank(layout, k, 0, CONFIGS[k % len(CONFIGS)]) for k in range(ENGINES)]
        self.ranks = {RankId(e.name, 0) for e in self.engines}

    def start_worker(self, name: str) -> None:
        args = ("indexer", *self.redis, "--worker-id", name, "--lease-ttl", str(LEASE_TTL))
        self.workers[name] = Process(self.tmp / f"{name}.log", *args)

    async def kill_worker(self, name: str) -> None:
        """SIGKILL, then mark the moment in the ownership stream (where it ends its ranks)."""
        self.workers.pop(name).kill()
        owners = self.store.layout.owners_key
        await self.store.client.execute([("XADD", owners, "*", "event", "killed", "worker", name)])

    def start_api(self) -> None:
        port = free_ports()
        process = Process(self.tmp / f"api-{port}.log", "api", *self.redis, "--port", str(port))
        self.apis.append((process, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")))

    async def owners(self) -> list[dict[str, str]]:
        owners = self.store.layout.owners_key
        (entries,) = await self.store.client.execute([("XRANGE", owners, "-", "+")])
        return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]

    async def owned_by(self) -> dict[RankId, str]:
        """Each rank's current owner, from the last event about it."""
        owner = {}
        for e in await self.owners():
            if "engine" in e:
                rank = RankId(e["engine"], int(e["dp_rank"]))
                owner[rank] = e["worker"] if e["event"] == "claimed" else None
        return owner

    async def settled(self, workers: set[str], share: int | None = None) -> None:
        """Until every rank is owned by one of ``workers`` (each owning ``share``, if given)."""

        async def done() -> bool:
            owner = await self.owned_by()
            counts = defaultdict(int)
            for rank in self.ranks:
                counts[owner.get(rank)] += 1
            return set(counts) <= workers and (share is None or set(counts.values()) == {share})

        await until(done, WAIT_WITHIN, f"ranks owned by {sorted(workers)}")

    async def caught_up(self) -> None:
        """Until every engine's last published batch is the rank's Redis watermark."""

        async def done() -> bool:
            marks = [await self.store.watermark(RankId(e.name, 0)) for e in self.engines]
            return all(
                m is not None and m.seq == e.publisher.next_seq - 1
                for m, e in zip(marks, self.engines, strict=True)
            )

        await until(done, WAIT_WITHIN, "every published batch to be applied")

    async def close(self) -> None:
        for process in [*self.workers.values(), *(p for p, _ in self.apis)]:
            if process.proc.poll() is None:
                process.kill()
        for _, client in self.apis:
            await client.aclose()
        for engine in self.engines:
            engine.publisher.close()
        await self.store.close()


async def publishing(engines: list[SimRank], stop: asyncio.Event, tick: float = 0.05) -> None:
    """Step every engine once per tick until ``stop``."""
    while not stop.is_set():
        for engine in engines:
            engine.step()
        await asyncio.sleep(tick)


async def ready(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False


def probes(engines: list[SimRank]) -> list[Sequence[int]]:
    served = [tokens for e in engines for tokens in list(e.engine.recently_served)[-3:]]
    return [*served, *[(*t, 1, 2, 3) for t in served[::4]], *Workload(WORKLOAD).system_prompts]


def assert_one_owner_at_a_time(events: list[dict[str, str]], ranks: set[RankId]) -> None:
    """Per rank, in Redis's order: tokens only increase, and a claim comes only after the
    previous owner ended (dropped the rank, or was killed)."""
    killed: set[str] = set()
    owner: dict[RankId, tuple[str, int] | None] = {}
    tokens: dict[RankId, int] = {}
    for e in events:
        if e["event"] == "killed":
            killed.add(e["worker"])
            continue
        rank, token = RankId(e["engine"], int(e["dp_rank"])), int(e["token"])
        if e["event"] == "claimed":
            previous = owner.get(rank)
            assert previous is None or previous[0] in killed, (rank, previous, e)
            assert token > tokens.get(rank, 0), (rank, tokens.get(rank), e)
            owner[rank], tokens[rank] = (e["worker"], token), token
        else:
            assert owner.get(rank) == (e["worker"], token), (rank, owner.get(rank), e)
            owner[rank] = None
    assert set(tokens) == ranks


@pytest.mark.slow
async def test_workers_hand_over_without_loss_and_replicas_agree(redis_cluster, tmp_path) -> None:
    top = Topology(tmp_path, redis_cluster.url, f"scale-{uuid.uuid4().hex[:8]}")
    stop = asyncio.Event()
    traffic = None
    try:
        for _ in range(2):
            top.start_api()
        for name in ("w1", "w2", "w3"):
            top.start_worker(name)
        for k, engine in enumerate(top.engines):  # half through each replica
            client = top.apis[k % 2][1]
            body = engine_spec(engine.layout, k, engine.config, "sim")
            await until(lambda c=client: ready(c), WAIT_WITHIN, "the API replica")
            response = await client.post("/engines", json=body)
            assert response.status_code == 201, response.text
        traffic = asyncio.create_task(publishing(top.engines, stop))
        await top.settled({"w1", "w2", "w3"}, share=ENGINES // 3)

        await asyncio.sleep(1.0)
        await top.kill_worker("w1")
        await top.settled({"w2", "w3"})
        await asyncio.sleep(0.5)
        await top.kill_worker("w2")
        await top.settled({"w3"})
        top.start_worker("w4")
        await top.settled({"w3", "w4"}, share=ENGINES // 2)
        top.engines[RESTARTED].restart()
        await asyncio.sleep(1.0)

        stop.set()
        await traffic
        for engine in top.engines:
            assert await asyncio.to_thread(engine.publisher.flush)
        await top.caught_up()
        assert_one_owner_at_a_time(await top.owners(), top.ranks)

        for tokens in probes(top.engines):
            truth = {(e.name, 0): e.truth(tokens) for e in top.engines}
            for _, client in top.apis:
                assert await answers(client, tokens) == truth, f"prompt of {len(tokens)} tokens"
        await until(lambda: replicas_show_owners(top), WAIT_WITHIN, "statuses of the new owners")
        for process in [*top.workers.values(), *(p for p, _ in top.apis)]:
            process.stop()
        assert await live_workers(top.store.client) == []  # they left, not just expired
    finally:
        stop.set()
        if traffic is not None:
            await asyncio.gather(traffic, return_exceptions=True)
        await top.close()


async def replicas_show_owners(top: Topology) -> bool:
    """Both replicas show every rank connected, not degraded, owned by a live worker."""
    for _, client in top.apis:
        for engine in top.engines:
            (rank,) = (await client.get(f"/engines/{engine.name}")).json()["ranks"]
            if not rank["connected"] or rank["degraded"] or rank["owner"] not in top.workers:
                return False
    return True


@pytest.mark.slow
def test_a_worker_needs_redis(tmp_path) -> None:
    result = subprocess.run([*KVINDEX, "indexer"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "--redis-url" in result.stderr
