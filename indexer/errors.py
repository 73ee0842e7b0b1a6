"""The one failure every layer meets: the shared store cannot be reached.

It sits below the stores so that the code that outlives outages (periodic
chores, the API's 503, the consumers' retries) can name it without
importing a store.
"""

from __future__ import annotations


class StoreUnavailable(RuntimeError):
    """The store cannot be reached; callers retry, the API answers 503."""
