"""Timing helpers: repeat, take medians, summarise latency samples.

The machine is shared and noisy, so every rate is the median of several
repeats and every baseline is measured in the same run, interleaved with
what it is compared to, so that a slow moment hits both.
"""

from __future__ import annotations

import gc
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence


def seconds(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Time of one call by ``clock`` (default wall time), starting from a collected heap
    (the collector stays on, as in production)."""
    gc.collect()
    started = clock()
    fn()
    return clock() - started


def cpu_clock() -> float:
    """CPU seconds of this process and of its waited-for children: what a run costs
    whatever else the shared machine is running meanwhile."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def interleaved(
    repeats: int,
    candidates: dict[str, Callable[[], object]],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds (by ``clock``) per candidate, running them in turn ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(seconds(fn, clock))
    return {name: statistics.median(t) for name, t in times.items()}


def quantile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank quantile, no interpolation: a p99 of 100 samples is their slowest
    but one, of fewer than 100 their slowest; NaN of none."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


def latency_ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of samples in seconds, as milliseconds."""
    return {"p50_ms": 1000 * quantile(samples, 0.5), "p99_ms": 1000 * quantile(samples, 0.99)}
