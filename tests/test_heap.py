"""kvindex.heap: the start-up heap leaves the collector's passes, full passes get rarer."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvindex.heap import FULL_PASS_EVERY, freeze_startup


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """The test process's collector as it was: frozen objects back, thresholds back."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_startup_objects_are_frozen_and_full_passes_spaced(restored_gc: None) -> None:
    survivor = [object() for _ in range(100)]  # a container the collector tracks
    assert gc.is_tracked(survivor)
    young, middle, _ = gc.get_threshold()
    freeze_startup()
    assert gc.get_freeze_count() > 0
    assert not any(o is survivor for o in gc.get_objects())  # no pass walks it any more
    assert gc.get_threshold() == (young, middle, FULL_PASS_EVERY)
