"""The ordered stream of one rank: held batches, gaps, duplicates, restarts.

The half of the :class:`~indexer.core.sequencer.Sequencer` that takes
batches in; :mod:`indexer.core.sequencer.machine` adds replay requests and
store losses on top.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic

from indexer.core.sequencer.actions import (
    VOLATILE,
    Action,
    Apply,
    ApplyHeld,
    B,
    Clear,
    Duplicate,
    EndRequest,
    GapFilled,
    GapOpened,
    GaveUp,
    Mark,
    RankCounts,
    Restarted,
    Rules,
)

#: Unfilled ranges kept per rank for operators (``missing``): the newest, enough to
#: see a pattern, few enough that a flapping engine costs nothing.
MAX_MISSING = 100


@dataclass(slots=True)
class _Request:
    """One replay request in flight."""

    start: int  # first seq asked for
    want: int  # the next seq to apply when it was asked
    sent_at: float
    probe: bool
    received: int = 0
    first_new: int | None = None  # first answered seq >= want


@dataclass(slots=True)
class _Gap:
    """The missing range being repaired."""

    first: int
    last: int
    missed: bool = False  # some of it was given up


@dataclass(slots=True)
class _Rebuild:
    """A rank whose store state is being rebuilt: degraded until ``next`` passes ``last``.

    ``last`` is the newest batch the rank had reached (applied *or* received)
    when the rebuild began, not only the last one applied: a rank re-applied up
    to its old watermark still lacks every batch received since (queued while
    the store was down), and would answer from an older state unflagged.
    """

    last: int
    reason: str | None  # the store loss being rebuilt after (None: a snapshot's held batches)
    gaps_unfilled: int  # the rank's count when the rebuild began: a gap given up since
    clean: bool  # whether the rank is exact once rebuilt (it lost everything, or was exact)


class Stream(Generic[B]):
    """The ordering state of one rank; ``status`` is updated in place."""

    def __init__(
        self,
        status: RankCounts,
        rules: Rules,
        decode: Callable[[bytes], B | None],
        missing: Callable[[int, int], Any],
        now: float,
    ) -> None:
        self.status = status
        self._rules = rules
        self._decode = decode
        self._missing = missing
        self._out: list[Action] = []
        self.mark: Mark | None = None  # last applied batch
        self._seen: Mark | None = None  # highest seq and highest ts received, this incarnation
        self.next = 0  # the seq to apply next
        self._pending: dict[int, tuple[bytes, float]] = {}  # held until ``next`` reaches them
        self._pending_bytes = 0
        self._heap: list[int] = []  # the held seqs, lowest first
        self._gap: _Gap | None = None
        self.request: _Request | None = None
        self.replay_wanted = False
        self._attempts = 0
        self._unanswered = 0  # replay requests in a row that got no frame at all
        self.replay_activity = 0.0
        self._last_received = self._last_probe = now
        self.received_ts: float | None = None  # ts of the newest received batch
        self.losses_seen = 0  # the store's last loss this rank resynchronised after
        self._rebuild: _Rebuild | None = None
        self.snapshot_wanted = False  # a range was given up: ask the engine for its state
        self.restoring = False  # a snapshot was asked: hold every batch until it comes
        self._snapshot_after = 0.0  # when a failed snapshot may be asked again

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    # --- inputs: batches -----------------------------------------------------------

    def live(self, seq: int, ts: float, payload: bytes, now: float) -> list[Action]:
        """A live batch (its frames split and its ts read; its payload not yet decoded)."""
        self._offer(seq, payload, ts, True, now)
        return self._take()

    def _offer(self, seq: int, payload: bytes, ts: float, live: bool, now: float) -> None:
        """Take one received batch into the ordered stream: a batch applied at
        once is decoded once; one held behind a gap is decoded to check it,
        then kept encoded."""
        batch = None
        if self._is_restart(seq, ts):
            if (batch := self._decode(payload)) is None:
                return
            self._restart(seq)
        if seq < self.next or seq in self._pending:
            self.status.duplicates += 1
            self._out.append(Duplicate())
            return
        if batch is None and (batch := self._decode(payload)) is None:
            return
        self._received(seq, ts, live, now)
        if seq == self.next and not self._heap and not self.restoring:
            self._apply(seq, ts, batch)
            return
        del batch
        self._pending[seq] = (payload, ts)
        self._pending_bytes += len(payload)
        heapq.heappush(self._heap, seq)
        if self._over_bound():
            if self.restoring:  # the oldest go: replay or the snapshot covers them
                self._drop_held(self._heap[0])
            elif self._heap[0] > self.next:
                self._give_up(self.next, self._heap[0] - 1, "too many batches held")
        self._drain()
        self._watch_gap()

    def _over_bound(self) -> bool:
        rules = self._rules
        return len(self._pending) > rules.max_pending or self._pending_bytes > rules.pending_bytes

    def _drop_held(self, through: int) -> int:
        """Forget the held batches up to seq ``through``; returns how many."""
        heap, dropped = self._heap, 0
        while heap and heap[0] <= through:
            payload, _ = self._pending.pop(heapq.heappop(heap))
            self._pending_bytes -= len(payload)
            dropped += 1
        return dropped

    def _apply(self, seq: int, ts: float, batch: B) -> None:
        self.next = seq + 1
        self._out.append(Apply(seq, ts, batch))

    def _received(self, seq: int, ts: float, live: bool, now: float) -> None:
        """A batch that decodes was received: the newest seq and ts may move."""
        status = self.status
        if live or status.last_seq is None or seq > status.last_seq:
            status.last_seq = seq
            self.received_ts = ts
        if status.last_event_ts is None or ts > status.last_event_ts:
            status.last_event_ts = ts
        self._last_received = now
        seen = self._seen
        if seen is None:
            self._seen = Mark(seq, ts)
        elif seq > seen.seq or ts > seen.ts:
            self._seen = Mark(max(seq, seen.seq), max(ts, seen.ts))

    def _is_restart(self, seq: int, ts: float) -> bool:
        """A seq already seen, from a newer batch: the engine numbers from 0 again.

        Newer than every batch seen, not just than that seq's, so an engine
        clock stepping back cannot pass for a restart; the last applied seq
        itself (a replay's first answer) is compared with its own ts.
        """
        mark, seen = self.mark, self._seen
        return (mark is not None and seq == mark.seq and ts > mark.ts) or (
            seen is not None and seq <= seen.seq and ts > seen.ts
        )

    # --- gaps ----------------------------------------------------------------------

    def _drain(self) -> None:
        """Apply held batches while they continue the stream (each decoded only when
        its turn comes: :class:`ApplyHeld`); none while a snapshot is awaited."""
        heap, pending = self._heap, self._pending
        while not self.restoring and heap and heap[0] <= self.next:
            seq = heapq.heappop(heap)
            payload, ts = pending.pop(seq)
            self._pending_bytes -= len(payload)
            if seq == self.next:
                self.next = seq + 1
                self._out.append(ApplyHeld(seq, ts, payload))
        self._close_gap()

    def _forget_pending(self) -> None:
        self._pending.clear()
        self._heap.clear()
        self._pending_bytes = 0

    @property
    def pending(self) -> int:
        """Batches held behind a gap."""
        return len(self._pending)

    def reached(self, queued: int | None = None) -> int:
        """The newest seq of this incarnation the rank applied, received (``queued``:
        the newest its readers received that it has not taken yet) or is rebuilding
        up to after a store loss; -1: none. A rank is exact again only past it."""
        seqs = (self.mark, self._seen)
        rebuilding = -1 if self._rebuild is None else self._rebuild.last
        newest = max(rebuilding, -1 if queued is None else queued)
        return max(newest, *(-1 if m is None else m.seq for m in seqs))

    def _hole(self) -> tuple[int, int] | None:
        """The missing range before the lowest held batch, if any."""
        if self._heap and self._heap[0] > self.next:
            return self.next, self._heap[0] - 1
        return None

    def _watch_gap(self) -> None:
        """Start repairing a hole, unless a repair, a replay or a snapshot is under way."""
        if self.restoring:
            return
        while (hole := self._hole()) and self._gap is None and self.request is None:
            self._open_gap(*hole)
            if self._rules.has_replay:
                self.replay_wanted = True
                return
            self._give_up(*hole, "no replay endpoint")
            self._drain()

    def _open_gap(self, first: int, last: int) -> None:
        self._gap = _Gap(first, last)
        self.status.gaps += 1
        self._out.append(GapOpened(first, last))

    def _close_gap(self) -> None:
        gap = self._gap
        if gap is None or self.next <= gap.last:
            return
        self._gap = None
        if not gap.missed:
            self.status.gaps_filled += 1
            self._out.append(GapFilled(gap.first, gap.last))

    def _give_up(self, first: int, last: int, why: str) -> None:
        """Declare ``first..last`` lost: degrade the rank and move past it."""
        if self._gap is None:
            self._open_gap(first, last)
        gap, status = self._gap, self.status
        gap.last = max(gap.last, last)
        newly = not gap.missed
        if newly:
            gap.missed = True
            status.gaps_unfilled += 1
        status.missing.append(self._missing(first, last))
        del status.missing[:-MAX_MISSING]
        status.degraded = True
        clear = last - first + 1 > self._rules.gap_clear_threshold
        self._out.append(GaveUp(first, last, why, clear, newly))
        if clear:
            self._out.append(Clear(VOLATILE))
        self.next = last + 1
        self._attempts = 0
        self._close_gap()
        self.snapshot_wanted = self._rules.has_snapshot

    def _restart(self, seq: int | None) -> None:
        """The engine restarted: forget its GPU/CPU counts and its numbering.

        The new incarnation's stream is whole, so its gaps and losses are
        forgotten; a rank rebuilding after a store loss stays degraded until it
        has applied the new incarnation up to ``seq`` (the batch that showed the
        restart; None: it published nothing yet), not from the moment its
        counts are cleared.
        """
        status = self.status
        status.restarts += 1
        self._out.append(Restarted(status.applied_seq, seq))
        self._abandon_request()
        self._out.append(Clear(VOLATILE, reset_seq=True))
        self.mark = self._seen = None
        self.next = 0
        self._forget_pending()
        self._gap = None
        self._attempts = 0
        status.applied_seq = None
        status.missing = []
        rebuild = self._rebuild
        if rebuild is None:
            status.degraded, status.store_loss = False, None
        else:
            rebuild.last = -1 if seq is None else seq
            rebuild.gaps_unfilled, rebuild.clean = status.gaps_unfilled, True
        self.replay_wanted = self._rules.has_replay
        self.snapshot_wanted = self.restoring = False  # an answer now is the old one's

    def _end_request(self, close: bool) -> _Request:
        request, self.request = self.request, None
        self._out.append(EndRequest(close))
        return request

    def _abandon_request(self) -> None:
        if self.request is not None:
            self._end_request(close=True)
