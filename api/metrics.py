"""The API's own Prometheus metrics, and the ``/metrics`` exposition.

The subscriber registers its metrics (events, blocks, gaps, replays, lag...)
in the same default registry, so one scrape of ``/metrics`` shows the whole
process. Metrics are module-level because a registry refuses duplicates:
every app built in one process (tests build many) shares them.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from starlette.responses import Response

from api.schemas import PrefixMatchResponse

QUERY_SECONDS = Histogram(
    "kvindex_query_seconds",
    "Time to answer a prefix-match query, by how the prompt was given.",
    ["by"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
STORE_ERRORS = Counter(
    "kvindex_api_store_errors_total",
    "Requests the API answered 503 because the store failed, by error type.",
    ["error"],
)
STORE_SECONDS = Histogram(
    "kvindex_api_store_seconds",
    "Time of each store call the API makes, by store method (failed calls included).",
    ["op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5),
)
# In blocks; the 0 bucket counts the queries no rank holds any of.
_DEPTHS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
HIT_BLOCKS = Histogram(
    "kvindex_prefix_match_hit_blocks",
    "Leading blocks of the prompt held by the best-scoring rank of each prefix-match "
    "answer, by tier (tier=any: on GPU or loadable from a lower tier).",
    ["tier"],
    buckets=_DEPTHS,
)
PROMPT_BLOCKS = Histogram(
    "kvindex_prefix_match_prompt_blocks",
    "Full blocks in each prefix-match prompt (the hit ratio's denominator).",
    buckets=_DEPTHS,
)
_TIERS = (
    (HIT_BLOCKS.labels("GPU"), "gpu_blocks"),
    (HIT_BLOCKS.labels("CPU"), "cpu_blocks"),
    (HIT_BLOCKS.labels("STORAGE"), "storage_blocks"),
    (HIT_BLOCKS.labels("any"), "prefix_blocks"),
)


def observe_answer(answer: PrefixMatchResponse) -> None:
    """Count how deep the rank a router would pick hits, per tier.

    An answer without ranks (no engine selected) says nothing about hits. A row
    pre-encoded (``msgspec.Raw``, see :class:`indexer.query.rows.ZeroRows`) matches nothing.
    """
    if not answer.engines:
        return
    best = answer.engines[0]
    for child, field in _TIERS:
        child.observe(getattr(best, field, 0))
    if answer.num_blocks is not None:
        PROMPT_BLOCKS.observe(answer.num_blocks)


def metrics_response() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
