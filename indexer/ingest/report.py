"""What operators see of a rank's sequencing: the logs and metrics of its notes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from indexer import metrics
from indexer.core.events import WireError
from indexer.core.sequencer import (
    Action,
    Duplicate,
    GapFilled,
    GapOpened,
    GaveUp,
    RebuildSettled,
    ReplayTimedOut,
    Restarted,
    Restored,
    Sequencer,
    SnapshotFailed,
    StoreLossFound,
)
from indexer.engine_registry import RankStatus

log = logging.getLogger("kvindex.subscriber")


class Report:
    """Logs and counts the notes a :class:`~indexer.core.sequencer.Sequencer` answers
    (gaps, give-ups, restarts, replay timeouts, store losses) for one rank, and what
    it rejects (:meth:`rejected`)."""

    def __init__(
        self,
        status: RankStatus,
        rank_metrics: metrics.RankMetrics,
        ids: Callable[..., dict[str, Any]],
        replay_endpoint: str,
        replay_attempts: int,
    ) -> None:
        self.status, self.metrics, self.ids = status, rank_metrics, ids
        self._replay_endpoint, self._replay_attempts = replay_endpoint, replay_attempts

    def rejected(self, error: WireError) -> None:
        """Count bad input by its reason (the rank's ``rejected`` and the metrics), and
        log the first of each reason."""
        rejected = self.status.rejected
        rejected[error.reason] = rejected.get(error.reason, 0) + 1
        self.metrics.rejected(error.reason)
        if rejected[error.reason] == 1:
            log.warning("bad frame", extra=self.ids(reason=error.reason, detail=error.detail[:200]))

    def __call__(self, action: Action) -> None:
        match action:
            case Duplicate():
                self.metrics.duplicates.inc()
            case GapOpened(first=first, last=last):
                self.metrics.gap("detected")
                log.info("gap", extra=self.ids(first=first, last=last))
            case GapFilled(first=first, last=last):
                self.metrics.gap("filled")
                log.info("gap filled", extra=self.ids(first=first, last=last))
            case GaveUp(first=first, last=last, reason=why, cleared=clear, newly=newly):
                if newly:
                    self.metrics.gap("unfilled")
                log.warning(
                    "rank degraded", extra=self.ids(first=first, last=last, why=why, cleared=clear)
                )
            case Restarted(applied_seq=applied, seq=seq):
                self.metrics.restarts.inc()
                log.warning("engine restart", extra=self.ids(applied_seq=applied, seq=seq))
            case ReplayTimedOut():
                self._replay_timed_out(action)
            case StoreLossFound(lost=lost):
                log.warning("store lost batches", extra=self.ids(lost=lost))
            case RebuildSettled(last=last, exact=True):
                log.info("rank rebuilt after a store loss", extra=self.ids(last=last))
            case RebuildSettled(last=last):
                log.warning("rank not rebuilt after a store loss", extra=self.ids(last=last))
            case SnapshotFailed(reason=reason, retry=retry):
                self.metrics.snapshot("failed")
                log.warning("no snapshot from the engine", extra=self.ids(why=reason, retry=retry))
            case Restored(seq=seq, dropped=dropped):
                self.metrics.snapshot("applied")
                restored = self.ids(seq=seq, dropped=dropped)
                log.info("rank restored from the engine's snapshot", extra=restored)

    def _replay_timed_out(self, timed_out: ReplayTimedOut) -> None:
        # Said once per silence: a replay endpoint that never answers is retried for ever.
        level = logging.INFO if timed_out.unanswered <= 1 else logging.DEBUG
        log.log(level, "replay timed out", extra=self.ids(start=timed_out.start))
        if timed_out.unavailable:
            endpoint = self._replay_endpoint
            log.warning(
                f"replay unavailable: no answer from {endpoint} in {self._replay_attempts}"
                " requests; check the engine's --kv-events-config replay_endpoint",
                extra=self.ids(start=timed_out.start, endpoint=endpoint),
            )


def status_now(
    status: RankStatus,
    sequencer: Sequencer,
    queued: tuple[int, float] | None,
    loss_in_doubt: str | None,
) -> RankStatus:
    """A copy of a rank's status with its lag computed now: ``queued``, the seq and ts
    of the newest batch read but not yet taken by the sequencer; a store loss the
    rank is yet to resynchronise after makes it degraded."""
    mark = sequencer.mark
    last_seq, received_ts = status.last_seq, sequencer.received_ts
    if queued is not None and queued[0] > (last_seq or -1):
        last_seq, received_ts = queued
    lag, lag_seconds = 0, 0.0
    if last_seq is not None:
        lag = max(0, last_seq - (mark.seq if mark else -1))
        if mark is not None and received_ts is not None:
            lag_seconds = max(0.0, received_ts - mark.ts)
    doubt = {} if loss_in_doubt is None else {"degraded": True, "store_loss": loss_in_doubt}
    return msgspec.structs.replace(
        status,
        lag_batches=lag,
        lag_seconds=lag_seconds,
        missing=list(status.missing),
        rejected=dict(status.rejected),
        **doubt,
    )
