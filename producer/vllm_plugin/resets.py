"""A connector reset empties the CPU tier without an event: kvindex's stream says so.

vLLM's offloading connector drops every chunk of its CPU tier when its scheduler
resets the connector's cache (``Scheduler.reset_connector_cache``: a prefix-cache
reset with ``reset_connector``, which ``sleep`` and ``checkpoint_prepare`` ask for in
0.34, ``sleep`` in 0.33 as well), and publishes nothing about it: a consumer keeps
every CPU block the engine dropped. The plugin marks the reset on the engine's
publisher; the next batch of kvindex's report-free stream
(:mod:`producer.vllm_plugin.reports`) leads with a ``BlockRemoved`` of every CPU
copy it published and did not remove since (the snapshot service's counts of the
lower tiers), so kvindex drops them as vLLM did. Only the connector's own tier
(CPU, no ownership) is emptied; vLLM's own stream is left as it was. Without
snapshots the plugin keeps no such counts, and the reset stays unannounced.

vLLM is imported here only inside functions: kvindex never depends on it.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from indexer.core.events import CPU

_RESET = "_kvindex_connector_reset"  # on a publisher: its engine's connector was reset


def install() -> None:
    """Mark connector resets on the publisher of the scheduler making them. Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.reset_connector_cache, "_kvindex", False):
        return
    Scheduler.reset_connector_cache = _marking(Scheduler.reset_connector_cache)


def _marking(reset: Any) -> Any:
    @functools.wraps(reset)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        done = reset(self, *args, **kwargs)
        publisher = getattr(self, "kv_event_publisher", None)
        if done is not False and self.connector is not None and publisher is not None:
            setattr(publisher, _RESET, True)
        return done

    wrapper._kvindex = True
    return wrapper


def with_implied_removals(publisher: Any, found: Any, batch: Any) -> Any:
    """``batch`` led by the removals a connector reset implies, if ``publisher``'s
    engine reset its connector since its last batch (else ``batch`` itself)."""
    if not getattr(publisher, _RESET, False):
        return batch
    setattr(publisher, _RESET, False)
    from vllm.distributed.kv_events import BlockRemoved

    removals = [
        BlockRemoved(block_hashes=hashes, medium=CPU, group_idx=group)
        for group, hashes in found.connector_copies()
    ]
    return msgspec.structs.replace(batch, events=[*removals, *batch.events])
