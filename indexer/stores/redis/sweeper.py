"""Deleting what no reader can see any more: cleared generations, forgotten ranks.

Clearing a medium, forgetting a rank or a new identity only changes the
metadata (readers stop looking at once); the fields they leave behind are
deleted here, later, by a store that writes (every ``sweep_interval`` seconds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from indexer.stores.base import StoreUnavailable
from indexer.stores.redis.client import RedisClient, cancel_task
from indexer.stores.redis.layout import parse_metas

log = logging.getLogger("kvindex.redis")


async def sweep(client: RedisClient, scan_count: int = 500) -> int:
    """Delete fields no reader can see any more; returns how many.

    Dead: fields of cleared generations and forgotten ranks, and ids that
    were allocated but never taken (a crash between the two). Ids being
    allocated right now are recorded beside the counter, in the same hash,
    so one atomic read of it tells them apart.
    """
    layout = client.layout
    (reply,) = await client.execute([("HGETALL", layout.meta_key)])
    top = int(reply.get(b"#ids", 0))
    live = {i for meta in parse_metas(reply).values() for i in meta.live_ids()}
    for name, held in reply.items():
        if name.startswith(b"a:"):
            first, last = map(int, held.split(b":"))
            live.update(range(first, last + 1))

    def dead(name: bytes, skip: int = 0) -> bool:
        """Whether a field named after an id (after ``skip`` bytes) is of a dead id;
        other fields (fences, anchors) are never garbage."""
        digits = name[skip:]
        return digits.isdigit() and int(digits) <= top and int(digits) not in live

    buckets = await client.execute([("HGETALL", key) for key in layout.bucket_keys])
    removed = await _drop(client, layout.bucket_keys, buckets, lambda n: dead(n, 1))
    batch: list[bytes] = []
    async for key in client.scan(layout.block_pattern, scan_count):
        batch.append(key)
        if len(batch) >= scan_count:
            removed += await _sweep_blocks(client, batch, dead)
            batch = []
    if batch:
        removed += await _sweep_blocks(client, batch, dead)
    return removed


async def _sweep_blocks(
    client: RedisClient, keys: list[bytes], dead: Callable[[bytes], bool]
) -> int:
    return await _drop(client, keys, await client.execute([("HKEYS", k) for k in keys]), dead)


async def _drop(
    client: RedisClient, keys: list, fields: list, dead: Callable[[bytes], bool]
) -> int:
    """Delete the dead ones of each key's fields; returns how many."""
    drops = [
        ("HDEL", key, *names)
        for key, names_of in zip(keys, fields, strict=True)
        if (names := [n for n in names_of if dead(n)])
    ]
    if drops:
        await client.execute(drops)
    return sum(len(d) - 2 for d in drops)


class Sweeper:
    """Sweeps every ``interval`` seconds, from the first :meth:`start` to :meth:`close`."""

    def __init__(self, client: RedisClient, interval: float | None) -> None:
        self._client = client
        self._interval = interval
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None and self._interval:
            self._task = asyncio.get_running_loop().create_task(self._forever(self._interval))

    async def _forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await sweep(self._client)
            except StoreUnavailable as e:
                log.warning("sweep skipped", extra={"error": str(e)})
            except Exception:
                log.exception("sweep failed")
            else:
                log.info("swept", extra={"fields": removed})

    async def close(self) -> None:
        await cancel_task(self._task)
