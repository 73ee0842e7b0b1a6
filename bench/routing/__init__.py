"""Item 16: routing on a fleet that keeps GPU time. The same requests at the same times
(:mod:`bench.routing.traffic`, :mod:`bench.routing.mooncake`) through each routing policy in
front of 4 (``--quick``) or 8 timed engines (``bench/routing/timed_engine``: a real CPU ``vllm
serve`` whose forward pass sleeps for the step time of Llama 3.1 8B on an H100, times
:data:`~bench.routing.fleet.SCALE`) with small KV caches, so where a request lands decides
whether its prefix is still cached and how long it queues.

Policies, each run from cold caches (every engine's prefix cache reset, a fresh router
process): vllm-router 0.1.17 ``round_robin``, ``cache_aware`` and ``kv_aware`` (it follows
the engines' KV events itself), smg 1.13.0 ``cache_aware``, and kvindex: a fresh ``kvindex
serve`` following the engines' events, behind a thin proxy that asks ``POST /prefix-match``
with ``route: "best"`` and streams the request to the engine it names. :data:`VARIANTS` are
kvindex's ``api.load`` sections (the load-aware pick, the prefix-only ablation);
``--variant`` adds more.

Workloads: Mooncake's conversation trace (whole sessions sampled, time compressed; ``--trace``
takes any file in its format), llm-d's shared-prefix shape scaled to the fleet, and chats
with an agent burst; each at every rate of the load ladder (``--rates``), ``--runs`` times.
Quick: the ladder on the trace, the other two at its middle rate, one run each.

Per run, from each engine's own ``/metrics`` (the one account every policy is judged by):
the fleet's prefix-cache hit rate (hit tokens / queried tokens) and requests per engine;
from the client: TTFT and end-to-end latency percentiles, output tokens a second; from the
timed engines: the self-check (modelled vs measured step time, CPU per engine).

Run alone: ``python -m bench.routing [--quick] [--trace PATH] [--json OUT]`` (logs under
/tmp/routing-bench/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import plots
from bench.report import Figure, Goal, Report
from bench.routing import mooncake, tables, traffic
from bench.routing.fleet import SCALE, Fleet, Kvindex, Server, Smg, VllmRouter, progress
from bench.routing.fleet import routers_venv as routers
from bench.routing.proxy import Proxy
from bench.routing.traffic import Workload, at_rate

SECTION = "16"
LOGS = Path("/tmp/routing-bench")
RUNS = "runs.jsonl"  # in the logs: the setting, then each run's row and self-check
CACHE = "3M"  # 96 blocks of 32 tokens per engine
#: kvindex's ``api.load`` per variant; the first is the one the goals are about
VARIANTS: dict[str, dict] = {
    "kvindex": {"enabled": True},
    "kvindex prefix-only": {"enabled": False},
}
#: the peers: (policy name, router, router policy)
PEERS = (
    ("round_robin", VllmRouter, "round_robin"),
    ("vllm-router cache_aware", VllmRouter, "cache_aware"),
    ("vllm-router kv_aware", VllmRouter, "kv_aware"),
    ("smg cache_aware", Smg, "cache_aware"),
)
#: the load ladder, requests a second per engine: up to where round robin saturates
LADDER = (0.5, 1.0, 1.5)
#: requests a run (trace, shared-prefix questions a user, chats and burst), quick and full;
#: quick's trace is 36 requests (20 whole sessions) so that the quick item, 30 runs, fits
#: in 15 minutes with the fleet's start
QUICK = {"engines": 4, "trace": 36, "questions": 1, "chats": (40, 8), "runs": 1}
FULL = {"engines": 8, "trace": 160, "questions": 2, "chats": (128, 16), "runs": 3}


def workloads(size: dict, trace: Path) -> dict[str, Workload]:
    """The three workloads at one request a second."""
    return {
        "trace": mooncake.sample(trace, size["trace"]),
        "shared-prefix": traffic.shared_prefix(size["engines"], size["questions"]),
        "chats": traffic.chats(*size["chats"]),
    }


class Bench:
    """The fleet, the routers' venv, and the rows measured so far."""

    def __init__(self, engines: int, logs: Path) -> None:
        self.logs = logs
        self.fleet = Fleet(logs, engines, CACHE)
        self.venv = routers()
        self.rows: list[dict] = []
        self.checks: list[dict] = []

    def measure(self, router: Server, launch: Callable[[], None], workload: Workload) -> dict:
        """One pass of ``workload`` through ``router`` (launched after the reset)."""
        before, steps = self.fleet.counters(), self.fleet.steps()
        launch()
        started = time.monotonic()
        samples = traffic.run(f"{router.url}/v1/chat/completions", workload)
        wall = time.monotonic() - started
        time.sleep(1.5)  # the last counters, and a step account written after the last step
        row = tables.row(before, self.fleet.counters(), samples, wall)
        return row | {"self_check": tables.self_check(steps, self.fleet.steps(), wall)}

    def peer(self, kind: type, policy: str, workload: Workload) -> dict:
        self.fleet.reset()
        router = kind(self.logs, self.venv, policy, self.fleet.engines)
        try:
            return self.measure(router, router.launch, workload)
        finally:
            router.stop()

    def kvindex(self, name: str, load: dict, workload: Workload) -> dict:
        self.fleet.reset()
        slug = name.replace(" ", "-")
        index = Kvindex(self.logs, slug, self.fleet, load)
        proxy = Proxy(self.logs, f"proxy-{slug}", index, self.fleet)
        try:
            row = self.measure(proxy, lambda: self.launch(index, proxy), workload)
            return row | {"proxy": proxy.stats(), "routed": index.routed()}
        finally:
            proxy.stop()
            index.stop()

    def launch(self, index: Kvindex, proxy: Proxy) -> None:
        proxy.spawn()  # it starts while kvindex does: it asks kvindex only once requests come
        index.launch()
        ranks = index.settled()
        warm = {n: r["blocks"]["GPU"] for n, r in ranks.items() if r["blocks"]["GPU"]}
        if warm or not all(r["connected"] for r in ranks.values()):
            progress(f"kvindex not cold at the start: GPU blocks {warm}, ranks {ranks}")
        index.prefix_match([{"role": "user", "content": "hello"}])  # its tokenizer is loaded
        proxy.wait_ready()

    def policies(self, variants: dict[str, dict], only: set[str] | None) -> dict[str, Callable]:
        """Each policy's run of a workload."""
        out: dict[str, Callable[[Workload], dict]] = {}
        for name, kind, policy in PEERS:
            out[name] = lambda w, k=kind, p=policy: self.peer(k, p, w)
        for name, load in variants.items():
            out[name] = lambda w, n=name, lo=load: self.kvindex(n, lo, w)
        return {n: f for n, f in out.items() if only is None or n in only}

    def run(self, policy: str, measure: Callable[[Workload], dict], workload: Workload,
            rate: float, run: int) -> None:  # fmt: skip
        """One policy's run at ``rate``: a row, and its self-check."""
        key = {"policy": policy, "run": run, "rate": rate, "workload": workload.name}
        progress(f"{workload.name} at {rate:g} req/s, run {run}: {policy} ...")
        started = time.monotonic()
        try:
            result = measure(at_rate(workload, rate))
            result["run_s"] = time.monotonic() - started  # with the reset, launch and stop
        except Exception as e:  # one failing router must not cost the others their rows
            progress(f"{policy} FAILED: {type(e).__name__}: {e}")
            self.rows.append(key | {"failed": f"{type(e).__name__}: {e}"})
            return
        check = result.pop("self_check")
        self.rows.append(key | result)
        self.checks.append(key | {"engines": check})
        with (self.logs / RUNS).open("a") as runs:  # kept as it goes: a stopped run keeps them
            runs.write(json.dumps({"row": self.rows[-1], "check": self.checks[-1]}) + "\n")
        progress(
            f"{policy}: hit rate {result['hit_rate']:.3f}, TTFT p50/p90/p99 "
            f"{result['ttft_p50_ms']:.0f}/{result['ttft_p90_ms']:.0f}/"
            f"{result['ttft_p99_ms']:.0f} ms, {result['output_tokens_per_s']:.0f} tok/s, "
            f"per engine {list(result['requests_per_engine'].values())}, {result['run_s']:.0f} s"
            + (f", {len(result['errors'])} errors" if result["errors"] else "")
        )


