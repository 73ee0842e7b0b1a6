"""Bench item 15, part 3 (:mod:`bench.snapshots`): how soon a kvindex started late
answers exactly from a snapshot, against the same start replaying a buffer that
still holds every batch, since that wait is what snapshots exist to shorten."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from bench.report import Figure, Report
from bench.snapshots.data import SECTION, batches_of, hashes
from indexer.core.events import EventBatch
from producer.publisher import Publisher
from producer.snapshots import SelfSnapshotting
from tests.servers import free_port

TOKEN = "bench-snapshot-token"


class _Engine:
    """One simulated rank publishing ``batches``: with ``buffer`` batches of replay,
    answering snapshots (or not)."""

    def __init__(self, name: str, batches: list[EventBatch], buffer: int, snapshots: bool):
        self.name = name
        self.endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
        pub, replay, snapshot = self.endpoints
        publisher = Publisher(pub, replay, bind=True, buffer_steps=buffer, hwm=10)
        self.rank = SelfSnapshotting(publisher, snapshot, TOKEN) if snapshots else None
        self.publisher = publisher
        for batch in batches:
            sent = self.rank.publish(batch) if self.rank else publisher.publish(batch)
            assert sent
        assert publisher.flush(60)
        self.last_seq = publisher.next_seq - 1

    def engine_flag(self) -> str:
        pub, replay, snapshot = self.endpoints
        spec = f"{self.name}={pub},replay_endpoint={replay},reuse_reports=counted,block_size=16"
        return spec + (f",snapshot_endpoint={snapshot}" if self.rank else "")

    def close(self) -> None:
        if self.rank:
            self.rank.close()
        else:
            self.publisher.close()


async def _until_exact(engine: _Engine, restores: int, timeout: float) -> dict:
    """``kvindex serve`` started now, following ``engine``: seconds to /healthz and to
    exact (restored ``restores`` times, not degraded, the last seq applied)."""
    port = free_port()
    command = [sys.executable, "-m", "kvindex", "serve", "--port", str(port)]
    command += ["--engine", engine.engine_flag(), "--log-level", "error"]
    env = {**os.environ, "KVINDEX_AUTH_TOKEN": TOKEN}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    up = state = None
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10, headers=headers
        ) as client:
            while time.perf_counter() - started < timeout:
                assert child.poll() is None, "kvindex serve exited"
                try:
                    if up is None:
                        if (await client.get("/healthz")).status_code == 200:
                            up = time.perf_counter() - started
                    else:
                        response = await client.get(f"/engines/{engine.name}")
                        if response.status_code == 200:
                            state = response.json()["ranks"][0]
                            if (
                                state["applied_seq"] == engine.last_seq
                                and state["restores"] == restores
                                and not state["degraded"]
                            ):
                                exact = time.perf_counter() - started
                                return {"up_s": up, "exact_s": exact, "after_up_s": exact - up}
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.02)
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    raise TimeoutError(f"{engine.name}: not exact in {timeout:g} s (last state {state})")


def late_start(report: Report, n: int, quick: bool) -> dict:
    repeats = 3
    batches = batches_of(hashes(n, "int", seed=3))
    snapshotting = _Engine("late", batches, 10, snapshots=True)
    replaying = _Engine("replayed", batches, len(batches) + 10, snapshots=False)
    del batches
    gc.collect()
    runs: dict[str, list[dict]] = {"snapshot": [], "replay": []}
    try:
        for i in range(repeats):  # which goes first alternates
            for name in ("snapshot", "replay")[:: 1 if i % 2 == 0 else -1]:
                engine, restores = (snapshotting, 1) if name == "snapshot" else (replaying, 0)
                runs[name].append(asyncio.run(_until_exact(engine, restores, 300)))
        served = snapshotting.rank.server.served
    finally:
        snapshotting.close()
        replaying.close()
    assert served == repeats, served
    medians = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    details = {"blocks": n, "batches": snapshotting.last_seq + 1, "runs": runs, "median": medians}
    snap, replay = medians["snapshot"], medians["replay"]
    report.add(
        Figure(SECTION, f"late start, {n / 1e6:g}M GPU blocks: kvindex serve's start to exact "
               "answers, the engine's replay buffer 10 batches deep (restored from its snapshot)",
               snap["exact_s"], "s", f"the same start, an engine whose replay buffer holds all "
               f"{details['batches']:,} batches (replayed)", replay["exact_s"],
               note=f"medians of {repeats}, interleaved; the process answers /healthz after "
               f"{snap['up_s']:.2f} s (replay runs: {replay['up_s']:.2f} s); embedded store"),
        Figure(SECTION, f"late start, {n / 1e6:g}M GPU blocks: from kvindex serve's first "
               "/healthz to exact answers, restored from the snapshot", snap["after_up_s"], "s",
               "the same, replayed from a buffer holding every batch", replay["after_up_s"],
               note="the process's start (interpreter, imports, HTTP up) left out"),
    )  # fmt: skip
    return details
