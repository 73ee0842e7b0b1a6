"""Item 9: what silent engine ranks cost one ``kvindex serve`` process.

A process follows N ranks whose endpoints have nothing listening (the
engines are down or mis-addressed), each with a replay endpoint, as the
subscriber of ``kvindex serve`` does. After a warm-up long enough for every
startup step (the first connection attempts, the no-publisher check), it
reports the CPU it burns (fraction of one core over a few seconds) and its
resident memory. The baseline is the same child process following no rank,
measured in the same run: the difference is the silent ranks' cost.

``python -m bench.idle RANKS SECONDS`` runs one child and prints its JSON.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.report import Figure, Report
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.log import setup_logging
from indexer.stores import MemoryStore

SECTION = "9"
RANKS = 1000
_ROOT = Path(__file__).resolve().parents[1]


def _unused_ports(count: int) -> list[int]:
    """Ports the kernel just gave out and took back: nothing listens there."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def _follow(ranks: int, seconds: float) -> dict:
    settings = SubscriberSettings()
    registry = EngineRegistry()
    subscriber = Subscriber(MemoryStore(), registry, settings)
    await subscriber.start()
    ports = _unused_ports(2 * ranks)
    for i in range(ranks):
        pub, replay = ports[2 * i], ports[2 * i + 1]
        await registry.add(
            EngineSpec(
                f"silent-{i}",
                f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
            )
        )
    await asyncio.sleep(settings.no_publisher_after + 1)  # every startup step is behind us
    used, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await asyncio.sleep(seconds)
    now, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    cpu = (now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime) / elapsed
    rss = _rss()
    await subscriber.stop()
    return {"ranks": ranks, "cpu": cpu, "rss": rss, "seconds": elapsed}


def measure(ranks: int, seconds: float) -> dict:
    """One child process following ``ranks`` silent ranks."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.idle", str(ranks), str(seconds)],
        cwd=_ROOT,
        capture_output=True,
        check=True,
        text=True,
        timeout=seconds + 120,
    )
    return json.loads(out.stdout.splitlines()[-1])


def run(report: Report, seconds: float, ranks: int = RANKS) -> dict:
    silent, baseline = measure(ranks, seconds), measure(0, seconds)
    per_rank = (silent["rss"] - baseline["rss"]) / ranks
    report.add(
        Figure(
            SECTION,
            f"idle CPU, {ranks:,} silent ranks",
            silent["cpu"],
            "cores",
            baseline="same process, no rank",
            baseline_value=baseline["cpu"],
            note=f"over {seconds:g} s after a warm-up",
        ),
        Figure(
            SECTION,
            f"resident memory, {ranks:,} silent ranks",
            silent["rss"] / 2**20,
            "MB",
            baseline="same process, no rank",
            baseline_value=baseline["rss"] / 2**20,
        ),
        Figure(SECTION, "resident memory per silent rank", per_rank / 1024, "KB"),
    )
    return {"silent": silent, "baseline": baseline, "bytes_per_rank": per_rank}


if __name__ == "__main__":
    setup_logging("ERROR")  # a thousand "no publisher" warnings are the point, not the output
    print(json.dumps(asyncio.run(_follow(int(sys.argv[1]), float(sys.argv[2])))))
