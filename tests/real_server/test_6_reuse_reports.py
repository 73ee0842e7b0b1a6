"""Reuse reports (``vllm_xargs: {"kv_cache_report_mode": "full"}``): vLLM re-announces
each GPU block it reuses as a BlockStored, with no removal of its own; kvindex must never
say the engine holds a prefix vLLM no longer has.

Before ``reuse_reports`` kvindex counted each report as a copy, so a prefix reused four
times and then evicted stayed resident in kvindex: it said the engine held 288 tokens of
it while vLLM reported 0 cached. The plugin now keeps reports out of the stream kvindex
reads (``filtered``).
"""

from __future__ import annotations

import random

import pytest

from tests.real_server.harness import BLOCK, TALLY, Turns

FULL = {"vllm_xargs": {"kv_cache_report_mode": "full"}}


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(count)]


def require(condition: bool, what: object) -> None:
    """A precondition of the measurement: a failure here is not the expected one."""
    if not condition:
        pytest.fail(f"not measured: {what}")


def test_reused_then_evicted_prefix_is_not_reported(kv, announced_a) -> None:
    turns = Turns(kv, announced_a, "reuse reports")
    rng = random.Random(8)
    prefix = {"prompt": ids(rng, 300)}  # 9 full blocks: a hit of 288 tokens at most
    before = [turns.turn("first", prefix, **FULL)]
    before += [turns.turn(f"reused {i}", prefix, **FULL) for i in range(1, 5)]
    require(all(t.cached_tokens == 9 * BLOCK for t in before[1:]), [str(t) for t in before])
    # more new blocks than the 128 of the cache: every block of the prefix is evicted
    before += [turns.turn(f"new {i}", {"prompt": ids(rng, 900)}, **FULL) for i in range(6)]
    after = [turns.turn("after eviction", prefix, **FULL)]
    after.append(turns.turn("recomputed, reused", prefix, **FULL))
    require(after[0].cached_tokens == 0, after[0])  # vLLM did evict it

    over = [t for t in before + after if t.kvindex_tokens > t.cached_tokens]
    wrong = over + [t for t in after if t.kvindex_tokens != t.cached_tokens and t not in over]
    said = [
        f"{t.label}: kvindex still says the engine holds {t.kvindex_tokens} tokens of it"
        f" while vLLM reports {t.cached_tokens} cached"
        for t in wrong
    ]
    TALLY.notes += [f"reuse reports: {s}" for s in said]
    assert not said, "\n".join(said)
