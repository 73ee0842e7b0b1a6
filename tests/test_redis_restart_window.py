"""Redis killed mid-ingest and restarted empty, on a busy machine: no rank vouched for early.

Issue 34: four engines, each publishing one of vLLM's recorded traces, are
followed by a real ``kvindex serve --redis-url`` process and by an embedded
store in this process (the reference). Half of each trace is applied, Redis is
killed with SIGKILL, the engines publish the rest (the ranks' store calls fail
and their batches queue), and Redis is restarted empty. A second process burns
a core throughout, as on a machine shared with other work. From the kill on,
prefix matches are asked in a tight loop: an answer that differs from the
reference's must be flagged ``degraded``.

The engines publish nothing after the restart, so the reference's answers are
final from then on and lag cannot pass for a wrong answer: a rank rebuilt only
up to the batch it had applied when Redis died (not up to what it had received
since) is still behind the reference, and must say so.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.core.events import EventBatch

from .apikit import LiveApi
from .conftest import TRACE_NAMES, trace_batches
from .servers import RedisServer
from .test_e2e import until
from .test_redis_outage import Kvindex, Observed, engines, gpu_chains, rows

pytestmark = pytest.mark.slow  # kvindex processes, four engines, Redis killed and restarted

#: Runs of the whole scenario (each a test): the window is a race, so one run proves little.
RUNS = 3
#: Seconds Redis stays down: the ranks' retries back off meanwhile.
OUTAGE = 4.0
#: Seconds of answers still checked once every rank is whole again.
SETTLED = 1.0
#: Chains asked about per engine: the last ones each trace stores on GPU.
CHAINS = 3


@pytest.fixture
def busy_core() -> Iterator[None]:
    """A second process spinning on one core for the whole test."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    burner.kill()
    burner.wait()


@pytest.mark.parametrize("run", range(RUNS))
async def test_no_rank_answers_undegraded_before_it_is_rebuilt(
    tmp_path: Path, volatile_redis: RedisServer, busy_core: None, run: int
) -> None:
    traces = [trace_batches(name) for name in TRACE_NAMES]
    specs, publishers = engines(len(traces))
    reference = LiveApi()
    reference.publishers += publishers  # closed with it
    kvindex = Kvindex(tmp_path, "serve", volatile_redis.url, specs)
    await reference.__aenter__()
    try:
        for spec in specs:
            await reference.registry.add(spec)

        async def publish(parts: list[list[EventBatch]]) -> list[int]:
            for publisher, part in zip(publishers, parts, strict=True):
                for batch in part:
                    assert publisher.publish(batch)
                assert await asyncio.to_thread(publisher.flush)
            lasts = [p.next_seq - 1 for p in publishers]
            for spec, last in zip(specs, lasts, strict=True):
                await reference.wait_applied(spec.name, [last])
            return lasts

        async def applied(lasts: list[int]) -> bool:
            return all([await kvindex.applied([s], n) for s, n in zip(specs, lasts, strict=True)])

        lasts = await publish([t[: len(t) // 2] for t in traces])
        await until(lambda: applied(lasts), 60, "kvindex to apply half of every trace")

        await asyncio.to_thread(volatile_redis.stop, signal.SIGKILL)
        seen = Observed(time.monotonic())
        restarted: list[float] = []
        whole: list[float] = []
        chains = [c for t in traces for c in gpu_chains(t, CHAINS)]
        lasts = await publish([t[len(t) // 2 :] for t in traces])
        expected = {c: (await rows(reference.client, c))[1] for c in chains}
        assert all(any(any(r) for r in want.values()) for want in expected.values())

        async def ask() -> None:
            """Every chain in turn, as fast as answers come, until settled after whole."""
            while not (whole and seen.now() > whole[0] + SETTLED):
                for chain, want in expected.items():
                    status, counts, flags = await rows(kvindex.http, chain)
                    if status == 200:
                        seen.check(counts, flags, want, ready=False)
                    else:
                        assert status == 503, status
                        seen.unavailable += 1
                await asyncio.sleep(0)

        async def outage_then_whole() -> None:
            await asyncio.sleep(max(0.0, seen.restarted + OUTAGE - time.monotonic()))
            await asyncio.to_thread(volatile_redis.start)  # empty: nothing was saved
            restarted.append(seen.now())
            while not await applied(lasts):
                await asyncio.sleep(0.05)
            whole.append(seen.now())

        await asyncio.wait_for(asyncio.gather(ask(), outage_then_whole()), 120)
    finally:
        await kvindex.close()
        await reference.__aexit__()
    print(f"\nrun {run}: Redis back at {restarted[0]}s, whole at {whole[0]}s; {seen.summary()}")
    seen.assert_flagged()
