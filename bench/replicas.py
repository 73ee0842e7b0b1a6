"""Item 17: what a scale-out query costs over HTTP, by where the replica reads.

Real processes on one machine: 32 simulated engines publishing over ZeroMQ,
one redis-server, and four kvindex processes consuming the same engines:
``kvindex serve`` (the embedded store: the baseline), one ``kvindex indexer``
worker writing Redis, a ``kvindex api`` replica reading residency from Redis on
every query, and a ``kvindex api --mirror`` replica answering from its own
consumption of the engines. The engines serve chats over shared system
prompts; once the three servers give the same answers, this process sends
``POST /prefix-match`` by ``tokens`` (64 blocks) to each over one keep-alive
connection, the same query to the three in turn, so a noisy moment of the
shared machine hits all of them. Figures: each replica's p50 against the
embedded server's (the mirror's goal: at most 1.5x), and how stale each one's
answers are: from an engine publishing a new prompt to the server first
answering with its blocks.

Run: ``.venv/bin/python -m bench --only 17 [--quick]`` (needs ``redis-server``;
about a minute).
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

import httpx

from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.simcli import Layout, engine_spec
from tests.conftest import free_ports
from tests.servers import RedisServer, free_port

SECTION = "17"
ENGINES = 32
BLOCK_SIZE = 16
QUERY_BLOCKS = 64
MIRROR_GOAL = Goal(1.5, at_least=False)
CONFIG = SimConfig(gpu_blocks=4096, cpu_chunks=0)
KVINDEX = (sys.executable, "-m", "kvindex.cli", "--log-level", "ERROR")


class Engine:
    """A simulated engine and the publisher its batches go out on."""

    def __init__(self, layout: Layout, k: int) -> None:
        self.spec = engine_spec(layout, k, CONFIG, "m")
        self._sim = SimEngine(CONFIG, k)
        self._publisher = Publisher(
            self.spec["endpoint"], self.spec["replay_endpoint"], data_parallel_rank=0, bind=True
        )

    def serve(self, prompts: list[list[int]]) -> None:
        """Take the prompts, then publish every batch until the engine is idle."""
        for tokens in prompts:
            self._sim.submit(tokens, (1, 2))
        while not self._sim.idle:
            batch = self._sim.step()
            while batch is not None and not self._publisher.publish(batch):
                time.sleep(0.01)  # the send queue is full: wait, drop nothing

    def close(self) -> None:
        self._publisher.close()


def workload(seed: int, engines: int, per_engine: int) -> list[list[list[int]]]:
    """Each engine's prompts: chats over 8 system prompts (an engine serves two of
    them), each ending in a question of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(48 * BLOCK_SIZE)] for _ in range(8)]
    return [
        [
            systems[(e + i) % 8 if i % 2 else e % 8]
            + [rng.randrange(1, 30_000) for _ in range(BLOCK_SIZE * (16 + i % 8))]
            for i in range(per_engine)
        ]
        for e in range(engines)
    ]


class Servers:
    """The four kvindex processes; ``clients`` for the three that answer, by name."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        redis = ("--redis-url", redis_url, "--redis-prefix", "bench-replicas")
        ports = {name: free_port() for name in ("embedded", "redis", "mirror")}
        commands = {
            "embedded": ("serve", "--port", str(ports["embedded"])),
            "worker": ("indexer", *redis),
            "redis": ("api", *redis, "--port", str(ports["redis"])),
            "mirror": ("api", *redis, "--port", str(ports["mirror"]), "--mirror"),
        }
        self._children = [
            subprocess.Popen([*KVINDEX, *args], stdout=subprocess.DEVNULL, cwd=tmp)
            for args in commands.values()
        ]
        self.clients = {
            name: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
            for name, port in ports.items()
        }

    def wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"item {SECTION}: timed out waiting for {what}")
            time.sleep(0.1)

    def connected(self, engines: int) -> bool:
        stats = [c.get("/stats").json() for c in self.clients.values()]
        return all(s.get("connected_ranks") == engines for s in stats)

    def rows(self, name: str, tokens: list[int]) -> list[dict]:
        """One server's answer rows for a prompt."""
        reply = self.clients[name].post("/prefix-match", json={"tokens": tokens})
        reply.raise_for_status()
        return reply.json()["engines"]

    def answers(self, name: str, queries: list[list[int]]) -> list[list[tuple]]:
        return [sorted((r["engine"], r["score"]) for r in self.rows(name, q)) for q in queries]

    def agree(self, queries: list[list[int]]) -> bool:
        embedded = self.answers("embedded", queries)
        held = any(score for rows in embedded for _, score in rows)
        return held and all(self.answers(n, queries) == embedded for n in ("redis", "mirror"))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for child in self._children:
            child.terminate()
        for child in self._children:
            child.wait(30)


