"""Item 14: whole-process ingest of a single-engine vLLM-granularity trace.

:mod:`producer.vllm_trace` records one engine as vLLM publishes it (one
``BlockStored`` per request per step, one ``BlockRemoved`` per evicted
block, LRU eviction): about 2M block operations in the full run, 200k in
the quick one. Two processes read the same file, each timed from start to
exit (interpreter, imports, reading, decoding, applying), interleaved, in
CPU seconds (the machine is shared: wall time there is mostly waiting):

- ``kvindex replay TRACE``: the CLI, into the embedded store;
- the naive consumer (:mod:`bench.naive`): untyped ``msgspec.msgpack.decode``
  and a dict of counts (goal: kvindex >= 3x its block-ops/s).

In process, on the same trace and by the same clock: decode + apply into a
MemoryStore against msgspec's typed decoding of every field and nothing
else (goal >= 1.0x).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from bench.ingest import decode_floor, kvindex
from bench.measure import cpu_clock, interleaved
from bench.report import Figure, Goal, Report
from indexer.core.events import RankId
from producer import vllm_trace

SECTION = "14"
RANK = RankId("replay", 0)


def _process(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)


def run(report: Report, quick: bool, repeats: int) -> dict:
    trace, ops = vllm_trace.generate(200_000 if quick else 2_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vllm-single-engine.msgpack"
        vllm_trace.write(path, trace)
        whole = interleaved(
            repeats,
            {
                "kvindex": lambda: _process("-m", "kvindex", "replay", str(path)),
                "naive": lambda: _process("-m", "bench.naive", str(path)),
                "python": lambda: _process("-c", "pass"),
            },
            cpu_clock,
        )
    stream = [(RANK, seq, payload) for seq, payload in trace]
    candidates = {"kvindex": lambda: kvindex(stream), "decode_floor": lambda: decode_floor(stream)}
    embedded = interleaved(repeats, candidates, cpu_clock)
    rates = {name: ops / t for name, t in whole.items() if name != "python"}
    inner = {name: ops / t for name, t in embedded.items()}
    details = {
        "batches": len(trace),
        "block_ops": ops,
        "whole_process_s": whole,
        "whole_block_ops_per_s": rates,
        "embedded_block_ops_per_s": inner,
    }
    report.add(
        Figure(SECTION, f"ingest, whole process: kvindex replay of a vLLM-granularity "
               f"single-engine trace ({ops:,} block-ops): block-ops/s", rates["kvindex"], "ops/s",
               "naive consumer process (untyped msgspec decode + dict of counts)",
               rates["naive"], Goal(3.0),
               note=f"{whole['kvindex']:.2f} vs {whole['naive']:.2f} CPU-s per run; an empty "
               f"interpreter takes {whole['python']:.2f}"),
        Figure(SECTION, "ingest, embedded, same trace: decode + apply, block-ops/s",
               inner["kvindex"], "ops/s", "typed decode of every field (no apply)",
               inner["decode_floor"], Goal(1.0)),
    )  # fmt: skip
    return details
