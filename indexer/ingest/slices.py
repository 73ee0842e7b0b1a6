"""Ingest's share of the event loop it shares with the HTTP API.

Applying a batch never waits on I/O (the embedded store answers at once),
so a consumer applying a burst would keep the loop until it yields, and a
router's query, which needs a few loop turns (read, handle, write), waits a
whole slice at each turn. Every consumer of a process draws on one budget
per loop turn: whichever finds it spent yields, the first to resume opens
the next turn's budget, and the others go on under it. A turn therefore
costs queries the budget plus at most one batch per other busy rank,
however many ranks are bursting at once.

A consumer resumes after everything else the loop has to do, not before
it: it yields to a timer due at once, which the loop runs after the turn's
socket callbacks, and the wake-up that timer schedules runs behind the
tasks those callbacks started. A query read in a turn is thus handled
before ingest's next slice, not after it; each slice costs one extra,
empty, loop turn.
"""

from __future__ import annotations

import asyncio
import time


class Slices:
    """A per-loop-turn time budget for applying batches, shared by every consumer."""

    def __init__(self, budget: float) -> None:
        self._budget = budget
        self._ends = 0.0

    async def pause_if_spent(self) -> None:
        """Yield to the loop if this turn's budget is spent (call after each batch)."""
        if time.perf_counter() < self._ends:
            return
        await _behind_the_turn()
        now = time.perf_counter()
        if now >= self._ends:  # the first consumer back opens the next turn
            self._ends = now + self._budget


def _behind_the_turn() -> asyncio.Future[None]:
    """A future the loop completes after the next turn's socket callbacks (a timer due
    now runs after them), so the task awaiting it resumes behind what they started."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_later(0, _finish, done)
    return done


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():  # the waiting consumer may have been cancelled meanwhile
        done.set_result(None)
