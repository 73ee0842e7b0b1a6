"""vLLM's load as its OpenAI server's ``/metrics`` states it, per data-parallel rank:
shared by the adapters of every vLLM release that names its gauges so.

vLLM's Prometheus gauges carry the rank in the label ``engine`` ("0", "1"...):
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (requests the
scheduler holds), ``vllm:kv_cache_usage_perc`` (the fraction of KV blocks in
use, 0..1), and ``vllm:cache_config_info`` (an info gauge whose label
``num_gpu_blocks`` is the cache's capacity). The page is tens of kilobytes of
histograms a pick needs none of, so only those lines are handed to the parser.
"""

from __future__ import annotations

from indexer.core.load import EngineLoad

PATH = "/metrics"
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_USAGE = "vllm:kv_cache_usage_perc"
_CACHE = "vllm:cache_config_info"
_WANTED = (_RUNNING, _WAITING, _USAGE, _CACHE)
_FIELDS = {_RUNNING: "running", _WAITING: "waiting", _USAGE: "kv_usage"}


def read_load(text: str) -> dict[int, EngineLoad]:
    """Each rank's load on the page; ValueError for a page that is not Prometheus text
    or states none of it (not a vLLM server)."""
    # imported here: the adapters load in producers, which install no server dependency
    from prometheus_client.parser import text_string_to_metric_families

    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    ranks: dict[int, dict[str, float | int]] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            rank = int(sample.labels.get("engine", "0"))
            fields = ranks.setdefault(rank, {})
            if sample.name in _FIELDS:
                fields[_FIELDS[sample.name]] = float(sample.value)
            elif sample.name == _CACHE and sample.labels.get("num_gpu_blocks", "").isdigit():
                fields["capacity"] = int(sample.labels["num_gpu_blocks"])
    if not any(set(fields) & {"running", "waiting"} for fields in ranks.values()):
        raise ValueError("no vllm:num_requests_running or _waiting on the page")
    return {rank: EngineLoad(**fields) for rank, fields in ranks.items()}
