"""The store conformance suite: every residency and fencing rule, checked on any :class:`Store`.

A new backend (or a decorator around one) is done when ``await run(factory)``
passes: each check gets a fresh, empty store from ``factory`` and raises
:class:`AssertionError` naming the check and what differed. The checks are
plain async functions of a store (:data:`CHECKS`), so a test suite can run
them one test id each with :func:`run_check`. They build their events here,
engine-neutral: no payloads, no fixtures, no server.

``factory`` is a callable giving a store, an awaitable of one, or an async
context manager yielding one; a store the suite made itself it also closes.
Claims present :data:`OWNER` for :data:`RANK`'s engine: a store that grants
claims only to registered engines needs it registered so (the factory's job).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from inspect import isawaitable
from typing import Any

from indexer.stores.base import Store
from indexer.stores.conformance import fencing, rules, snapshots
from indexer.stores.conformance.kit import (
    CHECKS,
    ENGINE,
    OWNER,
    RANK,
    apply,
    batch,
    counts,
    expect,
    removed,
    stored,
    where,
)

__all__ = [
    "CHECKS",
    "ENGINE",
    "OWNER",
    "RANK",
    "StoreFactory",
    "apply",
    "batch",
    "counts",
    "expect",
    "fencing",
    "removed",
    "rules",
    "run",
    "run_check",
    "snapshots",
    "stored",
    "where",
]

StoreFactory = Callable[[], Store | Awaitable[Store] | AbstractAsyncContextManager[Store]]


async def run(factory: StoreFactory) -> None:
    """Run every check, each on a fresh store; the first failure raises."""
    for name in CHECKS:
        await run_check(factory, name)


async def run_check(factory: StoreFactory, name: str) -> None:
    """Run one check on a fresh store; an AssertionError names the check."""
    async with _fresh(factory) as store:
        try:
            await CHECKS[name](store)
        except AssertionError as failed:
            raise AssertionError(f"conformance check {name!r} failed: {failed}") from failed


@asynccontextmanager
async def _fresh(factory: StoreFactory) -> AsyncIterator[Store]:
    made: Any = factory()
    if hasattr(made, "__aenter__"):
        async with made as store:
            yield store
        return
    store = await made if isawaitable(made) else made
    try:
        yield store
    finally:
        await store.close()