def plan(
    quick: bool, rates: tuple[float, ...], runs: int, names: list[str]
) -> list[tuple[str, float, int]]:
    """(workload, rate, run) in the order they run: runs outermost, so a slow moment of the
    shared machine hits one run of everything rather than every run of one thing."""
    middle = rates[len(rates) // 2]
    steps = []
    for run in range(1, runs + 1):
        for name in names:
            ladder = rates if not quick or name == "trace" else (middle,)
            steps += [(name, rate, run) for rate in ladder]
    return steps


def run(report: Report, quick: bool, trace: Path = mooncake.TRACE,
        variants: dict | None = None, only: set[str] | None = None, logs: Path = LOGS,
        rates: tuple[float, ...] | None = None, runs: int | None = None,
        names: list[str] | None = None) -> dict:  # fmt: skip
    """The item: every workload, rate, run and policy; figures into ``report``."""
    variants = variants or VARIANTS
    size = QUICK if quick else FULL
    rates = rates or tuple(r * size["engines"] for r in LADDER)
    runs = runs or size["runs"]
    logs.mkdir(parents=True, exist_ok=True)
    loads = workloads(size, trace)
    names = names or list(loads)
    details: dict = {
        "engines": size["engines"], "cache": CACHE, "scale": SCALE, "rates": rates,
        "workloads": {n: loads[n].about | {"requests": len(loads[n])} for n in names},
    }  # fmt: skip
    started = time.monotonic()
    bench = Bench(size["engines"], logs)
    (logs / RUNS).write_text(json.dumps({"setting": details}) + "\n")
    try:
        bench.fleet.start()
        measures = bench.policies(variants, only)
        for name, rate, number in plan(quick, rates, runs, names):
            for policy, measure in measures.items():
                bench.run(policy, measure, loads[name], rate, number)
    finally:
        bench.fleet.stop()
    details = completed(details, bench.rows, bench.checks, time.monotonic() - started)
    report.add(*figures(bench.rows, next(iter(variants))))
    report.notes.append(_note(details))
    return details


def completed(setting: dict, rows: list[dict], checks: list[dict], wall: float) -> dict:
    return setting | {
        "rows": rows,
        "self_check": checks,
        "table": tables.table(rows),
        "check_table": tables.check_table(checks),
        "wall_s": wall,
    }


def recorded(files: list[Path]) -> dict:
    """The details of the runs recorded in ``files`` (logs' ``runs.jsonl``, each a setting
    then its runs), the first file's setting; wall time: the runs' own."""
    setting, rows, checks = None, [], []
    for path in files:
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            setting = setting or entry.get("setting")
            if "row" in entry:
                rows.append(entry["row"])
                checks.append(entry["check"])
    assert setting is not None, f"no setting in {files}"
    return completed(setting, rows, checks, sum(r.get("wall_s", 0) for r in rows))


#: (key, label, unit, the best peer's is the max (True) or the min, goal)
FIGURES = (
    ("hit_rate", "prefix-cache hit rate", "", True, Goal(1.0)),
    ("ttft_p90_ms", "TTFT p90", "ms", False, Goal(1.0, at_least=False)),
    ("ttft_p99_ms", "TTFT p99", "ms", False, Goal(1.0, at_least=False)),
)


def figures(rows: list[dict], goals_for: str) -> list[Figure]:
    """Per workload and rate, the mean over runs of each kvindex variant's figures against
    the best peer's."""
    means = tables.aggregate(rows)
    out = []
    for (workload, rate, policy), row in means.items():
        if not policy.startswith("kvindex"):
            continue
        peers = {p: r for (w, r_, p), r in means.items()
                 if w == workload and r_ == rate and not p.startswith("kvindex")}  # fmt: skip
        for key, label, unit, higher, goal in FIGURES:
            name = f"routing, {workload} at {rate:g} req/s, {policy}: {label}"
            if not peers:
                out.append(Figure(SECTION, name, row[key][0], unit))
                continue
            best = (max if higher else min)(peers, key=lambda p, k=key: peers[p][k][0])
            kept = goal if policy == goals_for else None
            out.append(Figure(SECTION, name, row[key][0], unit, f"best peer ({best})",
                              peers[best][key][0], kept))  # fmt: skip
    return out


def _note(details: dict) -> str:
    return (
        f"Item 16: {details['engines']} timed engines (vllm serve, {details['cache']} KV cache "
        f"each, time scale {details['scale']:g}); hit rate and requests per engine from each "
        "engine's /metrics, latencies from the client. Mean (min-max) over runs:\n\n"
        + "\n".join(details["table"])
        + "\n\nThe timed engines' self-check:\n\n"
        + "\n".join(details["check_table"])
    )


def _variant(text: str) -> tuple[str, dict]:
    name, _, load = text.partition("=")
    return f"kvindex {name}", json.loads(load)


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        "python -m bench.routing", description=__doc__, formatter_class=raw
    )
    parser.add_argument("--quick", action="store_true", help="4 engines, one run, short runs")
    parser.add_argument("--trace", type=Path, default=mooncake.TRACE,
                        help="a trace in Mooncake's format (default: the shared one)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write one row per policy and run here")
    parser.add_argument("--workload", action="append", choices=("trace", "shared-prefix", "chats"),
                        help="only these workloads (repeatable)")  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="+", help="the ladder (requests a second)")
    parser.add_argument("--runs", type=int, help="runs of each policy at each rate")
    parser.add_argument("--variant", action="append", type=_variant, default=[],
                        metavar="NAME=JSON", help="another kvindex api.load, e.g. "
                        "'per_block-2={\"per_block\": 2}' (repeatable)")  # fmt: skip
    parser.add_argument("--only", nargs="+", help="only these policies (names as in the table)")
    parser.add_argument("--logs", type=Path, default=LOGS)
    parser.add_argument("--out", type=Path, help="routing.md and its plot here (default: --logs)")
    parser.add_argument("--recorded", type=Path, nargs="+", metavar="RUNS",
                        help="measure nothing: the report of runs recorded in these "
                        f"{RUNS} (one file a round of runs)")  # fmt: skip
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers go in finally
    report = Report("quick" if args.quick else "full")
    variants = VARIANTS | dict(args.variant)
    only = set(args.only) if args.only else None
    rates = tuple(args.rates) if args.rates else None
    if args.recorded:
        details = recorded(args.recorded)
        report.add(*figures(details["rows"], next(iter(variants))))
    else:
        with contextlib.redirect_stdout(sys.stderr):
            details = run(report, args.quick, args.trace, variants, only, args.logs, rates,
                          args.runs, args.workload)  # fmt: skip
        (args.logs / "routing.json").write_text(json.dumps(details, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(details["rows"], indent=1))
    out = args.out or args.logs
    out.mkdir(parents=True, exist_ok=True)
    report.plots.extend(plots.routing(details, out))
    command = "python -m bench.routing " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "routing.md").write_text(tables.document(details, command))
    print("\n".join(details["table"]))
    print("\n".join(details["check_table"]))
    print(report.markdown())
    return 0
