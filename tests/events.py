"""Builders for hand-written KV events in tests: only what a test cares about.

They are the conformance suite's own, so that tests and suite speak alike.
"""

from __future__ import annotations

from indexer.stores.conformance import removed, stored

__all__ = ["removed", "stored"]
