"""Sustained ingest: a local publisher through ZMQ into the subscriber and the memory store.

Run (from the repo root)::

    .venv/bin/python -m bench.bench_ingest [--batches 30000] [--outrun-seconds 5]
        [--outrun-factor 2] [--hwm 1000] [--json FILE]

The publisher (kvindex's vLLM-wire one) runs in a child process; the indexer
is this process's single asyncio thread, so its figures are for one core
(the publisher and both ZMQ I/O threads take the machine's other cores). The
workload is vLLM's fixture traces, cycled, encoded once and re-stamped with
a fresh batch ts as they are published (about 86 block operations a batch),
so that the publisher is never the bottleneck. Four measurements, one run:

- ``baseline``: decode and apply the same payloads straight into a
  MemoryStore (no sockets, no sequencing): the ceiling.
- ``sustained``: the publisher sends ``--batches`` as one burst, live, with
  high-water marks large enough that nothing drops; the rate is counted from
  the first to the last applied batch: what the apply loop sustains while a
  backlog waits. Also as a ratio to the baseline.
- ``catch_up``: the same burst published before the subscriber starts, which
  then catches up through the replay socket alone.
- ``outrun``: the publisher sends ``--outrun-factor`` times the sustained
  rate for ``--outrun-seconds`` through ZMQ's default high-water marks
  (1000): lag (batches, and seconds of batch ts) sampled every 100 ms, the
  gaps the drops caused, the replays that filled them, what stayed unfilled
  (beyond the 10,000-batch replay buffer) and the time to catch up after the
  publisher stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import struct
import time
from pathlib import Path

from indexer.engines import EngineRegistry, EngineSpec
from indexer.log import setup_logging
from indexer.model import RankId
from indexer.replay import load_trace
from indexer.stores import MemoryStore
from indexer.subscriber import Subscriber, SubscriberSettings
from indexer.wire import EventBatch, decode_batch, encode_batch

TRACES = Path(__file__).resolve().parents[1].parent / "shared/fixtures/vllm-0.33.0/traces"
NAMES = ("chat-sha256", "chat-gpu-only", "chat-placeholders", "chat-clear")
RANK = RankId("bench", 0)


def workload() -> list[EventBatch]:
    return [decode_batch(p) for n in NAMES for _, p in load_trace(TRACES / f"{n}.frames.msgpack")]


def cycled(items: list[EventBatch], count: int) -> list[EventBatch]:
    return [items[i % len(items)] for i in range(count)]


def _stamped(payload: bytes, ts: float) -> bytes:
    """The payload with a new batch ts, patched in place of the encoded one.

    vLLM's encoding starts with the batch array's header byte and the ts as a
    msgpack float64 (0xcb + 8 big-endian bytes); re-encoding every batch
    would make the publisher, not the indexer, the bottleneck.
    """
    assert payload[1] == 0xCB
    return payload[:2] + struct.pack(">d", ts) + payload[10:]


def _publish(count: int, rate: float, seconds: float, hwm: int, endpoints, go, done) -> None:
    """Child process: publish ``count`` batches at once, or ``rate`` per second for
    ``seconds``; then wait to be told to close."""
    from producer.publisher import Publisher

    pool = [encode_batch(b) for b in workload()]
    local = "tcp://127.0.0.1:0"
    sizes = {"max_queue_size": max(count, 100_000), "buffer_steps": max(count, 10_000)}
    with Publisher(local, local, bind=True, hwm=hwm, **sizes) as pub:
        endpoints.send((pub.endpoint, pub.replay_endpoint))
        go.wait()
        started, n = time.monotonic(), 0
        while n < count if count else (elapsed := time.monotonic() - started) < seconds:
            due = count or int(elapsed * rate) + 1
            while n < due:
                pub.publish_encoded(_stamped(pool[n % len(pool)], time.time()))
                n += 1
            time.sleep(0 if count else 0.001)
        pub.flush(60)
        endpoints.send(pub.dropped)
        done.wait()


async def baseline(count: int) -> dict:
    """Decode and apply straight into a MemoryStore: the ceiling."""
    payloads = [encode_batch(b) for b in cycled(workload(), count)]
    store, ops = MemoryStore(), 0
    started = time.perf_counter()
    for seq, payload in enumerate(payloads):
        ops += (await store.apply_batch(RANK, seq, decode_batch(payload))).block_ops
    seconds = time.perf_counter() - started
    return {
        "batches_per_s": round(count / seconds),
        "block_ops_per_s": round(ops / seconds),
        "block_ops_per_batch": round(ops / count, 1),
    }


class Publishing:
    """The publisher child process: its endpoints, a start signal, its drop count."""

    def __init__(self, count: int, rate: float, seconds: float, hwm: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._go, self._done = ctx.Event(), ctx.Event()
        self._pipe, child_end = ctx.Pipe(duplex=False)
        self._child = ctx.Process(
            target=_publish, args=(count, rate, seconds, hwm, child_end, self._go, self._done)
        )
        self.drops: int | None = None  # batches the publisher's full queue dropped

    async def start(self) -> tuple[str, str]:
        self._child.start()
        return await asyncio.to_thread(self._pipe.recv)

    def go(self) -> None:
        self._go.set()

    async def finished(self) -> None:
        """Wait until everything is published."""
        if self.drops is None:
            self.drops = await asyncio.to_thread(self._pipe.recv)

    async def close(self) -> None:
        await self.finished()
        self._done.set()
        await asyncio.to_thread(self._child.join, 30)


class Run:
    """A publisher child process and a subscriber over a fresh memory store."""

    def __init__(
        self, count: int, rate: float, seconds: float, hwm: int, settings: SubscriberSettings
    ) -> None:
        self.publishing = Publishing(count, rate, seconds, hwm)
        self.settings = settings
        self.first = self.last = 0.0  # when the first and the last batch were applied

    async def start(self, late: bool = False) -> None:
        """Start both; ``late``: the subscriber only once everything is published."""
        endpoint, replay = await self.publishing.start()
        if late:
            self.publishing.go()
            await self.publishing.finished()
        registry = EngineRegistry()
        await registry.add(EngineSpec(RANK.engine, endpoint, replay_endpoint=replay))
        self.subscriber = Subscriber(MemoryStore(), registry, self.settings)
        self.subscriber.add_observer(self._observe)
        await self.subscriber.start()
        if not late:
            while not self.status().connected:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the catch-up replay is answered before the burst
            self.publishing.go()

    def _observe(self, rank: RankId, batch: EventBatch) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last

    def status(self):
        return self.subscriber.rank_status(RANK.engine)[0]

    async def stop(self) -> None:
        await self.publishing.close()
        await self.subscriber.stop()


async def sustained(count: int, ops_per_batch: float, late: bool = False) -> dict:
    """A burst with nothing dropped: the rate the apply loop keeps up over a backlog.

    Live: the burst is published while the subscriber consumes (the publisher
    shares the machine's cores). ``late``: it was all published before the
    subscriber started, which catches up through the replay socket alone.
    """
    run = Run(count, 0, 0, 10 * count, SubscriberSettings(sub_hwm=10 * count))
    await run.start(late)
    while run.status().applied_seq != count - 1:
        await asyncio.sleep(0.05)
    status = run.status()
    await run.stop()
    rate = (count - 1) / (run.last - run.first)
    return {
        "batches": count,
        "batches_per_s": round(rate),
        "block_ops_per_s": round(rate * ops_per_batch),
        "gaps": status.gaps,
        "dropped_at_source": run.publishing.drops,
    }


async def outrun(rate: float, seconds: float, hwm: int) -> dict:
    """The publisher outruns the indexer: lag, drops turned into gaps, catch-up."""
    run = Run(0, rate, seconds, hwm, SubscriberSettings(sub_hwm=hwm))
    await run.start()
    samples, started = [], time.monotonic()
    while time.monotonic() - started < seconds + 60:
        st = run.status()
        samples.append((round(time.monotonic() - started, 1), st.lag_batches, st.lag_seconds))
        if time.monotonic() - started > seconds + 1 and st.lag_batches == 0:
            break
        await asyncio.sleep(0.1)
    status = run.status()
    await run.stop()
    busy = [t for t, lag, _ in samples if lag > 0]
    return {
        "rate": round(rate),
        "seconds": seconds,
        "hwm": hwm,
        "published": status.last_seq + 1,
        "max_lag_batches": max(s[1] for s in samples),
        "max_lag_seconds": round(max(s[2] for s in samples), 2),
        "caught_up_after_stop_s": round(max(0.0, (busy[-1] if busy else 0) - seconds), 1),
        "gaps": status.gaps,
        "gaps_filled": status.gaps_filled,
        "gaps_unfilled": status.gaps_unfilled,
        "missing_batches": sum(g.last - g.first + 1 for g in status.missing),
        "replays": status.replays,
        "degraded": status.degraded,
        "dropped_at_source": run.publishing.drops,
        "lag_samples": samples[:: max(1, len(samples) // 20)],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=30_000)
    parser.add_argument("--outrun-seconds", type=float, default=5.0)
    parser.add_argument(
        "--outrun-factor", type=float, default=2.0, help="outrun rate / sustained rate"
    )
    parser.add_argument("--hwm", type=int, default=1000, help="outrun HWMs (ZMQ's default)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    setup_logging("ERROR")  # the outrun degrades the rank on purpose
    results = {"baseline": await baseline(args.batches)}
    per_batch = results["baseline"]["block_ops_per_batch"]
    results["sustained"] = await sustained(args.batches, per_batch)
    results["catch_up"] = await sustained(args.batches, per_batch, late=True)
    for name in ("sustained", "catch_up"):
        results[name]["ratio_to_baseline"] = round(
            results[name]["batches_per_s"] / results["baseline"]["batches_per_s"], 3
        )
    rate = args.outrun_factor * results["sustained"]["batches_per_s"]
    results["outrun"] = await outrun(rate, args.outrun_seconds, args.hwm)
    for name, figures in results.items():
        print(name, json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
