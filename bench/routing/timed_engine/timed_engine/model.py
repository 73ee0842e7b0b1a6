"""The timed Llama: vLLM's own Llama, whose forward pass then sleeps for what is left of
the step's modelled GPU time (:mod:`timed_engine.step_model`) times ``TIMED_ENGINE_SCALE``.

Everything else is vLLM's: its scheduler decides what each step carries, so queueing,
chunked prefill, batching of decodes and prefix-cache hits show in time as on a GPU.

Its self-check goes to ``TIMED_ENGINE_STATS`` (a JSON file, rewritten every second of
steps): steps, the modelled and the real forward time, steps whose real pass took longer
than the modelled time (``overruns``), and the gaps between one step's end and the next
step's start while the engine is busy (the engine's own per-step overhead: scheduling,
sampling, outputs), whose median the bench adds to the forward time to give the measured
step time.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from vllm.model_executor.models.llama import LlamaForCausalLM

from timed_engine.step_model import step_seconds

#: a gap between steps longer than this is the engine idling, not its overhead
BUSY_GAP_S = 0.25


class Clock:
    """The step account the self-check reads."""

    def __init__(self) -> None:
        self.scale = float(os.environ.get("TIMED_ENGINE_SCALE", "1"))
        stats = os.environ.get("TIMED_ENGINE_STATS")
        self.path = Path(stats) if stats else None
        self.steps = self.overruns = 0
        self.modelled = self.real = 0.0
        self.gaps: list[float] = []
        self.last_end: float | None = None
        self.written = time.monotonic()

    def step(self, positions: list[int], started: float, computed: float) -> None:
        """Sleep for the rest of the modelled step begun at ``started``, its real pass done at
        ``computed``; account for it."""
        modelled = self.scale * step_seconds(positions)
        rest = modelled - (computed - started)
        if rest > 0:
            time.sleep(rest)
        else:
            self.overruns += 1
        if self.last_end is not None and started - self.last_end < BUSY_GAP_S:
            self.gaps.append(started - self.last_end)
        self.steps += 1
        self.modelled += modelled
        self.real += computed - started
        self.last_end = time.monotonic()
        if self.path is not None and self.last_end - self.written > 1.0:
            self.write()

    def write(self) -> None:
        gaps = self.gaps[-2000:]
        self.gaps = gaps
        account = {
            "scale": self.scale,
            "steps": self.steps,
            "modelled_s": self.modelled,
            "real_forward_s": self.real,
            "overruns": self.overruns,
            "gap_p50_s": statistics.median(gaps) if gaps else 0.0,
        }
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps(account))
        partial.replace(self.path)
        self.written = self.last_end or time.monotonic()


class TimedLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's Llama, taking the modelled GPU time of each step."""

    clock: Clock | None = None

    def forward(self, input_ids, positions, *args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        out = super().forward(input_ids, positions, *args, **kwargs)
        if TimedLlamaForCausalLM.clock is None:
            TimedLlamaForCausalLM.clock = Clock()
        scheduled = positions.reshape(-1)[: positions.shape[-1]].tolist()
        TimedLlamaForCausalLM.clock.step(scheduled, started, time.monotonic())
        return out
