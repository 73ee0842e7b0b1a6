"""The bench report's issue table: built from the figures of a run, row by row.

A row shows its figures' values, baselines, ratios and goals with met or NOT
met, says "not run" when its item did not run and "failed" when it broke; the
plot of the rows draws from the figures as ``report.json`` holds them.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import plots
from bench.__main__ import _section
from bench.issue27 import TABLE
from bench.report import Figure, Goal, Report, Row, Table, distinct_parts


def _table() -> Table:
    return Table(
        "Issue's table",
        (
            Row("speed", "speed vs floor", ("1",), lambda f: f.baseline == "floor"),
            Row("query", "query vs tree at 64 / 512 blocks", ("4",), lambda f: f.section == "4"),
            Row("memory", "bytes per entry", ("7",), lambda f: f.section == "7"),
        ),
    )


def _report() -> Report:
    report = Report("quick", _table())
    report.ran += ["1", "4"]
    report.add(
        Figure("1", "ingest ops/s", 300.0, "ops/s", "floor", 200.0, Goal(1.0)),
        Figure("1", "ingest ops/s", 300.0, "ops/s", "naive", 100.0, Goal(1.5)),
        Figure("4", "query: 64-block p50", 1.0, "ms", "tree p50", 4.0, Goal(0.5, at_least=False)),
        Figure("4", "query: 512-block p50", 3.0, "ms", "tree p50", 4.0, Goal(0.5, at_least=False)),
    )
    return report


def _lines(report: Report) -> dict[str, str]:
    return {line.split(" | ")[0][2:]: line for line in report.table_lines()[2:]}


def test_rows_pick_their_figures_and_say_met_or_not() -> None:
    report = _report()
    assert [f.row for f in report.figures] == ["speed", "", "query", "query"]
    lines = _lines(report)
    speed = ["300.0 ops/s", "floor: 200.0", "1.5", ">= 1", "met"]
    assert lines["speed vs floor"].split(" | ")[1:6] == speed
    query = lines["query vs tree at 64 / 512 blocks"].split(" | ")
    assert query[1] == "64: 1 / 512: 3 ms"
    assert query[3] == "64: 0.25 / 512: 0.75"
    assert query[5] == "**NOT met** (1 of 2 met)"
    assert "`python -m bench --quick --only 4`" in query[6]


def test_a_row_whose_item_did_not_run_or_failed_says_so() -> None:
    report = _report()
    assert _lines(report)["bytes per entry"].split(" | ")[1] == "not run"
    report.ran.append("7")
    assert _lines(report)["bytes per entry"].split(" | ")[1].startswith("not measured")
    report.failed.append("7")
    assert _lines(report)["bytes per entry"].split(" | ")[1].startswith("failed")


def test_the_report_opens_with_the_table_and_writes_it_to_json(tmp_path: Path) -> None:
    report = _report()
    report.write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Issue's table") < md.index("## Every figure")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["table"] == report.table_lines()
    assert [f["to_goal"] for f in data["figures"]] == [1.5, 2.0, 2.0, 0.5 / 0.75]


def test_the_rows_plot_draws_from_report_json(tmp_path: Path) -> None:
    _report().write(tmp_path)
    figures = json.loads((tmp_path / "report.json").read_text())["figures"]
    assert plots.rows(figures, tmp_path) == ["issue27_rows.png"]
    assert (tmp_path / "issue27_rows.png").read_bytes()[:4] == b"\x89PNG"
    assert plots.rows([dict(f, row="") for f in figures], tmp_path) == []


def test_distinct_parts_keep_what_tells_names_apart() -> None:
    names = ["token hashing, sha256, compiled", "token hashing, sha256_cbor, compiled"]
    assert distinct_parts(names) == ["sha256", "sha256_cbor"]
    assert distinct_parts(["memory: 1M entries", "memory: 10M entries"]) == ["1M", "10M"]
    assert distinct_parts(["one"]) == [""]


#: (section, name, unit, baseline) of figures as bench items make them, and the issue row
#: each lands on ("" for none).
MADE = [
    ("1", "ingest, embedded: block-ops/s, decode + apply", "ops/s",
     "decode floor (typed, every field, no apply)", ""),
    ("3", "end-to-end ZMQ -> applied (sustained): batches/s", "batches/s",
     "decode + apply in process (ceiling)", "live ingest"),
    ("3", "end-to-end ZMQ -> applied (sustained): block-ops/s", "ops/s", None, ""),
    ("4", "query, embedded: 64-block chain p50", "ms", "Dynamo find_matches (binding) p50",
     "query vs Dynamo"),
    ("4", "query, embedded: 64-block chain p99", "ms", "Dynamo find_matches (binding) p99", ""),
    ("4", "query, embedded: 64-block chain p50, reference core", "ms",
     "Dynamo find_matches (binding) p50", ""),
    ("5", "query, Redis store vs embedded: 512-block chain p50", "ms",
     "the embedded store, same residency: p50", "at the store"),
    ("5", "query, Redis store vs embedded: 2048-block chain p50", "ms",
     "the embedded store, same residency: p50", ""),
    ("5", "query, Redis: 64-block chain p50", "ms", "64 pipelined HGETALL p50", ""),
    ("6", "HTTP GET by tokens, 8k tokens, c=8: req/s", "req/s", "bare endpoint, same server",
     "HTTP by tokens"),
    ("6", "HTTP GET by tokens, 8k tokens, c=8: p50", "ms", "bare endpoint p50", ""),
    ("7", "memory, embedded: 1M entries, 64 engines", "B/entry", "the goal, 48 B/entry", ""),
    ("17", "HTTP POST /prefix-match by tokens, 64 blocks, 32 engines: `kvindex api --mirror`, "
     "p50", "ms", "`kvindex serve` (embedded), same queries: p50", "replica over HTTP"),
    ("17", "HTTP POST /prefix-match by tokens, 64 blocks, 32 engines: `kvindex api` reading "
     "Redis, p50", "ms", "`kvindex serve` (embedded), same queries: p50",
     "replica over HTTP, reading Redis"),
    ("17", "a new prompt's blocks in the answers of `kvindex api --mirror`, after its engine "
     "publishes them: p50", "ms", "`kvindex serve` (embedded): p50", "mirror staleness"),
    ("2", "ingest, Redis Cluster (3 masters): fleet stream, Redis CPU per block-op", "us",
     "standalone Redis, same stream", "Redis Cluster vs standalone"),
    ("2", "ingest, Redis: bulk load (4096-hash events), block-ops/s", "ops/s",
     "redis-benchmark -P 64 HINCRBY", ""),
]  # fmt: skip


def test_issue_27_rows_pick_the_figures_the_bench_makes() -> None:
    rows = [TABLE.row_of(Figure(s, name, 1.0, unit, base, 1.0)) for s, name, unit, base, _ in MADE]
    assert rows == [row for *_, row in MADE]


def test_a_failing_item_is_reported_failed_and_the_others_still_run() -> None:
    report = _report()

    def broken() -> None:
        raise RuntimeError("no redis-server")

    _section(report, "7", broken)
    _section(report, "2+5", dict)
    assert report.ran[-3:] == ["7", "2", "5"] and report.failed == ["7"]
    assert _lines(report)["bytes per entry"].split(" | ")[1] == "failed (see notes)"
    assert report.details["2+5"] == {} and "section 7 failed" in report.notes[-1]
