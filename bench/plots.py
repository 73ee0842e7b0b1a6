"""The report's plots as PNGs (matplotlib, headless): item 8's curves, item 16's load ladder
and issue 16's rows.

Each plot is drawn from what ``report.json`` holds (``python -m bench.plots
[DIR]`` draws them again from ``DIR/report.json``), so a report and its plots
never disagree.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend is chosen first

from bench.issue27 import TABLE
from bench.report import distinct_parts


def _axes(title: str, xlabel: str, ylabel: str, figsize: tuple[float, float] = (6, 4)):
    fig, ax = plt.subplots(figsize=figsize, dpi=110)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 512, not 2^9
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name)
    plt.close(fig)
    return name


def _by_int(curve: dict) -> dict[int, dict]:
    """A curve keyed by engines or blocks: ints in the run, strings once read from JSON."""
    return {int(k): v for k, v in curve.items()}


def scaling(details: dict, out: Path) -> list[str]:
    """One PNG per curve family; returns the file names written in ``out``."""
    engines, lengths = _by_int(details["by_engines"]), _by_int(details["by_length"])
    xs = sorted(engines)
    fig, ax = _axes("Ingest cost vs engines", "engines", "microseconds per block op")
    ax.plot(xs, [engines[x]["ingest_us_per_op"] for x in xs], "o-", label="kvindex decode+apply")
    ax.plot(xs, [engines[x]["decode_floor_us_per_op"] for x in xs], "s--", label="decode floor")
    ax.legend()
    names = [_save(fig, out, "scaling_ingest_engines.png")]

    fig, ax = _axes("512-block prefix match vs engines", "engines", "latency (ms)")
    ax.plot(xs, [engines[x]["query_512"]["p50_ms"] for x in xs], "o-", label="kvindex p50")
    ax.plot(xs, [engines[x]["query_512"]["p99_ms"] for x in xs], "^:", label="kvindex p99")
    ax.legend()
    names.append(_save(fig, out, "scaling_query_engines.png"))

    ls = sorted(lengths)
    fig, ax = _axes("Prefix match vs prompt length (64 engines)", "blocks", "p50 latency (ms)")
    for who in lengths[ls[0]]["query"]:
        ax.plot(ls, [lengths[x]["query"][who]["p50_ms"] for x in ls], "o-", label=who)
    ax.set_yscale("log")
    ax.legend()
    names.append(_save(fig, out, "scaling_query_length.png"))

    fig, ax = _axes("Ingest vs prompt length", "blocks per prompt", "block ops / s")
    ax.plot(ls, [lengths[x]["ingest_block_ops_per_s"] for x in ls], "o-", label="kvindex")
    ax.plot(ls, [lengths[x]["decode_floor_block_ops_per_s"] for x in ls], "s--", label="floor")
    ax.legend()
    names.append(_save(fig, out, "scaling_ingest_length.png"))
    return names


def rows(figures: list[dict], out: Path) -> list[str]:
    """Issue 27's rows as bars of ratio-to-goal from 1 (the goal: right of it is met, left of
    it missed by that factor), one bar per figure, in issue 16's order; nothing when no row
    was measured."""
    groups: dict[str, list[dict]] = {row.key: [] for row in TABLE.rows}
    for f in figures:
        if f["row"] and f["to_goal"] is not None and math.isfinite(f["to_goal"]):
            groups.setdefault(f["row"], []).append(f)
    bars, labels = [], []
    for row, group in groups.items():
        bars += group
        labels += [f"{row}: {p}" if p else row for p in distinct_parts([f["name"] for f in group])]
    if not bars:
        return []
    fig, ax = _axes("Issue 27's rows: ratio / goal (>= 1 is met)", "times the goal", "",
                    (8, 0.35 * len(bars) + 1.5))  # fmt: skip
    reach = [f["to_goal"] for f in bars]
    ys = range(len(bars))
    colors = ["tab:green" if f["met"] else "tab:red" for f in bars]
    ax.barh(ys, [r - 1 for r in reach], left=1, color=colors)
    ax.scatter(reach, ys, marker="D", color=colors, zorder=3)  # a bar of length 0 shows too
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlim(min(1, *reach) / 1.5, max(1, *reach) * 4)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()  # the table's order, top down
    for y, f in zip(ys, bars, strict=True):
        ax.annotate(f"{f['ratio']:.3g} (goal {f['goal']})", (max(1, f["to_goal"]), y),
                    xytext=(7, 0), textcoords="offset points", va="center", fontsize=8)  # fmt: skip
    return [_save(fig, out, "issue27_rows.png")]


def routing(details: dict, out: Path) -> list[str]:
    """Item 16's load ladder: TTFT p90 (mean over runs, min-max as error bars) against the
    arrival rate, one panel per workload and one line per policy, kvindex's in green."""
    rows = [r for r in details["rows"] if "failed" not in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    if not workloads:
        return []
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.4), dpi=110)
    for ax, workload in zip(axes if len(workloads) > 1 else [axes], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        peers = iter(["tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown", "tab:gray"])
        for policy in dict.fromkeys(r["policy"] for r in mine):
            rates = sorted({r["rate"] for r in mine if r["policy"] == policy})
            runs = [[r["ttft_p90_ms"] for r in mine if r["policy"] == policy and r["rate"] == x]
                    for x in rates]  # fmt: skip
            means = [sum(v) / len(v) for v in runs]
            spread = [[m - min(v) for m, v in zip(means, runs, strict=True)],
                      [max(v) - m for m, v in zip(means, runs, strict=True)]]  # fmt: skip
            style = {"color": "tab:green"}  # kvindex's pick
            if policy == "kvindex prefix-only":
                style = {"color": "tab:olive", "linestyle": "--"}
            elif not policy.startswith("kvindex"):
                style = {"color": next(peers, "black")}
            ax.errorbar(rates, means, yerr=spread, marker="o", capsize=3, label=policy, **style)
        ax.set_title(workload)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("TTFT p90 (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"Routing on {details['engines']} timed vLLM engines: the load ladder")
    return [_save(fig, out, "routing_ladder.png")]


def main(argv: list[str]) -> int:
    """Draw every plot again from ``report.json`` in the given directory (default: results)."""
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results"
    report = json.loads((out / "report.json").read_text())
    names = rows(report["figures"], out)
    if "8" in report["details"]:
        names += scaling(report["details"]["8"], out)
    if "16" in report["details"]:
        names += routing(report["details"]["16"], out)
    print("\n".join(str(out / n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
