"""Item 15: engine snapshots (issue 25): their size and time, what they cost the
engine, and how soon a kvindex started late answers exactly.

Every figure's baseline is measured in the same run, interleaved with it:

- size and time: one rank holding N cached GPU blocks of one group (1M; 200k
  with ``--quick``), with 64-bit int hashes and with 32-byte digests. The
  snapshot's encoded bytes against the same blocks published as
  ``BlockStored`` batches of 512 hashes (vLLM's wire); its encode and decode
  time against those batches' (typed decode, no token ids, as kvindex reads
  them); and :func:`~indexer.stores.base.apply_snapshot` into the embedded
  store and into a private ``redis-server`` against applying the same batches
  one after the other with :func:`~indexer.stores.base.apply_events` (what a
  consumer that replays them does; decoding excluded on both sides). Redis is
  timed with a socket timeout no apply reaches; one apply with kvindex's
  default (5 s) before says whether the snapshot fits in it (a note if not);
- the engine's side, with the vLLM plugin's own code
  (:class:`producer.vllm_plugin.snapshots.EngineSnapshots`) on a table shaped
  like vLLM 0.33's block pool cache (1M entries in both modes: 32-byte hash +
  4-byte group id keys to a block, 1% to a dict of two copies): the pause on
  the engine thread (``_take``: the dict copy and the multi-copy pass) against
  what the snapshot server's thread then does with it (keys to published
  hashes, ``_assembled``, and encoding; vLLM's setting for int hashes stood in
  for by its default where vLLM is not installed). Per published
  batch while nobody asks (CPU time of the calling thread): the plugin's
  snapshot hook (the publisher's service and ``published()``, offloading off)
  against the mirror publisher's own ``publish_encoded`` of the same batch;
  the plugin's whole publish wrapper with snapshots on against off, also with
  an offloading connector (``published()`` then decodes the batch's lower-tier
  events to count them). The real engine's step time with and without the plugin is
  :mod:`bench.snapshots.engine_step`, run in the vLLM tier's venv (this item
  runs it when that venv exists);
- time to exact answers: a simulated engine rank
  (:class:`producer.snapshots.SelfSnapshotting` around a
  :class:`producer.publisher.Publisher` with ``buffer_steps=10``) publishes N
  blocks in batches of 512, then ``kvindex serve`` starts (embedded store, the
  engine given by ``--engine``): seconds from the process's start until the
  rank has restored once from the snapshot, is not degraded and has applied
  the engine's last seq (``GET /engines/NAME``), and the same from its first
  answered ``/healthz``. Baseline: the same start against an engine
  publishing the same batches whose replay buffer still holds them all
  (kvindex replays them, no snapshot).

Each part is a module of its own: :mod:`bench.snapshots.size`,
:mod:`bench.snapshots.engine_side` and :mod:`bench.snapshots.late_start`, on the
blocks and clock of :mod:`bench.snapshots.data`; :func:`run` runs them in turn.

Run alone: ``python -m bench [--quick] --only 15`` (about 1.5 minutes quick, 5 full,
on two shared cores).
"""

from __future__ import annotations

from bench.report import Report
from bench.snapshots.data import blocks_of
from bench.snapshots.engine_side import engine_side, vllm_step
from bench.snapshots.late_start import late_start
from bench.snapshots.size import size_and_time


def run(report: Report, quick: bool) -> dict:
    n = blocks_of(quick)
    details = {
        "size_and_time": size_and_time(report, n, quick),
        "engine": engine_side(report, quick),
        "late_start": late_start(report, n, quick),
    }
    details["vllm_step"] = vllm_step(report, quick)
    if quick:
        report.notes.append(
            f"Item 15 (snapshots), quick run: {n:,} cached blocks for size, apply and late "
            "start (1M in the full run); the engine-side figures use 1M in both."
        )
    return details
