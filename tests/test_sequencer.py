"""The seq/gap/restart rules, fed events directly: no sockets, no store, no sleeps.

A :class:`Shell` plays the rank consumer's part: it performs the actions the
sequencer answers (an applied batch is acknowledged at once) and records
them, so each test says what happened and checks what was applied.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.sequencer import (
    VOLATILE,
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
    RebuildSettled,
    ReplayTimedOut,
    Restarted,
    Sequencer,
)
from indexer.engine_registry import Gap, RankStatus
from indexer.ingest.settings import SubscriberSettings

T0 = 1_000.0  # the engine's clock when it published seq 0 (one second per seq)
BAD = b"garbage"


class Shell:
    """Performs a sequencer's actions the way a consumer with a perfect store would."""

    def __init__(
        self,
        stored: Mark | None = None,
        has_replay: bool = True,
        has_snapshot: bool = False,
        **limits: object,
    ) -> None:
        self.status = RankStatus(0)
        self.decoded = 0
        rules = SubscriberSettings(**limits).rules(has_replay, has_snapshot)
        self.seq = Sequencer(self.status, rules, self._decode, self._missing, 0.0)
        self.applied: list[int] = []
        self.actions: list[object] = []
        self.now = 0.0
        self.run(self.seq.loaded(stored))

    @staticmethod
    def _missing(first: int, last: int) -> Gap:
        return Gap(first, last, 0.0)

    def _decode(self, payload: bytes) -> bytes | None:
        self.decoded += 1
        return None if payload == BAD else payload

    def run(self, actions: list) -> None:
        for action in actions:
            self.actions.append(action)
            if isinstance(action, ApplyHeld):  # decoded only now
                action = Apply(action.seq, action.ts, self._decode(action.payload))
            if isinstance(action, Apply):
                assert action.batch == b"batch %d" % action.seq
                self.applied.append(action.seq)
                self.seq.applied(action.seq, action.ts, True)

    def turn(self) -> None:
        """The consumer's next loop turn: a rebuild whose batches are all applied settles."""
        self.run(self.seq.settle_rebuild())

    def of(self, kind: type) -> list:
        return [a for a in self.actions if isinstance(a, kind)]

    def live(self, seq: int, ts: float | None = None, payload: bytes | None = None) -> None:
        ts = T0 + seq if ts is None else ts
        self.run(self.seq.live(seq, ts, payload or b"batch %d" % seq, self.now))

    def ask(self) -> Ask | None:
        """Send the replay request due now, if any."""
        ask = self.seq.replay_due(self.now, connected=True)
        if ask is not None:
            self.seq.replay_sent(ask, self.now)
        return ask

    def answer(self, seqs, ts_of=lambda seq: T0 + seq) -> None:
        """The engine's replay answer: these buffered seqs, then the end marker."""
        for seq in seqs:
            if self.seq.holds(seq):
                self.run(self.seq.replay_held(seq, self.now))
            else:
                self.run(self.seq.replay_batch(seq, ts_of(seq), b"batch %d" % seq, self.now))
        self.run(self.seq.replay_end())


def test_in_order_batches_are_applied_once_each() -> None:
    shell = Shell()
    for seq in range(5):
        shell.live(seq)
    assert shell.applied == [0, 1, 2, 3, 4]
    assert shell.status.applied_seq == 4 and shell.status.last_seq == 4
    assert shell.decoded == 5  # a batch applied at once is decoded once


def test_a_gap_is_held_back_and_filled_by_replay_from_the_last_applied_seq() -> None:
    shell = Shell()
    for seq in (0, 1, 3, 4):
        shell.live(seq)
    assert shell.applied == [0, 1]
    assert shell.of(GapOpened) == [GapOpened(2, 2)]
    assert shell.seq.pending == 2
    assert shell.ask() == Ask(1, probe=False)  # the anchor: proves the same incarnation
    shell.answer([1, 2, 3, 4])
    assert shell.applied == [0, 1, 2, 3, 4]
    assert shell.of(GapFilled) == [GapFilled(2, 2)]
    assert shell.status.gaps == shell.status.gaps_filled == 1
    assert not shell.status.degraded and shell.status.replays == 1
    assert shell.of(EndRequest) == [EndRequest(close=False)]


def test_live_and_replayed_copies_are_applied_once_and_duplicates_not_decoded() -> None:
    shell = Shell()
    for seq in (0, 2, 3):
        shell.live(seq)
    shell.ask()
    decoded = shell.decoded
    shell.answer([0, 1, 2, 3])  # 2 and 3 are held: the reader skips them
    assert shell.decoded == decoded + 4  # 1 (checked, then applied), 2 and 3 where held
    shell.live(3)  # live again, late
    shell.live(1)
    assert shell.applied == [0, 1, 2, 3]
    assert shell.status.duplicates == 4 == len(shell.of(Duplicate))
    assert shell.decoded == decoded + 4


