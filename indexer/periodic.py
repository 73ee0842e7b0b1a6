"""Run a Redis-backed chore every few seconds, through Redis outages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from indexer.errors import StoreUnavailable

log = logging.getLogger("kvindex.periodic")


async def repeat(interval: float, chore: Callable[[], Awaitable[None]], what: str) -> None:
    """Start ``chore()`` every ``interval`` seconds (or as soon as the last one ends), forever.

    Run it as a task. An unreachable store is logged once per outage and
    retried at the next turn; any other error is a bug and ends the task.
    """
    failing = False
    while True:
        started = time.monotonic()
        try:
            await chore()
        except StoreUnavailable as e:
            if not failing:
                log.warning(f"{what}: store unreachable", extra={"error": str(e)})
            failing = True
        else:
            if failing:
                log.info(f"{what}: store back")
            failing = False
        await asyncio.sleep(max(0.0, started + interval - time.monotonic()))
