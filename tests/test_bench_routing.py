"""Item 16's workloads and the timed engine's step model: a trace replays by whole
sessions with its reuse bound, rates scale arrival times, and a step's modelled time
follows the formula its module writes out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.routing import mooncake
from bench.routing.fleet import TIMED_ENGINE
from bench.routing.tables import SHOWN, verdict
from bench.routing.traffic import at_rate, chats, shared_prefix


def _step_model():
    path = TIMED_ENGINE / "timed_engine/step_model.py"
    spec = importlib.util.spec_from_file_location("step_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def session(prompt: str, seconds: dict[int, int]) -> int:
    """Which of the sessions (by second id) a replayed prompt is of."""
    first = mooncake.block_text(0)
    return next(i for i in seconds if prompt.startswith(first + mooncake.block_text(i, 1)))


def test_a_trace_replays_whole_sessions_with_their_reuse_bound(tmp_path: Path) -> None:
    rows = [  # sessions (first two ids): (0, 1) three turns, (0, 5) one, (0, 7) two
        {"timestamp": 0, "input_length": 1500, "output_length": 160, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 600, "output_length": 16, "hash_ids": [0, 5]},
        {"timestamp": 2000, "input_length": 2000, "output_length": 32, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 32, "hash_ids": [0, 7]},
        {"timestamp": 5000, "input_length": 2100, "output_length": 32, "hash_ids": [0, 1, 2, 3, 4]},
        {"timestamp": 9000, "input_length": 1536, "output_length": 32, "hash_ids": [0, 7, 8]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = mooncake.sample(trace, requests=len(rows))
    assert len(whole) == 6 and whole.about["sessions"] == 3
    # 19 block references to 8 distinct ids: 11 could be served from a cache
    assert whole.about["reuse_bound"] == round(11 / 19, 3)
    times = [r.at for r in whole.requests]
    assert times == sorted(times) and times[0] == 0 and times[-1] == pytest.approx(5)
    first, again = whole.requests[0], whole.requests[2]  # session (0, 1)'s turns
    assert again.messages[0]["content"].startswith(first.messages[0]["content"][:-1])
    assert first.max_tokens == 160 // mooncake.SCALE
    sizes = {1: 3, 5: 1, 7: 2}  # each session's requests, by its second id
    for n in range(1, 6):  # never part of a session
        sampled = mooncake.sample(trace, requests=n, seed=n)
        second = [session(r.messages[0]["content"], sizes) for r in sampled.requests]
        assert all(second.count(i) == sizes[i] for i in set(second)), (n, second)


def test_rates_scale_the_same_requests() -> None:
    load = shared_prefix(engines=2)
    fast = at_rate(load, 4.0)
    assert [r.messages for r in fast.requests] == [r.messages for r in load.requests]
    assert [r.at for r in fast.requests] == [r.at / 4 for r in load.requests]
    assert len({r.messages[0]["content"] for r in load.requests}) == 2 * 4  # groups
    mixed = chats(20, 5)
    burst = [r for r in mixed.requests if r.key.startswith("burst/")]
    assert len(burst) == 5 and len({r.at for r in burst}) == 1  # the agents come at once


def test_the_step_model_is_the_formula_it_writes_out() -> None:
    model = _step_model()
    assert pytest.approx(5.99e-3, rel=1e-3) == model.FIXED_S
    assert pytest.approx(32.5e-6, rel=1e-3) == model.PER_TOKEN_S
    assert pytest.approx(48.9e-9, rel=1e-3) == model.PER_CONTEXT_TOKEN_S
    # a 1,000-token prefill, then two sequences decoding at 1,000 and 300 tokens of context
    assert model.context(list(range(1000))) == 999
    assert model.context([1000, 300]) == 1300
    prefill = model.FIXED_S + 1000 * model.PER_TOKEN_S + 999 * model.PER_CONTEXT_TOKEN_S
    assert model.step_seconds(list(range(1000))) == pytest.approx(prefill)
    assert 0.035 < prefill < 0.045  # about 38 ms, as the docstring says


def test_the_verdict_holds_kvindex_to_the_issues_bar() -> None:
    def row(policy: str, run: int, hit: float, p90: float, p99: float) -> dict:
        figures = dict.fromkeys((k for k, *_ in SHOWN), 0.0) | {"hit_rate": hit, "ttft_p90_ms": p90}
        return {"workload": "w", "rate": 2.0, "policy": policy, "run": run,
                "requests_per_engine": {"e0": 1}} | figures | {"ttft_p99_ms": p99}  # fmt: skip

    def verdict_of(rows: list[dict]) -> str:
        return verdict(rows)[2]  # the table's one row

    peer = [row("smg cache_aware", 1, 0.5, 900, 1500), row("smg cache_aware", 2, 0.5, 700, 1500)]
    wins = [row("kvindex", 1, 0.6, 650, 1400), row("kvindex", 2, 0.6, 690, 1500)]
    assert verdict_of(peer + wins).endswith("| hits, p90, p99 |")
    # a better mean p90 whose worst run is not better than the peer's best run misses it
    close = [row("kvindex", 1, 0.6, 500, 1400), row("kvindex", 2, 0.6, 750, 1500)]
    assert verdict_of(peer + close).endswith("| hits, p99 |")