def test_a_replay_starting_later_than_asked_gives_up_the_seqs_it_lacks() -> None:
    shell = Shell()
    shell.live(0)
    shell.live(6)
    shell.ask()
    shell.answer([4, 5, 6])  # the buffer no longer has 1..3
    assert shell.applied == [0, 4, 5, 6]
    assert shell.of(GaveUp) == [GaveUp(1, 3, "not in the replay buffer", False, True)]
    assert shell.status.degraded and shell.status.missing == [Gap(1, 3, 0.0)]
    assert shell.status.gaps_unfilled == 1 and shell.status.gaps_filled == 0


def test_a_buffer_that_skips_seqs_leaves_permanent_holes() -> None:
    shell = Shell()
    for seq in (0, 1, 3, 6):
        shell.live(seq)
    shell.ask()
    shell.answer([1, 2, 3, 5, 6])  # 4 is not in the buffer: 5 answered after 3
    assert shell.applied == [0, 1, 2, 3]
    assert shell.ask() == Ask(3, probe=False)  # the hole left: 4
    shell.answer([3, 5, 6])
    assert shell.of(GaveUp) == [GaveUp(4, 4, "not in the replay buffer", False, True)]
    assert shell.applied == [0, 1, 2, 3, 5, 6]


def test_answers_that_fill_nothing_give_the_gap_up_after_the_replay_attempts() -> None:
    shell = Shell(replay_attempts=3)
    for seq in (0, 1, 3):
        shell.live(seq)
    for attempt in range(3):
        assert shell.ask() is not None, attempt
        shell.answer([1])  # only the anchor (the rest was dropped on the way)
    assert shell.ask() is None
    assert shell.applied == [0, 1, 3]
    assert shell.of(GaveUp) == [GaveUp(2, 2, "replay did not fill it", False, True)]


def test_replay_timeouts_are_retried_then_the_gap_is_given_up() -> None:
    shell = Shell(replay_attempts=2, replay_timeout=2.0)
    for seq in (0, 2):
        shell.live(seq)
    shell.ask()
    assert shell.seq.replay_deadline() == 2.0
    assert shell.seq.idle_timeout(1.5, True, 0.05) == 0.5
    shell.run(shell.seq.replay_timed_out())
    assert shell.of(ReplayTimedOut) == [ReplayTimedOut(0, 1, False)]
    assert shell.of(EndRequest) == [EndRequest(close=True)]  # no late answer arrives
    assert shell.applied == [0] and not shell.status.degraded
    shell.ask()
    shell.run(shell.seq.replay_timed_out())
    assert shell.of(ReplayTimedOut)[-1] == ReplayTimedOut(0, 2, True)
    assert shell.of(GaveUp) == [GaveUp(1, 1, "replay unavailable", False, True)]
    assert shell.applied == [0, 2]


def test_an_answer_to_no_request_is_ignored() -> None:
    shell = Shell()
    shell.live(0)
    shell.run(shell.seq.replay_batch(1, T0 + 1, b"batch 1", 0.0))
    shell.run(shell.seq.replay_end())
    assert shell.applied == [0] and shell.seq.next == 1


def test_a_long_unfilled_gap_drops_the_gpu_and_cpu_counts() -> None:
    shell = Shell(has_replay=False, gap_clear_threshold=3)
    shell.live(0)
    shell.live(3)  # 1..2: kept
    shell.live(10)  # 4..9: too long to trust the counts
    assert shell.of(GaveUp) == [
        GaveUp(1, 2, "no replay endpoint", False, True),
        GaveUp(4, 9, "no replay endpoint", True, True),
    ]
    assert shell.of(Clear) == [Clear(VOLATILE)]
    assert shell.applied == [0, 3, 10]


def test_too_many_held_batches_give_the_gap_up() -> None:
    shell = Shell(max_pending=3)
    shell.live(0)
    for seq in (2, 3, 4):
        shell.live(seq)
    assert shell.applied == [0]
    shell.live(5)  # a fourth held batch
    assert shell.of(GaveUp) == [GaveUp(1, 1, "too many batches held", False, True)]
    assert shell.applied == [0, 2, 3, 4, 5] and shell.seq.pending == 0


def test_held_bytes_are_bounded_too() -> None:
    shell = Shell(pending_bytes=20)
    shell.live(0)
    shell.live(2)
    shell.live(3)
    assert shell.applied == [0]
    shell.live(4)  # 3 x 7 bytes held
    assert shell.applied == [0, 2, 3, 4]


