"""What the read path refuses, in its own words: the API decides the status."""

from __future__ import annotations


class QueryRefused(ValueError):
    """A query the read path cannot answer as asked. ``unknown``: it names an engine or
    a model nobody registered (a typo or a stale router config, not a malformed
    query); otherwise the message says what in the query cannot be followed."""

    def __init__(self, message: str, *, unknown: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.unknown = unknown
