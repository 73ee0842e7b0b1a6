"""``kvindex replay`` runs the embedded store's coroutines without an event loop."""

from __future__ import annotations

import asyncio

import pytest

from kvindex.replay import _run


async def _answer() -> int:
    return 42


async def _waits() -> int:
    await asyncio.sleep(0)  # a store that yields to the loop once
    return 42


def test_a_coroutine_that_never_waits_runs_without_a_loop() -> None:
    assert _run(_answer(), waits=False) == 42


def test_a_store_that_waits_fails_loudly_without_a_loop_and_runs_with_one() -> None:
    with pytest.raises(RuntimeError, match="waited"):
        _run(_waits(), waits=False)
    assert _run(_waits(), waits=True) == 42
