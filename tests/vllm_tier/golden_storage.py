"""A storage tier below the CPU tier, for the golden traces (:mod:`.golden_traces`):
vLLM's ``TieringOffloadingSpec`` with its file-system tier (``FileSystemTierManager``,
medium STORAGE) in a folder. Each chunk the CPU tier completes is cascaded to the
folder by the tier's own I/O threads; the folder keeps it when the CPU tier evicts it.
With self-describing events, vLLM builds each store (CPU and STORAGE) from the
request context: every per-block hash of the chunk, where 0.33 sent its end hash.

The probes ask the connector's own lookup with the tiers answering as they stand: a
chunk the storage tier holds counts as found (vLLM promotes it to the CPU and loads it
a step later); nothing is promoted, so probing leaves both tiers as they are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def add_storage_tier(config: Any, folder: Path) -> None:
    """Give the connector of ``config`` (vLLM's, with a CPU tier) a file-system tier in
    ``folder`` below its CPU tier, publishing its stores; its lookups and transfers are
    serviced in the engine's steps (no poll thread)."""
    extra = config.kv_transfer_config.kv_connector_extra_config
    extra["spec_name"] = "TieringOffloadingSpec"
    extra["tier_poll_interval_s"] = 0
    extra["secondary_tiers"] = [
        {"type": "fs", "root_dir": str(folder), "enable_kv_events": True,
         "n_read_threads": 1, "n_write_threads": 1}
    ]  # fmt: skip


def storage_tier(scheduler: Any) -> Any:
    """The engine's file-system tier (vLLM's ``FileSystemTierManager``)."""
    (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
    return tier


def settle_io(scheduler: Any, timeout: float = 30.0) -> None:
    """Wait, between two steps, for the storage tier's threads to finish what the steps
    so far gave them (its stores and promotions, and the lookups a step posted), as a
    disk that keeps up would: so the next step sees them all, run after run."""
    from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase

    tier = storage_tier(scheduler)
    tier.drain_jobs()
    lookups = tier._lookup_manager
    deadline = time.monotonic() + timeout
    while True:
        lookups.drain_results()
        states = lookups._lookup_state.values()
        if not any(s.phase is LookupPhase.IN_FLIGHT for s in states):
            return
        assert time.monotonic() < deadline, "the storage tier's lookups did not resolve"
        time.sleep(0.002)


def settle(stand_in: Any, scheduler: Any) -> None:
    """Step the idle engine until every store has reached the storage tier and vLLM has
    published it: the worker reports its last stores, the tier's threads write them, and
    the next step collects the finished jobs."""
    manager = scheduler.connector.connector_scheduler.manager
    while True:
        settle_io(scheduler)
        stand_in.step()
        if not manager.has_pending_work():
            return


def _on_storage(tier: Any, key: bytes, req_context: Any, timeout: float = 30.0) -> bool:
    """The storage tier's own lookup of ``key``, waited for (its lookups run on a thread
    and resolve in a later step)."""
    from vllm.v1.kv_offload.base import LookupResult

    deadline = time.monotonic() + timeout
    while (result := tier.lookup(key, req_context)) is LookupResult.RETRY:
        assert time.monotonic() < deadline, "the storage tier's lookup did not resolve"
        tier.on_schedule_end(None)  # posts the lookups; drains those resolved
        time.sleep(0.005)
    return result is LookupResult.HIT


def storage_refcounts(scheduler: Any, prompts: list[list[Any]]) -> dict[str, int]:
    """Each hash of the chunks the storage tier holds (a file each, by vLLM's own file
    naming), over every complete chunk of ``prompts`` (their block hashes)."""
    import os

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import make_offload_key

    from tests.vllm_tier.snapshot_engine import CHUNK_BLOCKS

    files = storage_tier(scheduler).file_mapper
    held: dict[bytes, list[Any]] = {}
    for hashes in prompts:
        for end in range(CHUNK_BLOCKS, len(hashes) + 1, CHUNK_BLOCKS):
            key = make_offload_key(hashes[end - 1], 0)
            if os.path.exists(files.get_file_name(key)):
                held[key] = hashes[end - CHUNK_BLOCKS : end]
    return {str(maybe_convert_block_hash(h)): 1 for chunk in held.values() for h in chunk}


def shut_down(scheduler: Any) -> None:
    """Stop the tiers' threads and free the CPU tier's shared memory region."""
    scheduler.connector.connector_scheduler.manager.shutdown()


@contextmanager
def answering(scheduler: Any, cpu: bool = True, storage: bool = True) -> Iterator[None]:
    """vLLM's tiered manager answering the connector's lookups from the chosen tiers
    only, as they stand (a chunk on the storage tier counts as found, unpromoted)."""
    from vllm.v1.kv_offload.base import LookupResult

    manager = scheduler.connector.connector_scheduler.manager
    tier = storage_tier(scheduler)

    def lookup(key: bytes, req_context: Any, **_: Any) -> Any:
        found = cpu and manager.primary_tier.lookup(key, req_context) is LookupResult.HIT
        if found or (storage and _on_storage(tier, key, req_context)):
            return LookupResult.HIT
        return LookupResult.MISS

    manager.lookup = lookup
    try:
        yield
    finally:
        del manager.lookup
