"""Issue 16's table ("a compiled core: ahead of Dynamo on every hot path"), row by row.

Each row is the issue's words, the bench items that measure it and which of
their figures are its own; the goal is the figure's (set where the figure is
made, to the issue's value). ``report.md`` opens with this table, built from
the figures of the run, so a row whose item did not run reads "not run".
"""

from __future__ import annotations

from collections.abc import Callable

from bench.report import Figure, Row, Table


def _picks(section: str, name: str = "", baseline: str = "", unit: str = "") -> Callable:
    """The figures of ``section`` whose name and baseline hold ``name`` and ``baseline`` (in
    any case), in ``unit``; never a reference-core figure (a row's "before")."""

    def picks(f: Figure) -> bool:
        return (
            f.section == section
            and name.lower() in f.name.lower()
            and "reference core" not in f.name
            and baseline.lower() in (f.baseline or "").lower()
            and f.unit.startswith(unit)
        )

    return picks


TABLE = Table(
    "Issue 16's table",
    (
        Row("embedded ingest vs decode",
            "ingest, embedded, decode + apply vs typed decode of every field (no apply)", ("1",),
            _picks("1", baseline="decode floor (typed, every field")),
        Row("whole-process replay vs naive",
            "ingest, whole process: `kvindex replay` of a single-engine vLLM-granularity trace "
            "vs a naive consumer (untyped msgspec decode + a dict of counts)", ("14",),
            _picks("14", baseline="naive consumer process")),
        Row("query vs Dynamo",
            "query, embedded, p50 vs Dynamo `RadixTree.find_matches` (binding), "
            "64 / 512 / 2048 blocks, 64 engines", ("4",),
            _picks("4", baseline="Dynamo find_matches (binding) p50")),
        Row("query growth",
            "query cost growth, 512-block p50 at 512 (full run: 1024) engines vs 8 engines", ("8",),
            _picks("8", name="512-block query p50")),
        Row("HTTP by block_hashes",
            "HTTP GET `/prefix-match` by `block_hashes`, 8k tokens, 64 engines, c=8, req/s "
            "vs the bare endpoint", ("6",),
            _picks("6", name="HTTP GET by block_hashes", unit="req/s")),
        Row("HTTP by tokens", "same, by `tokens` (sha256)", ("6",),
            _picks("6", name="HTTP GET by tokens", unit="req/s")),
        Row("token hashing",
            "token hashing, sha256 / sha256_cbor / xxhash / xxhash_cbor, us per 1k tokens, "
            "vs the pure-Python reference: each >= 5x faster (ratio <= 0.2)", ("6",),
            _picks("6", name="token hashing")),
        Row("query p99 during a burst",
            "query p99 in `kvindex serve` while one engine's ingest burst is applied, vs the same "
            "server idle; 64-block POST prefix-match every 20 ms", ("13",),
            _picks("13", baseline="same server idle")),
        Row("memory per entry",
            "memory, embedded, bytes per resident entry at 1M and at 10M entries, "
            "vs 48 B", ("7",),
            _picks("7", baseline="the goal")),
        Row("Redis ingest vs redis-benchmark",
            "ingest, Redis, exactly-once, fleet stream vs `redis-benchmark -P 64` HINCRBY", ("2",),
            _picks("2", name="ingest, Redis: fleet stream")),
        Row("Redis Cluster vs standalone",
            "ingest, Redis Cluster (3 masters) vs standalone: Redis CPU-seconds per block-op",
            ("2",), _picks("2", name="cluster", baseline="standalone")),
    ),
)  # fmt: skip
