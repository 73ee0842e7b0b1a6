"""A long-running process's start-up heap, kept out of the collector's way.

Start-up (imports, the app, the config) leaves a few hundred thousand
long-lived objects that every full collection walks again: about 18 ms with
the event loop held, and an ingest burst allocates enough to trigger a few
full passes, each one a stall in a router's query. Freezing moves those
objects to a generation no collection visits; a higher gen-2 threshold makes
the full passes that remain rarer (the index's own entries are not Python
objects, so what they would reclaim is mostly short-lived batches, which the
young generations already take).
"""

from __future__ import annotations

import gc

FULL_PASS_EVERY = 100
"""Gen-1 collections per full pass (CPython's default: 10)."""


def freeze_startup() -> None:
    """Call once start-up is done, before serving: collect what start-up left
    as garbage, freeze the rest, and space out full passes."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_PASS_EVERY)
