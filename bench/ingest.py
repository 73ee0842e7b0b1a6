"""Item 1: ingest into the embedded store, from raw payloads, on one core.

Everything replays the same fleet payloads (in the order an indexer would
receive them) from bytes in memory: no sockets, no sequencing beyond the
store's own watermark check. Candidates run in turn, repeated, and each
figure is a median of CPU seconds (as item 14's: on the shared machine, wall
time is partly waiting for a core):

- kvindex: :func:`~indexer.engines.vllm.wire.decode_batch` then
  :func:`~indexer.stores.apply_events` into a :class:`~indexer.stores.MemoryStore`,
  as the consumer does (``tokens=False``: the compiled scanner, alike events merged);
- naive consumer: untyped ``msgspec.msgpack.decode`` and a dict of counts,
  what one writes first (goal: kvindex >= 1.5x it);
- decode floor: msgspec's typed decoding of the payloads into every field
  of vLLM's event structs (:class:`~indexer.core.events.EventBatch`) and nothing
  else: no checks, no apply (goal: >= 1.0x it, i.e. validating, planning and
  applying all cost less than msgspec's decoding alone);
- the same floor for the fields the index reads
  (:class:`~indexer.engines.vllm.wire.IndexedBatch`, what msgspec's path decodes: no
  token ids), to show what is left to apply;
- Dynamo's RadixTree, for reference (see :mod:`bench.dynamo`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from bench import dynamo
from bench.measure import cpu_clock, interleaved
from bench.naive import naive
from bench.report import Figure, Goal, Report
from indexer.core.events import EventBatch, RankId
from indexer.engines.vllm.wire import IndexedBatch, decode_batch
from indexer.stores import MemoryStore, apply_events

Stream = Sequence[tuple[RankId, int, bytes]]
SECTION = "1"


async def _apply_all(store: MemoryStore, stream: Stream) -> int:
    ops = 0
    for rank, seq, payload in stream:
        ops += (await apply_events(store, rank, seq, decode_batch(payload, tokens=False))).block_ops
    return ops


def kvindex(stream: Stream) -> int:
    """Decode and apply the stream into a fresh store; the block operations applied."""
    return asyncio.run(_apply_all(MemoryStore(), stream))


def decode_floor(stream: Stream, batch_type: type = EventBatch) -> None:
    decode = msgspec.msgpack.Decoder(batch_type).decode
    for _, _, payload in stream:
        decode(payload)


def run(report: Report, stream: Stream, repeats: int) -> dict:
    """Measure, add the figures, return the raw numbers."""
    ops = kvindex(stream)
    candidates = {
        "kvindex": lambda: kvindex(stream),
        "naive": lambda: naive(stream),
        "decode_floor": lambda: decode_floor(stream),
        "indexed_floor": lambda: decode_floor(stream, IndexedBatch),
    }
    times = interleaved(repeats, candidates, cpu_clock)
    rates = {name: ops / t for name, t in times.items()}
    details: dict = {"batches": len(stream), "block_ops": ops, "block_ops_per_s": rates}
    what = "block-ops/s, decode + apply"
    report.add(
        Figure(SECTION, f"ingest, embedded: {what}", rates["kvindex"], "ops/s",
               "naive consumer", rates["naive"], Goal(1.5)),
        Figure(SECTION, f"ingest, embedded: {what}", rates["kvindex"], "ops/s",
               "decode floor (typed, every field, no apply)", rates["decode_floor"],
               Goal(1.0)),
        Figure(SECTION, f"ingest, embedded: {what}", rates["kvindex"], "ops/s",
               "decode floor (typed, indexed fields only, no apply)", rates["indexed_floor"]),
    )  # fmt: skip
    if dynamo.available():
        rates["dynamo"], events, refused = _dynamo_rate(stream, min(repeats, 2))
        details.update(dynamo_events=events, dynamo_refused=refused)
        report.add(
            Figure(SECTION, f"ingest, embedded: {what}", rates["kvindex"], "ops/s",
                   "Dynamo RadixTree.apply_event (binding)", rates["dynamo"],
                   note=f"{refused} of {events} events refused by Dynamo"),
        )  # fmt: skip
    return details


def _dynamo_rate(stream: Stream, repeats: int) -> tuple[float, int, int]:
    """Dynamo's block-ops/s, its events and how many it refused.

    A reference only, and its binding is slow (a full-fleet pass takes
    minutes): fewer repeats than the candidates above.
    """
    events = dynamo.convert(stream)
    last: list[dynamo.Tree] = []

    def apply() -> None:
        last[:] = [dynamo.Tree()]
        last[0].apply(events)

    seconds = interleaved(repeats, {"dynamo": apply}, cpu_clock)["dynamo"]
    return dynamo.block_ops(events) / seconds, len(events), last[0].refused
