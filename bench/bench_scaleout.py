"""Scale-out: aggregate ingest with 1, 2 and 3 ``kvindex indexer`` workers, and the
hand-over time after a worker dies — real processes over one Redis.

Run: ``.venv/bin/python -m bench.bench_scaleout [--engines 12] [--batches 500] [--cluster]``
(needs ``redis-server``; starts a private server, or a 3-master cluster with
``--cluster``, on free ports, without persistence; about a minute on 2 cores).
Prints one JSON object; ``--out FILE`` also writes it.

1. Ingest: ``--engines`` simulated engines each publish ``--batches`` batches of
   chat traffic into their replay buffers first. Then ``W`` workers (already
   running and seeing each other) are handed all engines at once and catch
   up through replay: block ops applied per second, from the first claim to
   the last rank's watermark at its engine's last seq, for W = 1, 2, 3 — and
   as a ratio to W = 1 measured in the same run.
2. Hand-over: two workers consume the engines while they publish live
   (``--rate`` batches/s each); one is killed with SIGKILL. Per orphaned
   rank: from its lease's expiry (the kill plus the lease's remaining time)
   to the new owner's claim (``detect``) and to the moment its watermark
   reaches what the engine had published when the claim came (``caught_up``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from redis.asyncio import Redis

from indexer.cluster.leases import Leases, live_workers
from indexer.cluster.redis_registry import RedisRegistry
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import EngineSpec
from indexer.engines.vllm.wire import encode_batch
from indexer.stores.redis import RedisConfig, RedisStore
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.workload import Workload, WorkloadConfig
from tests.servers import LocalCluster, RedisServer, free_port

LEASE_TTL = 2.0
KVINDEX = (sys.executable, "-m", "kvindex.cli", "indexer")
_TICKS = os.sysconf("SC_CLK_TCK")
WORKLOAD = WorkloadConfig(seed=7, max_context_tokens=1024, system_prompt_tokens=(128, 400))
SIM = SimConfig(gpu_blocks=256, cpu_chunks=128)


class Engine:
    """One simulated engine rank: its traffic, its publisher, its replay port."""

    def __init__(self, index: int) -> None:
        self.name = f"sim-{index}"
        self.pub, self.replay = free_port(), free_port()
        self.sim = SimEngine(SIM)
        self.requests = Workload(WORKLOAD, stream=index)
        self.publisher = Publisher(
            f"tcp://127.0.0.1:{self.pub}",
            f"tcp://127.0.0.1:{self.replay}",
            bind=True,
            buffer_steps=100_000,
        )

    def spec(self) -> EngineSpec:
        return EngineSpec(
            self.name,
            f"tcp://127.0.0.1:{self.pub}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay}",
        )

    def next_batch(self) -> EventBatch:
        while True:
            request = next(self.requests)
            self.sim.submit(request.prompt, request.output)
            batch = self.sim.step()
            if batch is not None:
                return batch


def block_ops(batch: EventBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events if hasattr(e, "block_hashes"))


class Bench:
    def __init__(self, nodes: list[RedisServer], cluster: bool, tmp: Path) -> None:
        self.nodes, self.url, self.cluster, self.tmp = nodes, nodes[0].url, cluster, tmp
        self.runs = 0

    async def redis_cpu(self) -> float:
        """CPU seconds every Redis node has used so far."""
        total = 0.0
        for node in self.nodes:
            client = Redis.from_url(node.url)
            info = await client.info("cpu")
            await client.aclose()
            total += info["used_cpu_user"] + info["used_cpu_sys"]
        return total

    def config(self) -> RedisConfig:
        self.runs += 1
        return RedisConfig(self.url, prefix=f"bench{self.runs}", cluster=self.cluster)

    def workers(self, config: RedisConfig, count: int) -> list[subprocess.Popen]:
        args = ["--redis-url", config.url, "--redis-prefix", config.prefix]
        if config.cluster:
            args.append("--redis-cluster")
        return [
            subprocess.Popen(
                [*KVINDEX, *args, "--lease-ttl", str(LEASE_TTL), "--worker-id", f"w{i}"],
                stderr=(self.tmp / f"w{self.runs}-{i}.log").open("w"),
            )
            for i in range(count)
        ]


async def until(condition, timeout: float, poll: float = 0.02) -> float:
    """Poll an async condition; the time it first held."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(poll)
    return time.time()


async def caught_up(store: RedisStore, targets: dict[RankId, int]) -> bool:
    marks = [await store.watermark(rank) for rank in targets]
    return all(m is not None and m.seq >= t for m, t in zip(marks, targets.values(), strict=True))


async def claims(store: RedisStore) -> list[tuple[float, dict[str, str]]]:
    (entries,) = await store.client.execute([("XRANGE", store.layout.owners_key, "-", "+")])
    return [
        (int(i.split(b"-")[0]) / 1000, {k.decode(): v.decode() for k, v in f.items()})
        for i, f in entries
    ]


