"""``kvindex replay``: apply a recorded trace, report, and check vLLM's answers."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from kvindex.options import cannot

if TYPE_CHECKING:
    from indexer.ingest.trace import Expected, Payloads, ReplayStats
    from indexer.stores.redis import RedisConfig

log = logging.getLogger("kvindex")
T = TypeVar("T")

REPLAY_ENGINE = "replay"


def replay(args: argparse.Namespace) -> int:
    """Print the report on stdout; with probes, the verdict on stderr (exit 1 if
    any probe differs), so a script can keep the JSON and still see the result."""
    from indexer.ingest.trace import load_expected, map_trace
    from indexer.stores import StoreUnavailable

    redis = None
    if args.redis_url:
        from indexer.stores.redis import RedisConfig  # the redis client: a third of startup

        try:
            redis = RedisConfig(
                args.redis_url, args.redis_prefix, args.redis_cluster, sweep_interval=None
            )
        except ValueError as e:
            return cannot(args, str(e))
    trace = map_trace(args.trace)
    expected = load_expected(args.probe) if args.probe else None
    try:
        report, stats = _run(_replay_into_store(redis, trace, expected), redis is not None)
    except StoreUnavailable as e:
        return cannot(args, str(e))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()  # the report first, then the verdict below it
    log.info(
        "replayed",
        extra={
            "batches": stats.batches,
            "block_ops": stats.block_ops,
            "seconds": round(stats.seconds, 4),
            "block_ops_per_s": round(stats.block_ops / max(stats.seconds, 1e-9)),
        },
    )
    return 0 if expected is None else _verdict(expected, report["probes"])


def _run(coroutine: Coroutine[Any, Any, T], waits: bool) -> T:
    """Run a coroutine; one that never waits (into the embedded store, whose calls
    return at once) without an event loop: importing asyncio was a fifth of
    replay's start-up. Fails loudly if the store does wait."""
    if waits:
        import asyncio

        return asyncio.run(coroutine)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the embedded store waited: replay it with an event loop")


def _verdict(expected: Expected, answers: list[dict[str, int]]) -> int:
    """Say on stderr which probes kvindex answered unlike vLLM, then how many
    matched; 1 if any did not."""
    matched, group = 0, expected.engine.full_attention_group
    for i, (probe, answer) in enumerate(zip(expected.probes, answers, strict=True)):
        if probe.matches(answer, group):
            matched += 1
        else:
            print(f"probe {i}: kvindex {answer}, vLLM {probe.answer(group)}", file=sys.stderr)
    print(f"{matched}/{len(answers)} probes match", file=sys.stderr)
    return 0 if matched == len(answers) else 1


async def _replay_into_store(
    redis: RedisConfig | None, trace: Payloads, expected: Expected | None
) -> tuple[dict, ReplayStats]:
    """Replay into the embedded store, or into Redis after forgetting an earlier replay."""
    from indexer.core.events import RankId
    from indexer.ingest.trace import replay_report
    from indexer.stores import MemoryStore

    if redis is None:
        return await replay_report(MemoryStore(), trace, expected, REPLAY_ENGINE)
    from indexer.stores.redis import RedisStore

    store = RedisStore(redis)
    try:
        await store.forget(RankId(REPLAY_ENGINE, 0))
        return await replay_report(store, trace, expected, REPLAY_ENGINE)
    finally:
        await store.close()
