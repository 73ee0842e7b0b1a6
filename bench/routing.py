"""Item 16: routing on a real fleet. The same workload (:mod:`bench.routing_workload`) through
each routing policy in front of 3 (``--quick``) or 4 real CPU ``vllm serve`` with small KV
caches, so where a request lands decides whether its prefix is still cached.

Policies, each from cold caches (every engine's prefix cache reset, a fresh router process):
vllm-router 0.1.17 ``round_robin``, ``cache_aware`` and ``kv_aware`` (it follows the engines'
KV events itself), smg 1.13.0 ``cache_aware``, and kvindex: a fresh ``kvindex serve``
following the engines' events, behind a thin proxy that asks ``POST /prefix-match`` with
``route: "best"`` and streams the request to the engine it names. :data:`VARIANTS` are
kvindex's ``api.load`` sections, one a line (the load-aware pick, the prefix-only
ablation); ``--variant`` adds more from the command line.

Per policy, from each engine's own ``/metrics`` (the one account every policy is judged
by): the fleet's prefix-cache hit rate (hit tokens / queried tokens, deltas over the run)
and load imbalance (the busiest engine's finished requests over the mean); from the client:
TTFT p50 and p99 (sending to the first streamed content chunk, the router's own time
included). kvindex's rows carry the ratio to the best peer of the same run.

``--restarts N`` then runs one kvindex variant N times in one kvindex process, every vLLM
server restarted (same ports, same engine names) between runs, and reports each run with
what kvindex said about the engines before it: state carried over a restart shows there.

Run alone: ``python -m bench.routing [--quick]`` (logs under /tmp/routing-bench/).
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
from bench import routing_workload as workload_mod
from bench.measure import quantile
from bench.report import Figure, Goal, Report
from bench.routing_fleet import (
    COUNTERS,
    Fleet,
    Kvindex,
    Server,
    Smg,
    VllmRouter,
    progress,
    routers_venv,
)
from bench.routing_proxy import Proxy

SECTION = "16"
LOGS = Path("/tmp/routing-bench")
CACHE = "3M"  # 96 blocks of 32 tokens per engine
#: kvindex's ``api.load`` per variant; the first is the one the goals are about
VARIANTS: dict[str, dict] = {
    "kvindex": {"enabled": True},
    "kvindex prefix-only": {"enabled": False},
}
#: the variant ``--restarts`` runs (a user saw its hit rate fall run after run)
RESTARTED = "kvindex prefix-only"
#: the peers: (policy name, router, router policy)
PEERS = (
    ("vllm-router round_robin", VllmRouter, "round_robin"),
    ("vllm-router cache_aware", VllmRouter, "cache_aware"),
    ("vllm-router kv_aware", VllmRouter, "kv_aware"),
    ("smg cache_aware", Smg, "cache_aware"),
)
HITS, QUERIES, DONE = COUNTERS


def summary(before: dict, after: dict, samples: list, wall: float) -> dict:
    """One policy's figures from the engines' counters and the client's samples."""
    delta = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in after}
    hits = sum(d[HITS] for d in delta.values())
    queries = sum(d[QUERIES] for d in delta.values())
    served = {e: int(d[DONE]) for e, d in delta.items()}
    mean = sum(served.values()) / len(served)
    ttfts = [s.ttft * 1000 for s in samples if s.ttft is not None and not s.error]
    prompt = sum(s.prompt_tokens for s in samples)
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "imbalance": max(served.values()) / mean if mean else float("nan"),
        "requests_per_engine": served,
        "requests": len(samples),
        "errors": [f"{s.key}: {s.error}" for s in samples if s.error][:10],
        "no_content": sum(1 for s in samples if s.ttft is None and not s.error),
        "client_cached_share": sum(s.cached_tokens for s in samples) / prompt if prompt else 0,
        "wall_s": wall,
        "samples": [(s.key, s.ttft and round(s.ttft * 1000), s.cached_tokens) for s in samples],
    }


