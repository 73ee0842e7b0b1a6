"""``python -m bench [--quick]``: every benchmark on one synthetic fleet, one report.

Writes ``report.md``, ``report.json`` and the scaling plots (PNG) to
``bench/results/`` (git-ignored; ``--out`` elsewhere). ``--quick`` takes a
couple of minutes on two cores: a smaller fleet (about 290k resident
entries instead of 1M), fewer repeats and requests, no 10M-entry Redis
memory point and no 1024-engine scaling point. A section that fails (say Redis is
missing) is reported as failed; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import (
    burst,
    dynamo,
    e2e,
    http,
    hybrid,
    idle,
    ingest,
    issue27,
    memory,
    plots,
    prompts,
    query,
    redis_bench,
    replicas,
    routed,
    routing,
    scaling,
    snapshots,
    whole_ingest,
)
from bench.fleet import FULL, QUICK, Fleet
from bench.report import Report
from indexer.log import setup_logging
from indexer.stores import MemoryStore

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = tuple(str(item) for item in range(1, 18))


def _section(report: Report, name: str, fn: Callable[[], object]) -> None:
    started = time.monotonic()
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    items = name.split("+")
    report.ran.extend(items)
    try:
        report.details[name] = fn()
    except Exception as e:  # one broken section must not cost the others
        traceback.print_exc()
        report.failed.extend(items)
        report.notes.append(f"section {name} failed: {type(e).__name__}: {e}")
    print(f"[bench] {name} done in {time.monotonic() - started:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a couple of minutes, smaller fleet")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these items")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the report goes")
    parser.add_argument("--profile", action="store_true", help="also write hot-path profiles")
    args = parser.parse_args(argv)
    setup_logging("ERROR")  # the outrun degrades its rank on purpose
    only = set(args.only or SECTIONS)
    quick = args.quick
    report = Report("quick" if quick else "full", issue27.TABLE)
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    fleet = Fleet(QUICK if quick else FULL)
    stream = fleet.stream_of(16) if quick else fleet.stream
    store = MemoryStore()
    asyncio.run(query.load(store, fleet.stream))
    report.details["fleet"] = {
        "config": repr(fleet.config),
        "batches": len(fleet.stream),
        "resident_entries": query.entries(store),
        "ingest_engines": 16 if quick else fleet.config.engines,
        "simulated_in_s": time.monotonic() - started,
    }
    repeats = 3 if quick else 5
    if "1" in only:
        _section(report, "1", lambda: ingest.run(report, stream, repeats))
    if "4" in only:
        _section(report, "4", lambda: query.run(report, fleet, store, 40, 3 if quick else 10))
    if "10" in only:
        _section(report, "10", lambda: hybrid.run(report, fleet, store, 40, 3 if quick else 10))
    if "7" in only:
        _section(report, "7", lambda: memory.run(report, fleet))
    if "8" in only:
        _section(report, "8", lambda: _scaling(report, fleet, store, quick, args.out))
    if "6" in only:
        requests = 1200 if quick else 6000
        profile = args.out / "profile-http.txt" if args.profile else None
        _section(report, "6", lambda: http.run(report, fleet, 8, requests, profile))
    if "3" in only:
        batches, seconds = (3000, 3.0) if quick else (20_000, 5.0)
        _section(report, "3", lambda: e2e.run(report, fleet.stream, batches, seconds))
    if "11" in only:
        _section(report, "11", lambda: prompts.run(report, quick))
    if "12" in only:
        _section(report, "12", lambda: routed.run(report, fleet, store, quick))
    if "13" in only:
        _section(report, "13", lambda: burst.run(report, quick))
    if "14" in only:
        _section(report, "14", lambda: whole_ingest.run(report, quick, repeats))
    if "15" in only:
        _section(report, "15", lambda: snapshots.run(report, quick))
    if "16" in only:
        _section(report, "16", lambda: _routing(report, quick, args.out))
    if "17" in only:
        _section(report, "17", lambda: replicas.run(report, quick))
    if "9" in only:
        _section(report, "9", lambda: idle.run(report, 5.0 if quick else 20.0))
    if only & {"2", "5"} and redis_bench.available():
        _section(report, "2+5", lambda: redis_bench.run(report, fleet, store, quick))
    elif only & {"2", "5"}:
        report.notes.append("items 2 and 5 skipped: redis-server or redis-benchmark not found")
    if args.profile:
        _section(report, "profile", lambda: profiles_run(fleet, store, stream, args.out))
    _notes(report, quick)
    report.figures.sort(key=lambda f: (len(f.section), f.section))  # "2" before "10"
    report.plots[:0] = plots.rows(report.as_dict()["figures"], args.out)  # the issue's first
    md, js = report.write(args.out)
    print(report.markdown())
    print(f"[bench] wrote {md} and {js} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


def profiles_run(fleet: Fleet, store: MemoryStore, stream: list, out: Path) -> list[str]:
    from bench import profiles  # pyinstrument is needed only here

    return profiles.run(fleet, store, stream, out)


def _scaling(report: Report, fleet: Fleet, store: MemoryStore, quick: bool, out: Path) -> dict:
    details = scaling.run(report, fleet, store, full=not quick, queries=20 if quick else 60)
    report.plots.extend(plots.scaling(details, out))
    return details


def _routing(report: Report, quick: bool, out: Path) -> dict:
    """Item 16 (real vLLM servers, minutes), then its plot."""
    details = routing.run(report, quick)
    report.plots.extend(plots.routing(details, out))
    return details


def _notes(report: Report, quick: bool) -> None:
    fleet = report.details["fleet"]
    report.notes.append(
        f"Fleet: {fleet['config']}; {fleet['batches']:,} batches, "
        f"{fleet['resident_entries']:,} resident entries after the run. "
        f"Ingest (item 1) replays the first {fleet['ingest_engines']} engines' stream."
    )
    report.notes.append(
        "Ratios are value / baseline, both measured in this run (medians of repeats); "
        "absolute figures depend on a noisy shared machine."
    )
    if dynamo.available():
        report.notes.append(
            "Dynamo figures go through its Python binding (PyO3): per call, the cost is the "
            "binding's (argument conversion, JSON parsing, building .scores), not its Rust "
            "core's. It indexes one tier per worker (each rank's medium is a worker here) "
            "and refuses stores whose parent it does not hold."
        )
    else:
        report.notes.append("Dynamo baselines skipped: pip install -e '.[bench]'")
    if quick:
        report.notes.append(
            "Quick run: ~290k-entry fleet; Redis memory at 1M entries only (10M in the full run); "
            "scaling up to 512 engines (1024 in the full run)."
        )


if __name__ == "__main__":
    sys.exit(main())
