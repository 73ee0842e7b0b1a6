"""A store proxy that turns any backend failure into a 503, not a 500.

A Redis timeout, a dropped connection or a cluster redirect storm surfaces
as whatever exception the client library raises; the API must say "store
unreachable" for all of them without wrapping every call site.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from api.errors import StoreError
from indexer.stores.base import Store, StoreUnavailable


class GuardedStore:
    """Delegates to a :class:`Store`; failures raise :class:`StoreError`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._store, name)

        @functools.wraps(method)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return await method(*args, **kwargs)
            except StoreUnavailable:
                raise
            except Exception as e:
                raise StoreError(str(e) or type(e).__name__) from e

        setattr(self, name, guarded)  # built once per method
        return guarded