def test_a_live_restart_drops_the_volatile_counts_and_numbers_from_the_new_seq() -> None:
    shell = Shell()
    for seq in range(4):
        shell.live(seq)
    shell.live(0, ts=T0 + 100)  # seq 0 again, published after everything seen
    assert shell.of(Restarted) == [Restarted(3, 0)]
    assert shell.of(Clear) == [Clear(VOLATILE, reset_seq=True)]
    assert shell.applied == [0, 1, 2, 3, 0]
    assert shell.status.restarts == 1 and shell.status.applied_seq == 0
    shell.live(1, ts=T0 + 101)
    assert shell.applied[-1] == 1


def test_an_engine_clock_stepping_back_is_no_restart() -> None:
    shell = Shell()
    for seq in range(4):
        shell.live(seq)
    shell.live(2, ts=T0 + 2.5)  # newer than seq 2's, not newer than every batch seen
    assert shell.status.restarts == 0 and shell.status.duplicates == 1


def test_a_replay_anchor_with_a_newer_ts_reveals_a_restart_while_the_indexer_was_down() -> None:
    shell = Shell(stored=Mark(5, T0 + 5))
    assert shell.seq.next == 6
    assert shell.ask() == Ask(5, probe=False)
    new = lambda seq: T0 + 500 + seq  # noqa: E731
    shell.answer([5, 6], ts_of=new)  # another incarnation's 5
    assert shell.of(Restarted) == [Restarted(5, 5)]
    assert shell.of(Clear) == [Clear(VOLATILE, reset_seq=True)]
    assert shell.of(EndRequest) == [EndRequest(close=True)]  # the rest of it is ignored
    assert shell.applied == [] and shell.of(GapOpened) == [GapOpened(0, 4)]
    assert shell.ask() == Ask(0, probe=False)
    shell.answer(range(7), ts_of=new)
    assert shell.applied == list(range(7))


def test_a_replay_anchor_with_its_own_ts_proves_the_same_incarnation() -> None:
    shell = Shell(stored=Mark(5, T0 + 5))
    shell.ask()
    shell.answer([5, 6, 7])
    assert shell.status.restarts == 0 and shell.applied == [6, 7]


def test_an_empty_answer_to_the_anchor_reveals_a_restart() -> None:
    shell = Shell(stored=Mark(5, T0 + 5))
    shell.ask()
    shell.answer([])  # the engine published 5: a buffer without it is a new incarnation's
    assert shell.of(Restarted) == [Restarted(5, None)]
    assert shell.seq.next == 0 and shell.seq.replay_wanted


def test_a_restart_across_an_indexer_restart_is_seen_live() -> None:
    shell = Shell(stored=Mark(5, T0 + 5))
    shell.live(2, ts=T0 + 50)
    assert shell.status.restarts == 1 and shell.applied == []  # 2 waits for 0..1
    shell.live(6)  # an older incarnation's: not after the new stream
    assert shell.status.restarts == 1


def test_garbage_neither_moves_the_newest_seq_nor_passes_for_a_restart() -> None:
    shell = Shell()
    for seq in range(4):
        shell.live(seq)
    shell.live(1, ts=T0 + 100, payload=BAD)  # would be a restart, if it decoded
    shell.live(9, ts=T0 + 9, payload=BAD)
    assert shell.status.restarts == 0 and shell.status.last_seq == 3
    assert shell.of(GapOpened) == []
    shell.live(4)
    assert shell.applied == [0, 1, 2, 3, 4]


def test_replayed_garbage_counts_as_an_answer_but_leaves_the_seq_missing() -> None:
    shell = Shell(replay_attempts=1)
    shell.live(0)
    shell.live(2)
    shell.ask()
    shell.run(shell.seq.replay_garbage(0.0))
    shell.run(shell.seq.replay_end())
    assert shell.status.restarts == 0  # not an empty buffer
    assert shell.of(GaveUp) == [GaveUp(1, 1, "replay did not fill it", False, True)]


def test_idle_probes_back_off_while_unanswered_and_reset_on_connect() -> None:
    shell = Shell(probe_interval=5.0, probe_backoff_max=12.0, replay_timeout=1.0)
    shell.ask()  # the catch-up request of the start
    shell.answer([])
    assert shell.seq.replay_due(4.9, connected=True) is None
    assert shell.seq.replay_due(5.0, connected=False) is None  # nobody to ask
    for due in (5.0, 15.0, 27.0):  # 5 s after the last probe, then 10 s, then 12 s (the cap)
        shell.now = due
        assert shell.seq.replay_due(due - 0.01, True) is None
        assert shell.ask() == Ask(0, probe=True)
        shell.now = due + 1.0
        shell.run(shell.seq.replay_timed_out())
    shell.seq.connected()
    assert shell.seq.replay_due(shell.now, True) == Ask(0, probe=True)
    assert shell.status.replays == 1  # probes are not replays


