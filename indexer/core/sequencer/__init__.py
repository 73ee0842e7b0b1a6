"""The seq/gap/restart rules of one engine rank, as a state machine without I/O.

A :class:`Sequencer` is told what happened to a rank (a batch received live
or from replay, a replay answer ending or timing out, the store's watermark,
a store loss) and answers with the actions its caller must perform, in
order: apply a batch, clear media, end a replay request, and notes to log
and count. It never waits, reads a socket or calls the store, so every rule
is tested by feeding it events (``tests/test_sequencer.py``); the
:class:`~indexer.ingest.rank_consumer.RankConsumer` is the shell around it.

The rules:

- batches are applied strictly in seq order, each seq once; a seq above the
  next expected one is held back and the missing range is asked from
  replay; replayed and live copies of a seq are applied once;
- a replay that starts later than asked (buffer exhausted), skips seqs
  (permanent holes), never answers (bounded timeouts and attempts) or cannot
  be asked (no replay endpoint) leaves the rank degraded with the missing
  range; a range longer than ``gap_clear_threshold`` also drops its GPU/CPU
  counts, which can no longer be trusted; so does holding more than
  ``max_pending`` batches or ``pending_bytes`` bytes behind a gap;
- a seq at or below one already seen with a newer batch ``ts`` is a new
  engine incarnation: GPU/CPU counts and the watermark are dropped and
  consumption restarts from the new seq. Replay is asked from the last
  applied seq itself, so an answer that lacks it, or carries it with another
  ts, reveals a restart the live stream alone cannot show (the engine
  restarted while the indexer was down, or while the rank was idle);
- only a batch that decodes counts: garbage behind a valid ts never passes
  for a restart nor moves the newest seen seq (``decode`` returning None);
- an idle rank probes replay every ``probe_interval`` seconds, doubling the
  wait for each probe in a row that got no answer, up to ``probe_backoff_max``;
- when the store loses acknowledged batches the rank continues from the
  store's watermark, asks replay for the rest and is degraded (``store_loss``)
  until every batch it had reached, applied or only received, is applied
  again (after an engine restart meanwhile: the new incarnation's up to the
  batch that showed it), checked between two turns of its caller's loop, so
  never while one of them is still being written;
- where the engine answers snapshots (``has_snapshot``), a range replay
  could not fill makes the rank ask for one: from the moment it is sent, the
  batches received are held, not applied; the snapshot, applied by the
  caller as the rank's whole state as of its seq, makes the rank exact
  again once the held batches after that seq have followed (those at or
  below it are dropped). A failed one releases what was held, as a gap given up
  does, and is asked again ``snapshot_retry`` seconds later.

Payloads stay opaque bytes until applied: ``decode`` turns one into a batch
(the caller's engine decoder, which counts what it rejects). Duplicates are
never decoded, which is what lets a rank that fell behind catch up. Times:
``now`` arguments are the caller's monotonic clock. ``status`` is the rank's
operator-facing record (:class:`RankCounts`), updated in place; ``missing``
makes the record of an unfilled range (the caller stamps it with wall time).
"""

from indexer.core.sequencer.actions import (
    VOLATILE,
    Action,
    Apply,
    ApplyHeld,
    Ask,
    Clear,
    Duplicate,
    EndRequest,
    GapFilled,
    GapOpened,
    GaveUp,
    Mark,
    RankCounts,
    RebuildSettled,
    ReplayTimedOut,
    Restarted,
    Restored,
    Rules,
    SnapshotFailed,
    StoreLossFound,
)
from indexer.core.sequencer.machine import Sequencer

__all__ = [
    "VOLATILE",
    "Action",
    "Apply",
    "ApplyHeld",
    "Ask",
    "Clear",
    "Duplicate",
    "EndRequest",
    "GapFilled",
    "GapOpened",
    "GaveUp",
    "Mark",
    "RankCounts",
    "RebuildSettled",
    "ReplayTimedOut",
    "Restarted",
    "Restored",
    "Rules",
    "Sequencer",
    "SnapshotFailed",
    "StoreLossFound",
]