def _timed(client: httpx.Client, tokens: list[int]) -> float:
    started = time.perf_counter()
    reply = client.post("/prefix-match", json={"tokens": tokens})
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    return elapsed


def measure(servers: Servers, queries: list[list[int]], rounds: int) -> dict[str, dict]:
    """Every query to every server in turn, ``rounds`` times: latency by server."""
    samples: dict[str, list[float]] = {name: [] for name in servers.clients}
    for _ in range(rounds):
        for tokens in queries:
            for name, client in servers.clients.items():
                samples[name].append(_timed(client, tokens))
    return {name: latency_ms(values) for name, values in samples.items()}


def visible_after(servers: Servers, engines: list[Engine], rounds: int) -> dict[str, dict]:
    """How stale each server's answers are: from an engine publishing a new prompt's
    batches to each server first answering with its blocks (servers polled in turn,
    a different one first each round, so the resolution is one round of three
    queries, a few milliseconds)."""
    rng, seen = random.Random(9), {name: [] for name in servers.clients}
    for r in range(rounds):
        engine = engines[r % len(engines)]
        tokens = [rng.randrange(1, 30_000) for _ in range(QUERY_BLOCKS * BLOCK_SIZE)]
        waiting, started = set(servers.clients), time.perf_counter()
        engine.serve([tokens])
        names = sorted(waiting)
        names = names[r % len(names) :] + names[: r % len(names)]  # each polled first in turn
        while waiting and time.perf_counter() - started < 30:
            for name in [n for n in names if n in waiting]:
                rows = servers.rows(name, tokens)
                if any(r["engine"] == engine.spec["name"] and r["gpu_blocks"] for r in rows):
                    seen[name].append(time.perf_counter() - started)
                    waiting.discard(name)
        if waiting:
            raise TimeoutError(f"item {SECTION}: {sorted(waiting)} never showed a new prompt")
    return {name: latency_ms(values) for name, values in seen.items()}


def _run(tmp: Path, quick: bool) -> dict:
    redis = RedisServer(tmp, free_port()).start()
    layout = Layout(ENGINES, free_ports(2 * ENGINES))
    engines = [Engine(layout, k) for k in range(ENGINES)]
    servers = Servers(tmp, redis.url)
    try:
        servers.wait(lambda: all(c.get("/healthz").status_code == 200
                                 for c in servers.clients.values()), "the servers")  # fmt: skip
        for engine in engines:
            for name in ("embedded", "redis"):  # the redis replica registers for the worker
                servers.clients[name].post("/engines", json=engine.spec).raise_for_status()
        servers.wait(lambda: servers.connected(ENGINES), "every server to connect every engine")
        prompts = workload(17, ENGINES, 6 if quick else 16)
        for engine, mine in zip(engines, prompts, strict=True):
            engine.serve(mine)
        served = [p[: QUERY_BLOCKS * BLOCK_SIZE] for p in chain.from_iterable(prompts)]
        queries = random.Random(5).sample(served, 64)  # every prompt is over 64 blocks
        servers.wait(lambda: servers.agree(queries[:8]), "the three servers to agree", 120)
        exact = servers.agree(queries)
        latency = measure(servers, queries, 3 if quick else 10)
        stale = visible_after(servers, engines, 10 if quick else 30)
        return {"latency": latency, "visible_after": stale, "exact": exact, "queries": len(queries)}
    finally:
        servers.close()
        for engine in engines:
            engine.close()
        redis.stop()


def run(report: Report, quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-replicas-") as tmp:
        details = _run(Path(tmp), quick)
    latency, base = details["latency"], details["latency"]["embedded"]
    seen = details["visible_after"]
    what = f"HTTP POST /prefix-match by tokens, {QUERY_BLOCKS} blocks, {ENGINES} engines"
    agreed = "answers equal the embedded server's" if details["exact"] else "answers DIFFER"
    for name, label, goal in (
        ("redis", "`kvindex api` reading Redis", None),
        ("mirror", "`kvindex api --mirror`", MIRROR_GOAL),
    ):
        report.add(
            Figure(SECTION, f"{what}: {label}, p50", latency[name]["p50_ms"], "ms",
                   "`kvindex serve` (embedded), same queries: p50", base["p50_ms"], goal,
                   note=f"p99 {latency[name]['p99_ms']:.2f} vs {base['p99_ms']:.2f} ms; "
                   f"{details['queries']} queries; {agreed}"),
            Figure(SECTION, f"a new prompt's blocks in the answers of {label}, after its "
                   "engine publishes them: p50", seen[name]["p50_ms"], "ms",
                   "`kvindex serve` (embedded): p50", seen["embedded"]["p50_ms"],
                   note=f"p99 {seen[name]['p99_ms']:.1f} vs {seen['embedded']['p99_ms']:.1f} ms"),
        )  # fmt: skip
    return details
