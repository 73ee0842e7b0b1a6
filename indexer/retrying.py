"""Calling a store through its outages: one retry mechanism for every caller.

:func:`until_done` retries a call with tenacity until it succeeds; the rank
consumers (every batch goes through it) and :func:`repeat`'s chores (the
lease, registry and status loops) both use it, so an outage is handled,
logged and counted the same way everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_never
from tenacity.wait import wait_base, wait_fixed

from indexer.errors import StoreUnavailable

log = logging.getLogger("kvindex.periodic")

T = TypeVar("T")


async def until_done(
    call: Callable[..., Awaitable[T]],
    /,
    *args: Any,
    retry_if: Callable[[BaseException], bool],
    wait: wait_base,
    what: str,
    extra: Mapping[str, Any] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    stopping: Callable[[], bool] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    **kwargs: Any,
) -> T:
    """``await call(*args, **kwargs)`` until it succeeds, waiting ``wait`` between attempts.

    A failure for which ``retry_if`` is false is raised at once (a store's
    "fenced" or "lost data" answers are news for the caller, not outages).
    ``on_error`` sees every retried failure; the outage is logged once when
    it starts and once when it ends. Once ``stopping()`` is true a failure
    ends the retries with :class:`tenacity.RetryError`: a caller that must
    never drop what it writes gives up only when it shuts down. The first
    attempt runs outside tenacity, so a call that succeeds (nearly every
    call of the apply loop) costs no retry bookkeeping; the retries start
    with an immediate second attempt. ``sleep`` waits between attempts: a
    caller may end the wait early when news makes it pointless, or raise
    from it to end the retries.
    """
    try:
        return await call(*args, **kwargs)
    except Exception as e:
        if not retry_if(e):
            raise
        if on_error is not None:
            on_error(e)
        fields = dict(extra or {})
        log.warning(f"{what}: store failing, retrying", extra={**fields, "error": repr(e)[:200]})

    def failed(state: RetryCallState) -> None:
        if on_error is not None:
            on_error(state.outcome.exception())

    retrying = AsyncRetrying(
        retry=retry_if_exception(retry_if),
        wait=wait,
        stop=stop_never if stopping is None else (lambda _: stopping()),
        after=failed,
        sleep=sleep,
    )
    async for attempt in retrying:
        with attempt:
            result = await call(*args, **kwargs)
    log.info(f"{what}: store back", extra=fields)
    return result


async def repeat(interval: float, chore: Callable[[], Awaitable[None]], what: str) -> None:
    """Start ``chore()`` every ``interval`` seconds (or as soon as the last one ends), forever.

    Run it as a task. An unreachable store is logged once per outage and
    retried every ``interval``; any other error is a bug and ends the task.
    """
    unreachable = wait_fixed(interval)
    while True:
        started = time.monotonic()
        await until_done(
            chore,
            retry_if=lambda e: isinstance(e, StoreUnavailable),
            wait=unreachable,
            what=what,
        )
        await asyncio.sleep(max(0.0, started + interval - time.monotonic()))