def cpu_seconds(process: subprocess.Popen) -> float:
    """User + system CPU a running child has used (Linux /proc)."""
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def stop(processes: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    for p in processes:
        p.send_signal(sig)
    for p in processes:
        p.wait(timeout=20)


async def ingest(bench: Bench, engines: int, batches: int, count: int) -> dict:
    fleet = [Engine(k) for k in range(engines)]
    ops = 0
    for engine in fleet:  # into the replay buffers: nobody subscribes yet
        for _ in range(batches):
            batch = engine.next_batch()
            ops += block_ops(batch)
            engine.publisher.publish_encoded(encode_batch(batch))
        assert engine.publisher.flush(30)
    config = bench.config()
    store = RedisStore(config)
    workers = bench.workers(config, count)
    try:
        await until(lambda: _live(store, count), 30)
        registry = RedisRegistry(store.client)
        redis_cpu, worker_cpu = await bench.redis_cpu(), sum(map(cpu_seconds, workers))
        for engine in fleet:
            await registry.add(engine.spec())
        targets = {RankId(e.name, 0): batches - 1 for e in fleet}
        end = await until(lambda: caught_up(store, targets), 600, poll=0.05)
        redis_cpu = await bench.redis_cpu() - redis_cpu
        worker_cpu = sum(map(cpu_seconds, workers)) - worker_cpu
        start = min(t for t, e in await claims(store) if e["event"] == "claimed")
        seconds = end - start
        return {
            "workers": count,
            "block_ops": ops,
            "batches": engines * batches,
            "seconds": round(seconds, 2),
            "block_ops_per_s": round(ops / seconds),
            "batches_per_s": round(engines * batches / seconds),
            "worker_cpu_s": round(worker_cpu, 2),
            "redis_cpu_s": round(redis_cpu, 2),
            "block_ops_per_worker_cpu_s": round(ops / worker_cpu),
            "block_ops_per_redis_cpu_s": round(ops / redis_cpu),
        }
    finally:
        stop(workers)
        await store.close()
        for engine in fleet:
            engine.publisher.close()


async def _live(store: RedisStore, count: int) -> bool:
    return len(await live_workers(store.client)) == count


def publish_live(fleet: list[Engine], rate: float, done: threading.Event) -> None:
    while not done.is_set():
        started = time.monotonic()
        for engine in fleet:
            engine.publisher.publish(engine.next_batch())
        done.wait(max(0.0, 1 / rate - (time.monotonic() - started)))


async def hand_over(bench: Bench, engines: int, rate: float) -> dict:
    fleet = [Engine(k) for k in range(engines)]
    config = bench.config()
    store = RedisStore(config)
    workers = bench.workers(config, 2)
    done = threading.Event()
    publisher = threading.Thread(target=publish_live, args=(fleet, rate, done))
    publisher.start()
    try:
        await until(lambda: _live(store, 2), 30)
        registry = RedisRegistry(store.client)
        for engine in fleet:
            await registry.add(engine.spec())
        ranks = {RankId(e.name, 0): e for e in fleet}
        await until(lambda: _owners_settled(store, ranks), 30)
        await asyncio.sleep(2.0)
        orphans = [r for r, w in (await _owners(store)).items() if w == "w0"]
        leases = Leases(store.client, "bench", LEASE_TTL)
        ttls = await store.client.execute([("PTTL", leases.key(r)) for r in orphans])
        workers[0].kill()
        killed = time.time()
        workers[0].wait()
        expiry = {r: killed + ttl / 1000 for r, ttl in zip(orphans, ttls, strict=True)}
        claimed: dict[RankId, float] = {}
        caught: dict[RankId, float] = {}
        targets: dict[RankId, int] = {}
        deadline = time.monotonic() + 30
        while len(caught) < len(orphans) and time.monotonic() < deadline:
            owners = await _owners(store)
            now = time.time()
            for rank in orphans:
                if rank not in claimed and owners.get(rank) == "w1":
                    claimed[rank], targets[rank] = now, ranks[rank].publisher.next_seq - 1
                if rank in targets and rank not in caught:
                    mark = await store.watermark(rank)
                    if mark is not None and mark.seq >= targets[rank]:
                        caught[rank] = time.time()
            await asyncio.sleep(0.02)
        detect = [claimed[r] - expiry[r] for r in orphans]
        total = [caught[r] - expiry[r] for r in orphans]
        return {
            "lease_ttl": LEASE_TTL,
            "orphaned_ranks": len(orphans),
            "publish_rate_per_engine": rate,
            "detect_s": {"max": round(max(detect), 2), "mean": round(sum(detect) / len(detect), 2)},
            "caught_up_s": {"max": round(max(total), 2), "mean": round(sum(total) / len(total), 2)},
            "kill_to_caught_up_s": round(max(caught.values()) - killed, 2),
        }
    finally:
        done.set()
        publisher.join()
        stop(workers[1:])
        await store.close()
        for engine in fleet:
            engine.publisher.close()


async def _owners(store: RedisStore) -> dict[RankId, str | None]:
    owner: dict[RankId, str | None] = {}
    for _, e in await claims(store):
        if "engine" in e:
            owner[RankId(e["engine"], int(e["dp_rank"]))] = (
                e["worker"] if e["event"] == "claimed" else None
            )
    return owner


async def _owners_settled(store: RedisStore, ranks: dict[RankId, Engine]) -> bool:
    owners = await _owners(store)
    return all(owners.get(r) in ("w0", "w1") for r in ranks)


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.cluster:
            server = LocalCluster.start(tmp_path / "cluster")
            nodes = server.nodes
        else:
            server = RedisServer(tmp_path / "redis", free_port()).start()
            nodes = [server]
        try:
            bench = Bench(nodes, args.cluster, tmp_path)
            runs = [await ingest(bench, args.engines, args.batches, w) for w in (1, 2, 3)]
            base = runs[0]["block_ops_per_s"]
            for run in runs:
                run["vs_1_worker"] = round(run["block_ops_per_s"] / base, 2)
            handover = await hand_over(bench, args.engines, args.rate)
        finally:
            server.stop()
    return {
        "redis": "cluster (3 masters)" if args.cluster else "standalone",
        "engines": args.engines,
        "ingest": runs,
        "hand_over": handover,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=12)
    parser.add_argument("--batches", type=int, default=500, help="per engine, for the ingest runs")
    parser.add_argument("--rate", type=float, default=20.0, help="live batches/s per engine")
    parser.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
