"""SGLang's load as its server's ``/metrics`` states it, per data-parallel rank.

SGLang 0.5.23's scheduler gauges: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs`` (requests waiting) and ``sglang:token_usage`` (the
fraction of KV token slots in use, 0..1), labelled with ``dp_rank`` when the
server runs data-parallel ranks (no label: rank 0) and with ``tp_rank``: each
rank's first tensor-parallel worker speaks for it. The capacity it states,
``sglang:max_total_num_tokens``, is in tokens, not pages: left unsaid here, as
the token usage already says how full the cache is.

The scheduler sets them at each prefill, every ``--decode-log-interval`` decode
steps (40) and when it falls idle. The token usage is rounded to two decimals,
and counts what the radix cache holds but could evict as free: an idle server
states 0, however much it has cached.
"""

from __future__ import annotations

from indexer.core.load import EngineLoad

PATH = "/metrics"
_FIELDS = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}
_WANTED = tuple(_FIELDS)


def read_load(text: str) -> dict[int, EngineLoad]:
    """Each rank's load on the page; ValueError for a page that is not Prometheus text
    or states none of it (not an SGLang server)."""
    # imported here: the adapters load in producers, which install no server dependency
    from prometheus_client.parser import text_string_to_metric_families

    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    ranks: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name not in _FIELDS or sample.labels.get("tp_rank", "0") != "0":
                continue
            rank = int(sample.labels.get("dp_rank") or 0)
            ranks.setdefault(rank, {})[_FIELDS[sample.name]] = float(sample.value)
    if not any(set(fields) & {"running", "waiting"} for fields in ranks.values()):
        raise ValueError("no sglang:num_running_reqs or sglang:num_queue_reqs on the page")
    return {rank: EngineLoad(**fields) for rank, fields in ranks.items()}
