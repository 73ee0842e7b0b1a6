"""A rank rebuilt after its store lost data is vouched for only once its rebuilt state is
in the store: by replay, by an engine restart arriving meanwhile, by a snapshot (fed
events directly, as in test_sequencer; ``turn`` is the consumer's next loop turn, when
every batch the sequencer answered has been applied)."""

from __future__ import annotations

from indexer.core.sequencer import Ask, Clear, Mark, RebuildSettled

from .test_sequencer import T0, Shell


def wiped_while_behind(shell: Shell, applied: int, received: int) -> None:
    """Batches 0..``applied`` applied, up to ``received`` read but still queued when the
    store comes back empty (the rank's store calls failed meanwhile)."""
    for seq in range(applied + 1):
        shell.live(seq)
    shell.run(shell.seq.resync(1, "redis restarted", True, None, received))
    assert shell.status.degraded


def test_a_rank_rebuilt_to_its_old_watermark_is_degraded_until_it_has_what_it_received() -> None:
    """Issue 34's window: re-applying up to the last batch applied before the loss left
    the rank answering from that older state, unflagged, while the batches received
    since were still to be applied."""
    shell = Shell()
    wiped_while_behind(shell, applied=4, received=9)
    shell.ask()
    shell.answer(range(5))
    shell.turn()
    assert shell.applied[-5:] == [0, 1, 2, 3, 4] and shell.status.degraded
    shell.live(5)  # the queued batches come in
    shell.turn()
    assert shell.status.degraded
    for seq in range(6, 10):
        shell.live(seq)
    assert shell.status.degraded  # until the loop's next turn: 9 may be in flight
    shell.turn()
    assert shell.of(RebuildSettled) == [RebuildSettled(9, exact=True)]
    assert not shell.status.degraded and shell.status.store_loss is None


def test_an_engine_restart_during_a_rebuild_is_degraded_until_its_new_batches_are_in() -> None:
    shell = Shell()
    wiped_while_behind(shell, applied=9, received=9)
    shell.live(3, ts=T0 + 1000)  # a new incarnation, at its seq 3 already
    assert Clear(("GPU", "CPU"), reset_seq=True) in shell.actions
    shell.turn()
    assert shell.status.degraded and shell.status.store_loss is not None
    shell.ask()
    shell.answer(range(4), ts_of=lambda seq: T0 + 997 + seq)
    assert shell.applied[-4:] == [0, 1, 2, 3]
    shell.turn()
    assert shell.of(RebuildSettled) == [RebuildSettled(3, exact=True)]
    assert not shell.status.degraded


def test_an_engine_restart_that_published_nothing_settles_the_rebuild_at_once() -> None:
    shell = Shell()
    for seq in range(10):
        shell.live(seq)
    shell.run(shell.seq.resync(1, "redis rolled back", False, Mark(4, T0 + 4)))
    assert shell.ask() == Ask(4, probe=False)
    shell.answer([])  # the buffer lacks seq 4: a new incarnation that published nothing
    assert shell.status.restarts == 1 and shell.status.degraded
    shell.turn()
    assert not shell.status.degraded and shell.status.store_loss is None


def test_a_snapshot_during_a_rebuild_is_degraded_until_the_batches_held_are_in() -> None:
    shell = Shell(has_snapshot=True)
    wiped_while_behind(shell, applied=39, received=39)
    shell.ask()
    shell.answer(range(30, 40))  # 0..29 are gone from the buffer too
    assert shell.seq.snapshot_due(shell.now)
    shell.seq.snapshot_sent()
    for seq in (40, 41, 42):
        shell.live(seq)
    shell.run(shell.seq.restored(40, T0 + 40))
    assert shell.applied[-2:] == [41, 42]
    assert shell.status.degraded and shell.status.store_loss is not None  # 42 may be in flight
    shell.turn()
    assert not shell.status.degraded and shell.status.store_loss is None


def test_a_second_loss_during_a_rebuild_keeps_its_target() -> None:
    """A rank claimed anew is rebuilding up to what its earlier consumer reached, and the
    store loses data again after replay brought back only part: what the rank must reach
    before it is exact stays that (what a consumer claiming it next inherits too), not
    the part re-applied so far."""
    shell = Shell()
    shell.run(shell.seq.rebuilding(9, "redis restarted"))
    shell.ask()
    shell.answer(range(4))
    shell.turn()
    assert shell.seq.reached() == 9 and shell.seq.rebuild_after_loss == (9, "redis restarted")
    shell.run(shell.seq.resync(2, "redis restarted again", True, None))
    assert shell.seq.rebuild_after_loss == (9, "redis restarted again")
    shell.ask()
    shell.answer(range(9))
    shell.turn()
    assert shell.status.degraded  # 8 of 9 re-applied
    shell.live(9)
    shell.turn()
    assert not shell.status.degraded and shell.seq.rebuild_after_loss is None
