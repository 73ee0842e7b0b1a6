"""The whole sequencer: the ordered stream, replay requests and store losses."""

from __future__ import annotations

from indexer.core.sequencer.actions import (
    Action,
    Ask,
    B,
    Duplicate,
    Mark,
    RebuildSettled,
    ReplayTimedOut,
    Restored,
    SnapshotFailed,
    StoreLossFound,
)
from indexer.core.sequencer.stream import Stream, _Rebuild, _Request


class Sequencer(Stream[B]):
    """One rank's seq/gap/restart rules (see :mod:`indexer.core.sequencer`)."""

    # --- inputs: the store ---------------------------------------------------------

    def loaded(self, stored: Mark | None) -> list[Action]:
        """The store's watermark for the rank, read at start: continue after it
        (and ask replay from it, which also reveals a restart while we were away)."""
        self.mark = self._seen = stored
        self.next = stored.seq + 1 if stored else 0
        self.status.applied_seq = stored.seq if stored else None
        self.replay_wanted = self._rules.has_replay
        return self._take()

    def applied(self, seq: int, ts: float, fresh: bool) -> None:
        """The store applied ``seq`` (``fresh``: it did not have it already)."""
        self.mark = Mark(seq, ts)
        self.status.applied_seq = seq
        if not fresh:  # another writer applied it first
            self.status.duplicates += 1

    def resync(
        self,
        loss_number: int,
        reason: str,
        wiped: bool,
        stored: Mark | None,
        reached: int = -1,
    ) -> list[Action]:
        """The store lost data (loss ``loss_number``); ``stored`` is its watermark now;
        ``reached``: the newest seq the rank's readers received, taken or not.

        A rank whose stored watermark is its own lost nothing; a batch in hand
        (its store call ended with the news) is asked from replay again.
        Otherwise the rank is degraded, with the reason in its status, until it
        has applied again every batch it had reached, applied or received
        (:meth:`settle_rebuild`).
        """
        self.losses_seen = loss_number
        had, status = self.mark, self.status
        if stored == had and self.next == (0 if had is None else had.seq + 1):
            return self._take()
        reached = self.reached(reached)
        self._abandon_request()
        self.mark = stored
        self.next = stored.seq + 1 if stored else 0
        self._forget_pending()
        self._gap, self._attempts = None, 0
        status.applied_seq = stored.seq if stored else None
        self.replay_wanted = self._rules.has_replay
        if had is not None and had.seq >= self.next:  # else the store is ahead: nothing lost
            lost = f"batches {self.next}..{had.seq}"
            self._begin_rebuild(reached, reason, lost, wiped or not status.degraded)
        return self._take()

    def loss_in_doubt(self, number: int, reason: str) -> str | None:
        """The ``store_loss`` of a rank whose store noticed loss ``number`` until the rank
        resynchronises after it (None: it did, or it applied nothing it could lose).

        The rank is degraded from the moment the store knows, not only once its
        own next store call finds out: it may be sleeping between two store
        retries, or waiting for its worker to claim it anew.
        """
        if number == self.losses_seen or self.mark is None:
            return None
        return f"{reason}; finding which batches were lost"

    @property
    def rebuild_after_loss(self) -> tuple[int, str] | None:
        """The newest batch a rebuild after a store loss must apply again, and the loss;
        None when no such rebuild is under way."""
        rebuild = self._rebuild
        return None if rebuild is None or rebuild.reason is None else (rebuild.last, rebuild.reason)

    def rebuilding(self, last: int, reason: str) -> list[Action]:
        """The rank's previous consumer had applied up to ``last`` when the store
        lost data (a worker claiming it anew): degraded until that is applied again."""
        self._begin_rebuild(last, reason, f"batches up to {last}", clean=True)
        return self._take()

    def _begin_rebuild(self, last: int, reason: str, lost: str, clean: bool) -> None:
        status = self.status
        self._rebuild = _Rebuild(last, reason, status.gaps_unfilled, clean)
        status.degraded = True
        status.store_loss = f"{reason}; {lost} lost, being applied again from replay"
        self._out.append(StoreLossFound(lost))

    def settle_rebuild(self) -> list[Action]:
        """End a rebuild once it is settled: exact again, or degraded for good.

        Exact when every batch it had to apply again was applied with no gap
        given up meanwhile (after an engine restart: the new incarnation's,
        whose stream is whole); a rank that was already degraded stays so
        unless it lost everything and replay brought it all back. Called
        between two turns of the rank's loop, once the batches the sequencer
        answered are in the store: never while one is still being applied.
        """
        rebuild, status = self._rebuild, self.status
        if rebuild is None or self.next <= rebuild.last:
            return []
        exact = status.gaps_unfilled == rebuild.gaps_unfilled
        self._rebuild = None
        if exact:
            status.store_loss = None
            status.degraded = status.degraded and not rebuild.clean
        elif rebuild.reason is not None:
            missing = status.missing[-1] if status.missing else None
            lost = f" (batches {missing.first}..{missing.last} missing)" if missing else ""
            status.store_loss = f"{rebuild.reason}; replay could not apply every lost batch{lost}"
        # (a snapshot's held batches, no loss: nothing to tell operators)
        return [] if rebuild.reason is None else [RebuildSettled(rebuild.last, exact)]

    # --- inputs: snapshots ------------------------------------------------------------

    def snapshot_due(self, now: float) -> bool:
        """Whether to ask the engine for a snapshot now."""
        return self.snapshot_wanted and not self.restoring and now >= self._snapshot_after

    def snapshot_sent(self) -> None:
        """The caller asked for a snapshot: batches are held until it is applied."""
        self.snapshot_wanted, self.restoring = False, True
        self._abandon_request()  # what it would bring, the snapshot holds or follows

    def restored(self, seq: int, ts: float) -> list[Action]:
        """The caller applied the engine's snapshot as of batch ``seq`` (published at
        ``ts``; ``seq`` -1: the engine published nothing yet) as the rank's whole
        state: exact once the held batches after ``seq`` follow, and degraded
        until then (each is applied in its own store call, queries in between)."""
        status, rebuild, reached = self.status, self._rebuild, self.reached()
        self.restoring = False
        self.mark = None if seq < 0 else Mark(seq, ts)
        seen = self._seen
        if self.mark is not None:
            self._seen = Mark(max(seq, seen.seq), max(ts, seen.ts)) if seen else self.mark
        self.next = seq + 1
        dropped = self._drop_held(seq)
        self._gap, self._attempts = None, 0
        status.applied_seq = None if seq < 0 else seq
        status.restores += 1
        status.missing, status.snapshot_error = [], None
        if reached > seq:
            reason = None if rebuild is None else rebuild.reason
            self._rebuild = _Rebuild(reached, reason, status.gaps_unfilled, clean=True)
            status.degraded = True
        else:
            self._rebuild = None
            status.degraded, status.store_loss = False, None
        self._out.append(Restored(seq, dropped))
        self._drain()
        self._watch_gap()
        # from the snapshot's seq: what was not held since, and proof of the incarnation
        self.replay_wanted = self._rules.has_replay
        return self._take()

    def snapshot_failed(self, now: float, reason: str, retry: float | None = None) -> list[Action]:
        """No snapshot came (none served, refused, timed out, not valid, or the store
        failed applying it): the held batches go on as after a gap given up;
        another is asked ``retry`` seconds from now (default ``snapshot_retry``)."""
        if not self.restoring:
            return []
        retry = self._rules.snapshot_retry if retry is None else retry
        self.restoring, self.snapshot_wanted = False, True
        self._snapshot_after = now + retry
        self.status.snapshot_error = reason
        self._out.append(SnapshotFailed(reason, retry))
        if self._heap and self._heap[0] > self.next:
            self._give_up(self.next, self._heap[0] - 1, "missed while a snapshot was awaited")
        self._drain()
        self._watch_gap()
        return self._take()

    def holds(self, seq: int) -> bool:
        """Whether a replayed seq (not the anchor) is already held or applied, so its
        reader may skip reading its ts (see :meth:`replay_held`)."""
        request = self.request
        return (
            request is not None
            and seq > request.start
            and (seq < self.next or seq in self._pending)
        )

    def _answered(self, now: float) -> _Request | None:
        request = self.request
        if request is not None:
            self._unanswered = 0
            request.received += 1  # garbage too: an answer with frames is no empty buffer
            self.replay_activity = now  # progress, even if the reader waits on us
        return request

    def replay_batch(self, seq: int, ts: float, payload: bytes, now: float) -> list[Action]:
        """A batch of the replay answer in flight (ignored without a request)."""
        request = self._answered(now)
        if request is None:
            return []
        if request.first_new is None and seq >= request.want:
            request.first_new = seq
        if seq >= request.want or self._is_restart(seq, ts):
            # (an anchor offered is another incarnation's)
            self._offer(seq, payload, ts, False, now)
        return self._take()

    def replay_held(self, seq: int, now: float) -> list[Action]:
        """A replayed seq :meth:`holds` said is already held or applied."""
        request = self._answered(now)
        if request is None:
            return []
        if request.first_new is None and seq >= request.want:
            request.first_new = seq
        self.status.duplicates += 1
        return [Duplicate()]

    def replay_garbage(self, now: float) -> list[Action]:
        """A replayed frame that was no batch: the seq stays missing."""
        self._answered(now)
        return []

    # --- replay --------------------------------------------------------------------

    def replay_deadline(self) -> float:
        """When the request in flight times out: ``replay_timeout`` after it was
        sent or after its last frame, whichever is later."""
        request = self.request
        return max(request.sent_at, self.replay_activity) + self._rules.replay_timeout

    def _probe_due(self) -> float:
        """When the next probe is due: ``probe_interval`` after the last batch or
        probe, doubled for each probe in a row that got no answer, up to
        ``probe_backoff_max``."""
        rules = self._rules
        wait = min(rules.probe_interval * 2 ** min(self._unanswered, 32), rules.probe_backoff_max)
        return max(self._last_received, self._last_probe) + wait

    def replay_due(self, now: float, connected: bool) -> Ask | None:
        """The request to send now, if one is due (none is in flight)."""
        if not (self._rules.has_replay and connected) or self.request or self.restoring:
            return None
        probe = not self.replay_wanted
        if probe and not (self._rules.probe_interval and now >= self._probe_due()):
            return None
        mark = self.mark
        # Ask from the last applied seq itself: its answer proves the same incarnation.
        start = mark.seq if mark is not None and mark.seq == self.next - 1 else self.next
        return Ask(start, probe)

    def replay_sent(self, ask: Ask, now: float) -> None:
        """The caller sent ``ask`` (holding a replay slot until an :class:`EndRequest`)."""
        self.request = _Request(ask.start, self.next, now, ask.probe)
        self.replay_wanted = False
        self._last_probe = now  # any request asks what a probe would
        if not ask.probe:
            self.status.replays += 1

    def idle_timeout(self, now: float, connected: bool, slot_poll: float) -> float | None:
        """Seconds until the replay or snapshot rules have something to do; None:
        nothing (no publisher connected: replay is asked again when one connects).
        ``slot_poll``: how soon to look again for a free slot when one is wanted."""
        replay = self._replay_timeout(now, connected, slot_poll)
        if not self.snapshot_wanted or self.restoring:
            return replay
        snapshot = max(slot_poll, self._snapshot_after - now)
        return snapshot if replay is None else min(replay, snapshot)

    def _replay_timeout(self, now: float, connected: bool, slot_poll: float) -> float | None:
        if self.request is not None:
            return max(0.0, self.replay_deadline() - now)
        if not (self._rules.has_replay and connected):
            return None
        if self.replay_wanted:
            return slot_poll
        if self._rules.probe_interval:
            return max(0.0, self._probe_due() - now)
        return None

    def connected(self) -> None:
        """A publisher is there: ask it soon whether anything was missed while it was not."""
        self._unanswered = 0
        self._last_probe = self._last_received = float("-inf")  # a probe is due now

    def replay_end(self) -> list[Action]:
        """The end marker of the replay answer in flight."""
        if self.request is None:
            return []
        self._unanswered = 0
        request = self._end_request(close=False)
        if request.start < request.want and request.received == 0:
            # The engine published the asked-for seq; a buffer without it is a new incarnation's.
            self._restart(None)
            return self._take()
        if request.first_new is not None and request.first_new > self.next:
            self._give_up(self.next, request.first_new - 1, "not in the replay buffer")
        self._drain()
        if (hole := self._hole()) is not None:
            if self._retry_hole(request, hole):
                return self._take()
            self._give_up(*hole, "replay did not fill it")
            self._drain()
        self._attempts = 0
        self._watch_gap()
        return self._take()

    def _retry_hole(self, request: _Request, hole: tuple[int, int]) -> bool:
        """Count an attempt that left ``hole``; whether another is allowed (and wanted)."""
        self._attempts = 0 if self.next > request.want else self._attempts + 1
        if self._attempts >= self._rules.replay_attempts:
            return False
        if self._gap is None:
            self._open_gap(*hole)
        self.replay_wanted = True
        return True

    def replay_timed_out(self) -> list[Action]:
        """The request in flight got no end marker by :meth:`replay_deadline`."""
        request = self._end_request(close=True)
        if request.received == 0:
            self._unanswered += 1
        unavailable = False
        if not request.probe:
            self._attempts = 0 if self.next > request.want else self._attempts + 1
            if self._attempts < self._rules.replay_attempts:
                self.replay_wanted = True
                self._out.append(ReplayTimedOut(request.start, self._unanswered, False))
                return self._take()
            self._attempts = 0
            unavailable = True
        self._out.append(ReplayTimedOut(request.start, self._unanswered, unavailable))
        if unavailable and (hole := self._hole()) is not None:
            self._give_up(*hole, "replay unavailable")
            self._drain()
        self._watch_gap()
        return self._take()

    def stop(self) -> list[Action]:
        """The consumer stops: end the request in flight and free what is held."""
        if self.request is not None:
            self._end_request(close=True)
        self._forget_pending()
        return self._take()
