"""Item 3: end-to-end ingest, ZMQ from a local publisher to applied batches.

kvindex's vLLM-wire :class:`~producer.publisher.Publisher` runs in a forked
child and publishes the fleet's payloads (re-stamped with a fresh batch ts,
not re-encoded, so the publisher is never the bottleneck); this process's
single asyncio thread runs the :class:`~indexer.ingest.subscriber.Subscriber` into a
MemoryStore. Three runs:

- ``sustained``: a burst published live with high-water marks large enough
  that nothing drops, counted from the first to the last applied batch;
- ``catch_up``: the same burst published before the subscriber starts, which
  catches up through the replay socket alone;
- ``outrun``: the publisher sends twice the sustained rate for a few seconds
  through ZMQ's default high-water marks: lag (batches and seconds) sampled
  every 100 ms, gaps, replays, what stayed unfilled, time to catch up.

The baseline is the same payloads decoded and applied straight into a
MemoryStore (no sockets, no sequencing): the ceiling.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
import time

from bench.ingest import kvindex
from bench.report import Figure, Goal, Report
from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores import MemoryStore

SECTION = "3"
#: Issue 27: what crossing ZeroMQ and the consumer's loop may cost, against the ceiling.
LIVE_GOAL = Goal(0.9)
RANK = RankId("bench", 0)


def _stamped(payload: bytes, ts: float) -> bytes:
    """The payload with a new batch ts in place of the encoded one (0xcb + float64)."""
    assert payload[1] == 0xCB
    return payload[:2] + struct.pack(">d", ts) + payload[10:]


def publish_child(pool, count, rate, seconds, hwm, pipe, go, done) -> None:
    """Child: publish ``count`` batches at once, or ``rate``/s for ``seconds``."""
    from producer.publisher import Publisher

    local = "tcp://127.0.0.1:0"
    sizes = {"max_queue_size": max(count, 100_000), "buffer_steps": max(count, 10_000)}
    with Publisher(local, local, bind=True, hwm=hwm, **sizes) as pub:
        pipe.send((pub.endpoint, pub.replay_endpoint))
        go.wait()
        started, n = time.monotonic(), 0
        while n < count if count else (elapsed := time.monotonic() - started) < seconds:
            due = count or int(elapsed * rate) + 1
            while n < due:
                pub.publish_encoded(_stamped(pool[n % len(pool)], time.time()))
                n += 1
            time.sleep(0 if count else 0.001)
        pub.flush(60)
        pipe.send(pub.dropped)
        done.wait()


class Run:
    """A publisher child process and a subscriber over a fresh memory store."""

    def __init__(self, pool: list[bytes], count: int, rate: float, seconds: float, hwm: int):
        ctx = multiprocessing.get_context("fork")
        self._go, self._done = ctx.Event(), ctx.Event()
        self._pipe, child_end = ctx.Pipe(duplex=False)
        args = (pool, count, rate, seconds, hwm, child_end, self._go, self._done)
        self._child = ctx.Process(target=publish_child, args=args)
        self.settings = SubscriberSettings(sub_hwm=hwm)
        self.drops: int | None = None
        self.first = self.last = 0.0

    async def start(self, late: bool = False) -> None:
        self._child.start()
        endpoint, replay = await asyncio.to_thread(self._pipe.recv)
        if late:
            self._go.set()
            await self._finished()
        registry = EngineRegistry()
        await registry.add(EngineSpec(RANK.engine, endpoint, replay_endpoint=replay))
        self.subscriber = Subscriber(MemoryStore(), registry, self.settings)
        self.subscriber.add_observer(self._observe)
        await self.subscriber.start()
        if not late:
            while not self.status().connected:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the catch-up replay is answered before the burst
            self._go.set()

    def _observe(self, rank: RankId, batch: EventBatch) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last

    def status(self):
        return self.subscriber.rank_status(RANK.engine)[0]

    async def _finished(self) -> None:
        if self.drops is None:
            self.drops = await asyncio.to_thread(self._pipe.recv)

    async def stop(self) -> None:
        await self._finished()
        self._done.set()
        await asyncio.to_thread(self._child.join, 30)
        await self.subscriber.stop()


async def sustained(pool: list[bytes], count: int, ops_per_batch: float, late: bool) -> dict:
    run = Run(pool, count, 0, 0, 10 * count)
    await run.start(late)
    deadline = time.monotonic() + 600
    while run.status().applied_seq != count - 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    status = run.status()
    await run.stop()
    rate = (count - 1) / max(1e-9, run.last - run.first)
    return {
        "batches": count,
        "batches_per_s": rate,
        "block_ops_per_s": rate * ops_per_batch,
        "gaps": status.gaps,
        "dropped_at_source": run.drops,
    }


async def outrun(pool: list[bytes], rate: float, seconds: float, hwm: int = 1000) -> dict:
    run = Run(pool, 0, rate, seconds, hwm)
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
        "rate": rate,
        "seconds": seconds,
        "published": (status.last_seq or 0) + 1,
        "max_lag_batches": max(s[1] for s in samples),
        "max_lag_seconds": max(s[2] for s in samples),
        "caught_up_after_stop_s": max(0.0, (busy[-1] if busy else 0) - seconds),
        "gaps": status.gaps,
        "gaps_filled": status.gaps_filled,
        "gaps_unfilled": status.gaps_unfilled,
        "replays": status.replays,
        "degraded": status.degraded,
        "dropped_at_source": run.drops,
        "lag_samples": samples[:: max(1, len(samples) // 20)],
    }


def run(report: Report, stream: list, batches: int, outrun_seconds: float) -> dict:
    pool = [payload for _, _, payload in stream]
    count = min(batches, len(pool))
    ceiling_stream = [(RANK, seq, pool[seq]) for seq in range(count)]
    started = time.perf_counter()
    ops = kvindex(ceiling_stream)
    ceiling = count / (time.perf_counter() - started)
    per_batch = ops / count
    results: dict = {"ceiling_batches_per_s": ceiling, "block_ops_per_batch": per_batch}
    results["sustained"] = asyncio.run(sustained(pool[:count], count, per_batch, late=False))
    results["catch_up"] = asyncio.run(sustained(pool[:count], count, per_batch, late=True))
    rate = 2 * results["sustained"]["batches_per_s"]
    results["outrun"] = asyncio.run(outrun(pool, rate, outrun_seconds))
    for name in ("sustained", "catch_up"):
        r = results[name]
        report.add(
            Figure(SECTION, f"end-to-end ZMQ -> applied ({name}): batches/s", r["batches_per_s"],
                   "batches/s", "decode + apply in process (ceiling)", ceiling, LIVE_GOAL),
            Figure(SECTION, f"end-to-end ZMQ -> applied ({name}): block-ops/s",
                   r["block_ops_per_s"], "ops/s"),
        )  # fmt: skip
    o = results["outrun"]
    report.add(
        Figure(SECTION, f"outrun at 2x for {outrun_seconds:g}s: max lag", o["max_lag_batches"],
               "batches", note=f"{o['max_lag_seconds']:.2f} s; gaps {o['gaps']}, filled "
               f"{o['gaps_filled']}, unfilled {o['gaps_unfilled']}; caught up "
               f"{o['caught_up_after_stop_s']:.1f} s after the publisher stopped"),
    )  # fmt: skip
    return results
