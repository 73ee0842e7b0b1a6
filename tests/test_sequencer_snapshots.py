"""The snapshot rules of the sequencer: asked when replay cannot fill a range, batches
held while it is awaited, exact once it is applied (fed events directly, as in
test_sequencer)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.sequencer import GaveUp, Mark, Restored
from indexer.engine_registry import Gap

from .test_sequencer import T0, Shell


def late_start(shell: Shell, buffer_from: int, last: int) -> None:
    """kvindex starts while the engine's buffer holds ``buffer_from..last`` only."""
    shell.live(last)
    shell.ask()
    shell.answer(range(buffer_from, last + 1))


def test_a_start_past_the_replay_buffer_asks_for_a_snapshot_and_is_exact_after_it() -> None:
    shell = Shell(has_snapshot=True)
    late_start(shell, 30, 39)
    assert shell.of(GaveUp) == [GaveUp(0, 29, "not in the replay buffer", False, True)]
    assert shell.status.degraded and shell.seq.snapshot_due(shell.now)
    shell.seq.snapshot_sent()
    for seq in (40, 41, 42):  # the engine steps on while the snapshot is taken
        shell.live(seq)
    assert shell.applied == list(range(30, 40))  # held from the request on
    shell.run(shell.seq.restored(41, T0 + 41))  # taken after 41 was published
    assert shell.of(Restored) == [Restored(41, 2)]  # 40 and 41 are in it
    assert shell.applied[-1:] == [42] and shell.seq.mark == Mark(42, T0 + 42)
    assert shell.status.degraded  # until 42 is in the store: the loop's next turn
    shell.turn()
    assert not shell.status.degraded and shell.status.missing == []
    assert shell.status.restores == 1 and not shell.seq.snapshot_due(shell.now + 100)


def test_batches_missing_between_the_snapshot_and_the_held_ones_are_replayed() -> None:
    shell = Shell(has_snapshot=True)
    late_start(shell, 30, 39)
    shell.seq.snapshot_sent()
    shell.live(45)  # 41..44 were dropped on the way
    shell.run(shell.seq.restored(40, T0 + 40))
    assert shell.applied[-1] == 39 and shell.seq.next == 41
    assert shell.ask() is not None  # from the snapshot's seq: the hole is asked
    shell.answer(range(40, 46))
    shell.turn()
    assert shell.applied[-5:] == [41, 42, 43, 44, 45] and not shell.status.degraded


def test_a_failed_snapshot_releases_what_was_held_and_is_asked_again_later() -> None:
    shell = Shell(has_snapshot=True, snapshot_retry=10.0)
    late_start(shell, 30, 39)
    shell.seq.snapshot_sent()
    shell.live(40)
    shell.live(41)
    shell.run(shell.seq.snapshot_failed(shell.now, "timed out"))
    assert shell.applied[-2:] == [40, 41] and shell.status.degraded
    assert shell.status.snapshot_error == "timed out"
    assert not shell.seq.snapshot_due(shell.now + 9.9)
    assert shell.seq.snapshot_due(shell.now + 10.0)
    assert shell.seq.idle_timeout(shell.now + 4.0, True, 0.05) <= 6.0


def test_held_batches_past_the_bound_drop_the_oldest_and_replay_brings_them() -> None:
    shell = Shell(has_snapshot=True, max_pending=3)
    late_start(shell, 30, 39)
    shell.seq.snapshot_sent()
    for seq in range(40, 46):
        shell.live(seq)
    assert shell.seq.pending == 3  # 43..45 kept
    shell.run(shell.seq.restored(39, T0 + 39))
    shell.ask()
    shell.answer(range(39, 46))
    shell.turn()
    assert shell.applied[-6:] == [40, 41, 42, 43, 44, 45] and not shell.status.degraded


def test_an_engine_restart_while_the_snapshot_is_awaited_abandons_it() -> None:
    shell = Shell(has_snapshot=True)
    late_start(shell, 30, 39)
    shell.seq.snapshot_sent()
    shell.live(0, ts=T0 + 1000)  # a new incarnation: its stream is whole
    assert not shell.seq.restoring and shell.applied[-1:] == [0]
    assert not shell.seq.snapshot_due(shell.now)  # an answer now is ignored


def test_without_a_snapshot_endpoint_a_given_up_range_stays_degraded() -> None:
    shell = Shell()
    late_start(shell, 30, 39)
    assert shell.status.degraded and not shell.seq.snapshot_due(shell.now + 1e6)
    assert shell.status.missing == [Gap(0, 29, 0.0)]


def test_a_snapshot_of_an_engine_that_published_nothing_starts_it_at_seq_0() -> None:
    shell = Shell(has_snapshot=True)
    shell.run(shell.seq.snapshot_failed(0.0, "timed out"))  # nothing asked: nothing to fail
    shell.seq.snapshot_sent()
    shell.live(0)
    shell.run(shell.seq.restored(-1, 0.0))
    assert shell.applied == [0] and shell.status.applied_seq == 0


@settings(max_examples=60, deadline=None)
@given(
    taken=st.integers(30, 60),
    arrived=st.lists(st.integers(40, 70), max_size=30),
)
def test_after_a_snapshot_every_seq_past_it_is_applied_once_in_order(
    taken: int, arrived: list[int]
) -> None:
    """Whatever arrived while it was awaited, and whatever the snapshot's seq: the
    batches after it are applied once each, in order, once replay has answered."""
    shell = Shell(has_snapshot=True)
    late_start(shell, 30, 39)
    shell.seq.snapshot_sent()
    for seq in arrived:
        shell.live(seq)
    before = len(shell.applied)
    shell.run(shell.seq.restored(taken, T0 + taken))
    last = max([taken, 39, *arrived])
    if shell.ask() is not None:
        shell.answer(range(30, last + 1))
    after = shell.applied[before:]
    assert after == list(range(taken + 1, last + 1))
    shell.turn()
    assert not shell.status.degraded