def test_a_store_loss_resumes_from_the_stored_watermark_and_rebuilds() -> None:
    shell = Shell()
    for seq in range(10):
        shell.live(seq)
    shell.run(shell.seq.resync(1, "redis restarted", False, Mark(4, T0 + 4)))
    status = shell.status
    assert status.degraded and status.applied_seq == 4 and shell.seq.next == 5
    assert status.store_loss.startswith("redis restarted; batches 5..9 lost")
    assert shell.seq.settle_rebuild() == []
    assert shell.ask() == Ask(4, probe=False)
    shell.answer(range(4, 10))
    assert shell.applied == [*range(10), *range(5, 10)]
    assert shell.seq.settle_rebuild() == [RebuildSettled(9, exact=True)]
    assert status.store_loss is None and not status.degraded


def test_a_store_loss_that_replay_cannot_repair_stays_degraded() -> None:
    shell = Shell()
    for seq in range(10):
        shell.live(seq)
    shell.run(shell.seq.resync(1, "redis restarted", True, None))
    shell.ask()
    shell.answer(range(6, 10))  # 0..5 are gone from the buffer too
    assert shell.seq.settle_rebuild() == [RebuildSettled(9, exact=False)]
    assert "could not apply every lost batch (batches 0..5 missing)" in shell.status.store_loss


def test_a_store_loss_of_nothing_of_ours_changes_nothing() -> None:
    shell = Shell()
    for seq in range(3):
        shell.live(seq)
    assert shell.seq.resync(1, "redis restarted", False, Mark(2, T0 + 2)) == []
    assert shell.seq.losses_seen == 1 and not shell.status.degraded


def test_a_store_loss_that_ended_the_batch_in_hand_asks_it_again() -> None:
    """Batch 3's store call ended with the news of a loss that took nothing of the
    rank's: 3 comes back by replay, it is not skipped."""
    shell = Shell()
    for seq in range(3):
        shell.live(seq)
    in_hand = shell.seq.live(3, T0 + 3, b"batch 3", shell.now)  # not acknowledged
    assert [a.seq for a in in_hand if isinstance(a, Apply)] == [3]
    shell.run(shell.seq.resync(1, "redis restarted", False, Mark(2, T0 + 2)))
    assert not shell.status.degraded and shell.status.store_loss is None
    assert shell.ask() == Ask(2, probe=False)
    shell.answer([2, 3])
    assert shell.applied == [0, 1, 2, 3]


def test_a_store_loss_is_in_doubt_from_when_the_store_knows_until_the_rank_resyncs() -> None:
    """What the status says of a loss between its notice and the rank's resync (the rank
    may be sleeping between store retries): in doubt if the rank applied anything."""
    shell = Shell()
    assert shell.seq.loss_in_doubt(1, "redis restarted") is None  # nothing applied to lose
    shell.live(0)
    assert shell.seq.loss_in_doubt(1, "redis restarted") == (
        "redis restarted; finding which batches were lost"
    )
    shell.run(shell.seq.resync(1, "redis restarted", False, Mark(0, T0)))
    assert shell.seq.loss_in_doubt(1, "redis restarted") is None  # it lost nothing
    assert shell.seq.loss_in_doubt(2, "again") is not None


def test_a_store_loss_abandons_the_request_in_flight() -> None:
    shell = Shell()
    shell.live(0)
    shell.live(2)
    shell.ask()
    shell.run(shell.seq.resync(1, "redis restarted", True, None))
    assert shell.of(EndRequest) == [EndRequest(close=True)]
    assert shell.seq.request is None and shell.seq.pending == 0


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.lists(st.integers(0, n - 1), max_size=3 * n).map(lambda seqs: (n, seqs))
    ),
    st.randoms(use_true_random=False),
)
def test_any_delivery_order_is_applied_in_order_exactly_once(case, rnd) -> None:
    """Live batches in any order, dropped or repeated, with replay answering
    from its buffer (the tail of an answer may be dropped on the way): every seq
    up to at least the newest received is applied once, in order, no gap given up."""
    n, seqs = case
    shell = Shell(replay_attempts=1_000)
    for seq in seqs:
        shell.live(seq)
        if rnd.random() < 0.3 and (ask := shell.ask()) is not None:
            shell.answer(range(ask.start, rnd.randint(ask.start + 1, n)))  # its tail dropped
    while (ask := shell.ask()) is not None:
        shell.answer(range(ask.start, n))
    applied = shell.applied
    assert applied == list(range(len(applied))) and len(applied) > max(seqs, default=-1)
    assert not shell.status.degraded and shell.status.gaps == shell.status.gaps_filled
