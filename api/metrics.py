"""The API's own Prometheus metrics, and the ``/metrics`` exposition.

The subscriber registers its metrics (events, blocks, gaps, replays, lag...)
in the same default registry, so one scrape of ``/metrics`` shows the whole
process. Metrics are module-level because a registry refuses duplicates:
every app built in one process (tests build many) shares them.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from starlette.responses import Response

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


def metrics_response() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
