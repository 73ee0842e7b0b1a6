"""SGLang's load as its ``/metrics`` page states it (indexer/engines/sglang/metrics.py).

The page is made by prometheus_client with the gauges and labels SGLang 0.5.23's
scheduler collector declares: one series per scheduler, labelled with its
``tp_rank`` and, running data-parallel ranks, its ``dp_rank``.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from indexer.core.load import EngineLoad
from indexer.engines import catalog

SGLANG = catalog.adapter("sglang")
LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")


def page(series: dict[tuple[int, int | None], tuple[int, int, float]]) -> str:
    """A page with each scheduler's (tp rank, dp rank) running, queued and token usage."""
    registry = CollectorRegistry()
    with_dp = any(dp is not None for _, dp in series)
    names = (*LABELS, "dp_rank") if with_dp else LABELS
    gauges = [
        Gauge(f"sglang:{name}", name, names, registry=registry)
        for name in ("num_running_reqs", "num_queue_reqs", "token_usage")
    ]
    latency = Histogram("sglang:e2e_request_latency_seconds", "e2e", names, registry=registry)
    for (tp, dp), values in series.items():
        labels = ("tiny", "unified", str(tp), "0", "0", *([str(dp)] if with_dp else []))
        for gauge, value in zip(gauges, values, strict=True):
            gauge.labels(*labels).set(value)
        latency.labels(*labels).observe(0.5)
    return generate_latest(registry).decode()


def test_each_data_parallel_rank_is_read_from_its_first_tensor_parallel_worker() -> None:
    text = page({(0, 0): (3, 7, 0.25), (1, 0): (9, 9, 0.9), (0, 1): (0, 2, 0.875)})
    assert SGLANG.load_path == "/metrics"
    assert SGLANG.read_load(text) == {
        0: EngineLoad(running=3, waiting=7, kv_usage=0.25),
        1: EngineLoad(running=0, waiting=2, kv_usage=0.875),
    }


def test_a_server_without_data_parallel_ranks_is_rank_0() -> None:
    assert SGLANG.read_load(page({(0, None): (1, 0, 0.5)})) == {
        0: EngineLoad(running=1, waiting=0, kv_usage=0.5)
    }


def test_a_page_that_is_not_sglangs_is_refused() -> None:
    vllm = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1\n'
    with pytest.raises(ValueError, match="sglang:num_running_reqs"):
        SGLANG.read_load(vllm)