class Bench:
    """The fleet and the workload, with the runs measured so far."""

    def __init__(self, quick: bool, logs: Path) -> None:
        self.logs = logs
        self.concurrency = 3 if quick else 4
        chats, burst = (96, 10) if quick else (160, 16)
        self.workload = workload_mod.build(chats, burst)
        self.fleet = Fleet(logs, 3 if quick else 4, CACHE)
        self.venv: Path | None = None
        self.rows: dict[str, dict] = {}

    def measure(self, router: Server, launch: Callable[[], None]) -> dict:
        """One pass of the workload through ``router`` (launched after the reset), its figures."""
        before = self.fleet.counters()
        launch()
        started = time.monotonic()
        url = f"{router.url}/v1/chat/completions"
        samples = workload_mod.run(url, self.workload, self.concurrency)
        wall = time.monotonic() - started
        time.sleep(0.5)  # the last requests' counters
        return summary(before, self.fleet.counters(), samples, wall)

    def peer(self, kind: type, policy: str) -> dict:
        self.fleet.reset()
        router = kind(self.logs, self.venv, policy, self.fleet.engines)
        try:
            return self.measure(router, router.launch)
        finally:
            router.stop()

    def kvindex(self, name: str, load: dict | None) -> dict:
        self.fleet.reset()
        slug = name.replace(" ", "-")
        index = Kvindex(self.logs, slug, self.fleet, load)
        proxy = Proxy(self.logs, f"proxy-{slug}", index, self.fleet)
        try:
            row = self.measure(proxy, lambda: self.launch(index, proxy))
            row["proxy"] = proxy.stats()
            row["kvindex_view"] = self.view(index)
            return row
        finally:
            proxy.stop()
            index.stop()

    def launch(self, index: Kvindex, proxy: Proxy) -> None:
        index.launch()
        ranks = index.settled()
        warm = {n: r["blocks"]["GPU"] for n, r in ranks.items() if r["blocks"]["GPU"]}
        if warm or not all(r["connected"] for r in ranks.values()):
            progress(f"kvindex not cold at the start: GPU blocks {warm}, ranks {ranks}")
        index.prefix_match([{"role": "user", "content": "hello"}])  # its tokenizer is loaded
        proxy.launch()

    def view(self, index: Kvindex) -> dict:
        """What kvindex holds per engine for the workload's last chat prompt (its GPU prefix
        there, in blocks) and its account of each engine."""
        last = list(self.workload.chats[-1].messages)
        answer = index.prefix_match(last)
        return {
            "prefix_match_last_chat": answer,
            "engines": {n: index.engine(n) for n in index.names},
        }

    def policy(self, name: str, run: Callable[[], dict]) -> None:
        progress(f"policy {name} ...")
        try:
            self.rows[name] = run()
        except Exception as e:  # one failing router must not cost the others their rows
            progress(f"policy {name} FAILED: {type(e).__name__}: {e}")
            self.rows[name] = {"failed": f"{type(e).__name__}: {e}"}
            return
        row = self.rows[name]
        progress(
            f"policy {name}: hit rate {row['hit_rate']:.3f}, TTFT p50 {row['ttft_p50_ms']:.0f} ms"
            f" p99 {row['ttft_p99_ms']:.0f} ms, imbalance {row['imbalance']:.2f}"
            f" ({row['wall_s']:.0f} s)"
        )

    def run_all(self, variants: dict[str, dict], only: set[str] | None) -> None:
        self.venv = routers_venv()
        for name, kind, policy in PEERS:
            if only is None or name in only:
                self.policy(name, lambda k=kind, p=policy: self.peer(k, p))
        for name, load in variants.items():
            if only is None or name in only:
                self.policy(name, lambda n=name, lo=load: self.kvindex(n, lo))

    def restarts(self, name: str, load: dict | None, runs: int) -> list[dict]:
        """``runs`` passes through one kvindex process, every engine restarted between."""
        self.fleet.reset()
        slug = f"{name.replace(' ', '-')}-restarts"
        index = Kvindex(self.logs, slug, self.fleet, load)
        proxy = Proxy(self.logs, f"proxy-{slug}", index, self.fleet)
        out = []
        try:
            index.launch()
            proxy.launch()
            for run in range(runs):
                if run:
                    progress(f"restarts: restarting every vllm serve before run {run + 1}")
                    self.fleet.restart()
                seen = self.view(index)
                row = self.measure(proxy, lambda: None)
                row |= {"proxy": proxy.stats(), "kvindex_before": seen}
                progress(f"restarts run {run + 1}: hit rate {row['hit_rate']:.3f},"
                         f" imbalance {row['imbalance']:.2f}")  # fmt: skip
                out.append(row)
        finally:
            proxy.stop()
            index.stop()
        return out


