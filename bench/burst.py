"""Item 13: query latency in ``kvindex serve`` while one engine's ingest burst is applied.

A real ``kvindex serve`` process (embedded store) follows one engine whose
publisher runs in a forked child (bench item 3's) and publishes ``batches``
batches of a vLLM-granularity trace (:mod:`producer.vllm_trace`) at once,
as fast as ZeroMQ takes them, with high-water marks that drop nothing. This
process plays a router: one ``POST /prefix-match`` of a 64-block chain every
20 ms. The baseline is the same server idle (the engine connected, nothing
published), measured just before the burst; the figure is the burst's p99
over the idle p99, goal <= 2x. The burst's samples are those sent from the
go signal until the rank has applied the last batch.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
import time

import httpx

from bench.e2e import publish_child
from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockStored, EventBatch
from producer import vllm_trace
from tests.servers import free_port

SECTION = "13"
ENGINE = "burst"
CHAIN_BLOCKS = 64
EVERY = 0.02
GOAL = Goal(2.0, at_least=False)


def _chain(trace: list[tuple[int, bytes]]) -> list[int]:
    """The first 64 hashes the engine stored (a prompt it really served)."""
    import msgspec

    decode = msgspec.msgpack.Decoder(EventBatch).decode
    chain: list[int] = []
    for _, payload in trace:
        for event in decode(payload).events:
            if type(event) is BlockStored:
                chain += event.block_hashes
                if len(chain) >= CHAIN_BLOCKS:
                    return chain[:CHAIN_BLOCKS]
    raise ValueError("the trace stores fewer than 64 blocks")


class Server:
    """``kvindex serve`` in a child process, following the publisher's endpoints."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.port = free_port()
        engine = f"{ENGINE}={endpoint},replay_endpoint={replay}"
        command = [sys.executable, "-m", "kvindex", "serve", "--port", str(self.port)]
        self._child = subprocess.Popen(
            [*command, "--engine", engine, "--log-level", "error"],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._child.terminate()
        self._child.wait(30)


async def _rank(client: httpx.AsyncClient) -> dict:
    return (await client.get(f"/engines/{ENGINE}")).json()["ranks"][0]


async def _sample(client: httpx.AsyncClient, body: dict, done) -> list[float]:
    """Latencies of one query every 20 ms until ``done()``."""
    samples, due = [], time.perf_counter()
    while not await done():
        due += EVERY
        started = time.perf_counter()
        answer = await client.post("/prefix-match", json=body)
        samples.append(time.perf_counter() - started)
        answer.raise_for_status()
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    return samples


async def _measure(server: Server, go, body: dict, idle_s: float, last_seq: int) -> dict:
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
        httpx.AsyncClient(base_url=server.url, timeout=30) as watcher,
    ):
        deadline = time.monotonic() + 30
        while True:
            try:
                if (await _rank(watcher))["connected"]:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kvindex serve did not connect to the publisher")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # the first replay probe is answered
        until = time.monotonic() + idle_s

        async def idle_over() -> bool:
            return time.monotonic() >= until

        idle = await _sample(client, body, idle_over)
        go.set()
        started, checked = time.monotonic(), [0.0]

        async def burst_over() -> bool:
            if time.monotonic() - checked[0] < 0.2:
                return False
            checked[0] = time.monotonic()
            if time.monotonic() - started > 600:
                raise TimeoutError("the burst was not applied in 600 s")
            return (await _rank(watcher)).get("applied_seq") == last_seq

        burst = await _sample(client, body, burst_over)
        applied_in = time.monotonic() - started
        final = await _rank(watcher)
    return {
        "idle": {**latency_ms(idle), "max_ms": 1000 * max(idle), "samples": len(idle)},
        "burst": {**latency_ms(burst), "max_ms": 1000 * max(burst), "samples": len(burst)},
        "burst_applied_in_s": applied_in,
        "gaps": final.get("gaps"),
    }


def run(report: Report, quick: bool) -> dict:
    batches = 12_000
    trace, ops = vllm_trace.generate(200_000 if quick else 2_000_000)
    pool = [payload for _, payload in trace]
    body = {"block_hashes": _chain(trace)}
    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    pipe, child_end = ctx.Pipe(duplex=False)
    args = (pool, batches, 0, 0, 10 * batches, child_end, go, done)
    child = ctx.Process(target=publish_child, args=args)
    child.start()
    endpoint, replay = pipe.recv()
    server = Server(endpoint, replay)
    try:
        details = asyncio.run(_measure(server, go, body, 3.0 if quick else 10.0, batches - 1))
    finally:
        done.set()
        server.stop()
        child.join(30)
    details.update(batches=batches, block_ops_per_batch=ops / len(trace))
    idle, burst = details["idle"], details["burst"]
    report.add(
        Figure(SECTION, f"kvindex serve, {CHAIN_BLOCKS}-block POST prefix-match every 20 ms, "
               f"during a {batches:,}-batch ingest burst: p99", burst["p99_ms"], "ms",
               "same server idle: p99", idle["p99_ms"], GOAL,
               note=f"p50 {burst['p50_ms']:.1f} vs {idle['p50_ms']:.1f} ms, max "
               f"{burst['max_ms']:.1f} ms; burst applied in {details['burst_applied_in_s']:.1f} s"),
    )  # fmt: skip
    return details
