"""Item 8's curves as PNGs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use(): the backend is chosen first


def _axes(title: str, xlabel: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name)
    plt.close(fig)
    return name


def scaling(details: dict, out: Path) -> list[str]:
    """One PNG per curve family; returns the file names written in ``out``."""
    engines, lengths = details["by_engines"], details["by_length"]
    xs = sorted(engines)
    fig, ax = _axes("Ingest cost vs engines", "engines", "microseconds per block op")
    ax.plot(xs, [engines[x]["ingest_us_per_op"] for x in xs], "o-", label="kvindex decode+apply")
    ax.plot(xs, [engines[x]["decode_floor_us_per_op"] for x in xs], "s--", label="decode floor")
    ax.legend()
    names = [_save(fig, out, "scaling_ingest_engines.png")]

    fig, ax = _axes("512-block prefix match vs engines", "engines", "p50 latency (ms)")
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