def table(rows: dict[str, dict]) -> list[str]:
    lines = [
        "| policy | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | imbalance | requests per engine |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, row in rows.items():
        if "failed" in row:
            lines.append(f"| {name} | failed: {row['failed']} | | | | |")
            continue
        lines.append(
            f"| {name} | {row['hit_rate']:.3f} | {row['ttft_p50_ms']:.0f} | "
            f"{row['ttft_p99_ms']:.0f} | {row['imbalance']:.2f} | "
            f"{' '.join(str(v) for v in row['requests_per_engine'].values())} |"
        )
    return lines


FIGURES = (  # (key, label, unit, the best peer's is the max (True) or the min, goal)
    ("hit_rate", "prefix-cache hit rate", "", True, Goal(1.0)),
    ("ttft_p50_ms", "TTFT p50", "ms", False, None),
    ("ttft_p99_ms", "TTFT p99", "ms", False, Goal(1.0, at_least=False)),
    ("imbalance", "load imbalance (max / mean requests)", "x", False, None),
)


def figures(rows: dict[str, dict], goals_for: str) -> list[Figure]:
    """One figure per policy and measure; kvindex's rows against the best peer's."""
    done = {n: r for n, r in rows.items() if "failed" not in r}
    peers = {n: r for n, r in done.items() if not n.startswith("kvindex")}
    out = []
    for name, row in done.items():
        for key, label, unit, higher, goal in FIGURES:
            figure = Figure(SECTION, f"routing on a real fleet, {name}: {label}", row[key], unit)
            if name.startswith("kvindex") and peers:
                pick = max if higher else min
                best = pick(peers, key=lambda n, k=key: peers[n][k])
                figure = Figure(
                    SECTION, figure.name, row[key], unit, f"best peer ({best})",
                    peers[best][key], goal if name == goals_for else None,
                )  # fmt: skip
            out.append(figure)
    return out


def run(report: Report, quick: bool, variants: dict | None = None, restarts: int = 0,
        only: set[str] | None = None, logs: Path = LOGS) -> dict:  # fmt: skip
    """The item: every policy, then the restart runs when asked; figures into ``report``."""
    variants = variants or VARIANTS
    logs.mkdir(parents=True, exist_ok=True)
    bench = Bench(quick, logs)
    details: dict = {"workload": {"chats": len(bench.workload.chats),
                                  "burst": len(bench.workload.burst),
                                  "concurrency": bench.concurrency, "cache": CACHE,
                                  "engines": len(bench.fleet.engines)}}  # fmt: skip
    started = time.monotonic()
    try:
        bench.fleet.start()
        bench.run_all(variants, only)
        if restarts:
            name = RESTARTED if RESTARTED in variants else next(iter(variants))
            details["restarts"] = {
                "variant": name,
                "runs": bench.restarts(name, variants[name], restarts),
            }
    finally:
        bench.fleet.stop()
    again = details.get("restarts", {"runs": ()})
    rows = bench.rows | {
        f"{again['variant']}, one kvindex, run {i + 1} (engines restarted before runs 2+)": r
        for i, r in enumerate(again["runs"])
    }
    details |= {"policies": bench.rows, "table": table(rows), "wall_s": time.monotonic() - started}
    report.add(*figures(bench.rows, next(iter(variants))))
    report.notes.append(_note(details))
    return details


def _note(details: dict) -> str:
    w = details["workload"]
    return (
        f"Item 16: {w['engines']} CPU vllm serve ({w['cache']} KV cache each), {w['chats']} chat "
        f"requests at concurrency {w['concurrency']} plus a burst of {w['burst']} agents; hit "
        "rate and requests per engine from each engine's /metrics, TTFT from the client. Table:\n\n"
        + "\n".join(details["table"])
    )


def _variant(text: str) -> tuple[str, dict]:
    name, _, load = text.partition("=")
    return f"kvindex {name}", json.loads(load)


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        "python -m bench.routing", description=__doc__, formatter_class=raw
    )
    parser.add_argument("--quick", action="store_true", help="3 engines, 96 chat requests")
    parser.add_argument("--variant", action="append", type=_variant, default=[],
                        metavar="NAME=JSON", help="another kvindex api.load, e.g. "
                        "'per_request-8={\"per_request\": 8}' (repeatable)")  # fmt: skip
    parser.add_argument("--restarts", type=int, default=0, metavar="N",
                        help="then N runs in one kvindex, engines restarted between")  # fmt: skip
    parser.add_argument("--only", nargs="+", help="only these policies (names as in the table)")
    parser.add_argument("--logs", type=Path, default=LOGS)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers go in finally
    report = Report("quick" if args.quick else "full")
    variants = VARIANTS | dict(args.variant)
    only = set(args.only) if args.only else None
    with contextlib.redirect_stdout(sys.stderr):
        details = run(report, args.quick, variants, args.restarts, only, args.logs)
    (args.logs / "routing.json").write_text(json.dumps(details, indent=1, default=str))
    report.plots.extend(plots.routing(details, args.logs))
    print("\n".join(details["table"]))
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
