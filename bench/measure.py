"""Timing helpers: repeat, take medians, summarise latency samples.

The machine is shared and noisy, so every rate is the median of several
repeats and every baseline is measured in the same run, interleaved with
what it is compared to, so that a slow moment hits both.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call, starting from a collected heap (the collector stays on,
    as in production)."""
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(repeats: int, candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per candidate, running them in turn ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(seconds(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def quantile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of samples in seconds, as milliseconds."""
    return {"p50_ms": 1000 * quantile(samples, 0.5), "p99_ms": 1000 * quantile(samples, 0.99)}
