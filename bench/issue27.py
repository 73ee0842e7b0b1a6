"""Issue 27's table ("the speed a user feels"), row by row.

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
    "Issue 27's table",
    (
        Row("live ingest",
            "live ingest, ZMQ -> applied vs the same batches decoded and applied in process "
            "(sustained / catch-up)", ("3",),
            _picks("3", name="batches/s", baseline="decode + apply in process")),
        Row("whole-process replay vs naive",
            "whole process, `kvindex replay` vs a naive consumer process", ("14",),
            _picks("14", baseline="naive consumer process")),
        Row("replica over HTTP",
            "prefix-match p50 over HTTP on a scale-out replica (`kvindex api --mirror`) vs "
            "embedded (`kvindex serve`), same 32 engines, one keep-alive connection each", ("17",),
            _picks("17", name="--mirror", baseline="same queries")),
        Row("replica over HTTP, reading Redis",
            "the same on a replica reading Redis (`kvindex api`, no goal: what --mirror "
            "replaces)", ("17",),
            _picks("17", name="reading Redis", baseline="same queries")),
        Row("mirror staleness",
            "how stale a mirror's answers are: an engine's new prompt in them, vs in the "
            "embedded server's (no goal)", ("17",),
            _picks("17", name="--mirror`, after its engine publishes")),
        Row("Redis replica staleness", "the same for a replica reading Redis (no goal)", ("17",),
            _picks("17", name="reading Redis, after its engine publishes")),
        Row("at the store",
            "the same at the store, the bench's 64-engine fleet: Redis vs embedded, "
            "64 / 512 blocks (no goal)", ("5",),
            lambda f: _picks("5", name="vs embedded")(f) and "2048-block" not in f.name),
        Row("HTTP by block_hashes",
            "HTTP `/prefix-match` by `block_hashes` vs the bare endpoint, req/s", ("6",),
            _picks("6", name="HTTP GET by block_hashes", unit="req/s")),
        Row("HTTP by tokens", "same, by `tokens`", ("6",),
            _picks("6", name="HTTP GET by tokens", unit="req/s")),
        Row("query growth",
            "query p50 growth, 8 -> 1024 (quick run: 512) engines, 512 blocks", ("8",),
            _picks("8", name="512-block query p50")),
        Row("query vs Dynamo",
            "query p50 vs Dynamo `find_matches`, 64 / 512 / 2048 blocks", ("4",),
            _picks("4", baseline="Dynamo find_matches (binding) p50")),
        Row("query p99 during a burst",
            "query p99 during an ingest burst vs idle", ("13",),
            _picks("13", baseline="same server idle")),
        Row("Redis ingest vs redis-benchmark",
            "Redis exactly-once ingest vs `redis-benchmark -P 64` HINCRBY", ("2",),
            _picks("2", name="ingest, Redis: fleet stream")),
        Row("Redis Cluster vs standalone",
            "Redis Cluster (3 masters) CPU per block-op vs standalone", ("2",),
            _picks("2", name="cluster", baseline="standalone")),
    ),
)  # fmt: skip
