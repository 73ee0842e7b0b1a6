"""Item 16's figures: one row per policy and run from the engines' counters, the client's
samples and the timed engines' step accounts; then per workload, rate and policy the mean,
min and max over runs, as a Markdown table.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from statistics import mean

from bench.measure import quantile
from bench.routing.fleet import COUNTERS, TIMED_ENGINE
from bench.routing.traffic import Sample

HITS, QUERIES, DONE = COUNTERS
#: what is averaged over runs, and shown: (key, column, format)
SHOWN = (
    ("hit_rate", "hit rate", "{:.3f}"),
    ("ttft_p50_ms", "TTFT p50", "{:,.0f}"),
    ("ttft_p90_ms", "TTFT p90", "{:,.0f}"),
    ("ttft_p99_ms", "TTFT p99", "{:,.0f}"),
    ("e2e_p50_ms", "e2e p50", "{:,.0f}"),
    ("e2e_p99_ms", "e2e p99", "{:,.0f}"),
    ("output_tokens_per_s", "out tok/s", "{:,.0f}"),
)


def row(before: dict, after: dict, samples: list[Sample], wall: float) -> dict:
    """One run's figures from the engines' counters before and after, and the samples."""
    delta = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in after}
    hits = sum(d[HITS] for d in delta.values())
    queries = sum(d[QUERIES] for d in delta.values())
    ok = [s for s in samples if not s.error]
    ttfts = [s.ttft * 1000 for s in ok if s.ttft is not None]
    totals = [s.total * 1000 for s in ok]
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p90_ms": quantile(ttfts, 0.9),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "e2e_p50_ms": quantile(totals, 0.5),
        "e2e_p99_ms": quantile(totals, 0.99),
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
        "requests_per_engine": {e: int(d[DONE]) for e, d in delta.items()},
        "requests": len(samples),
        "errors": [f"{s.key}: {s.error}" for s in samples if s.error][:10],
        "wall_s": wall,
    }


def self_check(before: dict, after: dict, wall: float) -> dict:
    """The timed engines over one run: modelled vs measured step time (the forward pass,
    at least the modelled time, plus the engine's median gap between busy steps), real
    forward work over modelled time, overruns, and CPU cores each engine used."""
    out = {}
    for name, end in after.items():
        start = before[name]
        steps = end.get("steps", 0) - start.get("steps", 0)
        if steps <= 0:
            continue
        modelled = (end["modelled_s"] - start.get("modelled_s", 0)) / steps
        real = (end["real_forward_s"] - start.get("real_forward_s", 0)) / steps
        out[name] = {
            "steps": steps,
            "modelled_step_ms": 1000 * modelled,
            "measured_step_ms": 1000 * (max(modelled, real) + end["gap_p50_s"]),
            "real_forward_share": real / modelled if modelled else 0.0,
            "overruns": end["overruns"] - start.get("overruns", 0),
            "cpu_cores": (end["cpu_s"] - start["cpu_s"]) / wall,
        }
    return out


def aggregate(rows: list[dict]) -> dict[tuple[str, float, str], dict]:
    """Per (workload, rate, policy): each shown figure's mean, min and max over runs."""
    groups: dict[tuple[str, float, str], list[dict]] = defaultdict(list)
    for r in rows:
        if "failed" not in r:
            groups[(r["workload"], r["rate"], r["policy"])].append(r)
    return {
        key: {k: (mean(v), min(v), max(v)) for k, *_ in SHOWN for v in [[r[k] for r in runs]]}
        | {"runs": len(runs), "per_engine": per_engine(runs)}
        for key, runs in groups.items()
    }


def per_engine(runs: list[dict]) -> list[float]:
    """Requests each engine served, the mean over runs (engines in their order)."""
    engines = runs[0]["requests_per_engine"]
    return [mean(r["requests_per_engine"][e] for r in runs) for e in engines]


def table(rows: list[dict]) -> list[str]:
    """Mean (min-max over runs) per workload, rate and policy."""
    head = " | ".join(column for _, column, _ in SHOWN)
    lines = [f"| workload | rate (req/s) | policy | runs | {head} | requests per engine |",
             "| --- | ---: | --- | ---: |" + " ---: |" * len(SHOWN) + " --- |"]  # fmt: skip
    for (workload, rate, policy), figures in aggregate(rows).items():
        cells = []
        for key, _, shown in SHOWN:
            avg, low, high = figures[key]
            spread = f" ({shown.format(low)}-{shown.format(high)})" if figures["runs"] > 1 else ""
            cells.append(shown.format(avg) + spread)
        served = " ".join(f"{n:.0f}" for n in figures["per_engine"])
        lines.append(f"| {workload} | {rate:g} | {policy} | {figures['runs']} | "
                     + " | ".join(cells) + f" | {served} |")  # fmt: skip
    return lines


def verdict(rows: list[dict], mine: str = "kvindex") -> list[str]:
    """Per workload and rate, the issue's bar for ``mine``: the highest mean hit rate, the
    lowest mean TTFT p90 with its worst run better than the best peer's best run, and a
    mean TTFT p99 no worse than the best peer's (peers: every policy not kvindex's)."""
    means = aggregate(rows)
    lines = ["| workload | rate | hit rate: mine / best peer | TTFT p90 mean: mine / best peer | "
             "p90 worst run / best peer's best run | TTFT p99 mean: mine / best peer | met |",
             "| --- | ---: | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (workload, rate, policy), row in means.items():
        peers = {p: r for (w, x, p), r in means.items()
                 if (w, x) == (workload, rate) and not p.startswith("kvindex")}  # fmt: skip
        if policy != mine or not peers:
            continue
        hit = max(peers, key=lambda p: peers[p]["hit_rate"][0])
        p90 = min(peers, key=lambda p: peers[p]["ttft_p90_ms"][0])
        p99 = min(peers, key=lambda p: peers[p]["ttft_p99_ms"][0])
        bars = (
            row["hit_rate"][0] > peers[hit]["hit_rate"][0],
            row["ttft_p90_ms"][2] < peers[p90]["ttft_p90_ms"][1],
            row["ttft_p99_ms"][0] <= peers[p99]["ttft_p99_ms"][0],
        )
        lines.append(
            f"| {workload} | {rate:g} | {row['hit_rate'][0]:.3f} / {peers[hit]['hit_rate'][0]:.3f}"
            f" ({hit}) | {row['ttft_p90_ms'][0]:,.0f} / {peers[p90]['ttft_p90_ms'][0]:,.0f} ({p90})"
            f" | {row['ttft_p90_ms'][2]:,.0f} / {peers[p90]['ttft_p90_ms'][1]:,.0f} | "
            f"{row['ttft_p99_ms'][0]:,.0f} / {peers[p99]['ttft_p99_ms'][0]:,.0f} ({p99}) | "
            + ", ".join(name for name, ok in zip(("hits", "p90", "p99"), bars, strict=True) if ok)
            + " |"
        )
    return lines


def ask_table(rows: list[dict]) -> list[str]:
    """How long kvindex took to answer the proxy's ``route: "best"`` (the proxy's clock: in
    every kvindex TTFT), per workload, rate and variant: mean over runs of p50 and p99."""
    asks: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if "proxy" in r:
            asks[(r["workload"], r["rate"], r["policy"])].append(r["proxy"])
    lines = ["| workload | rate | policy | answer p50 (ms) | answer p99 (ms) |",
             "| --- | ---: | --- | ---: | ---: |"]  # fmt: skip
    for (workload, rate, policy), runs in asks.items():
        p50, p99 = (mean(run[k] for run in runs) for k in ("ask_p50_ms", "ask_p99_ms"))
        lines.append(f"| {workload} | {rate:g} | {policy} | {p50:.0f} | {p99:.0f} |")
    return lines


def check_table(checks: list[dict]) -> list[str]:
    """The timed engines' self-check, one line per run and engine (means over engines)."""
    lines = ["| workload | rate | policy | run | modelled step (ms) | measured step (ms) | "
             "real forward / modelled | overruns / steps | CPU per engine (cores) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for c in checks:
        engines = list(c["engines"].values())
        if not engines:
            continue
        avg = {k: mean(e[k] for e in engines) for k in engines[0]}
        lines.append(
            f"| {c['workload']} | {c['rate']:g} | {c['policy']} | {c['run']} | "
            f"{avg['modelled_step_ms']:.1f} | {avg['measured_step_ms']:.1f} | "
            f"{avg['real_forward_share']:.2f} | {sum(e['overruns'] for e in engines)} / "
            f"{sum(e['steps'] for e in engines)} | {avg['cpu_cores']:.2f} |"
        )
    return lines


def document(details: dict, command: str) -> str:
    """The report (``routing.md``): the workloads, the table, the ladder plot, the
    self-check, and the timed engine's step model as its module states it."""
    model = TIMED_ENGINE / "timed_engine/step_model.py"
    step_model = ast.get_docstring(ast.parse(model.read_text())) or ""
    workloads = "\n".join(
        f"- `{name}`: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in about.items())
        for name, about in details["workloads"].items()
    )
    return "\n\n".join([
        "# Routing on timed engines (bench item 16)",
        f"`{command}`: {details['engines']} timed engines (`vllm serve` of the tiny model, "
        f"{details['cache']} KV cache each, time scale {details['scale']:g}), rates "
        f"{', '.join(f'{r:g}' for r in details['rates'])} requests/s; "
        f"{details['wall_s'] / 60:.0f} minutes.",
        "Workloads (requests at one request a second before the ladder's scaling):\n\n"
        + workloads,
        "Mean (min-max) over runs; hit rate from the engines' own counters, latencies from "
        "the client (ms), output tokens a second over the run:\n\n" + "\n".join(details["table"]),
        "Against the issue's bar (kvindex load-aware; met: the bars it clears):\n\n"
        + "\n".join(verdict(details["rows"])),
        "![the load ladder](routing_ladder.png)",
        "kvindex's answers to the proxy (part of its TTFT; mean over runs):\n\n"
        + "\n".join(ask_table(details["rows"])),
        "The timed engines' self-check (means over engines):\n\n"
        + "\n".join(details["check_table"]),
        f"## The step model (`{model.relative_to(TIMED_ENGINE.parents[1])}`)\n\n{step_model}",
    ]) + "\n"  # fmt: skip
