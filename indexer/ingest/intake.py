"""The queue between a rank's socket readers and its sequencer."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

# Intake items: (kind, replay generation, seq, payload, batch ts).
# HELD: a replayed seq already held or applied, not even looked at.
# BAD: a replayed frame that was no batch (it still counts as answered).
LIVE, REPLAY, HELD, END, WAKE, BAD = range(6)
Item = tuple[int, int, int, bytes, float]


class Intake:
    """Received items for the sequencer, bounded in count and in payload bytes.

    A reader waits while either bound is reached, so its socket stops being
    read (ZeroMQ's receive high-water mark, derived from ``queue_bytes``,
    then bounds in bytes what queues behind it). One item always fits in an
    empty intake: ``max_message_bytes`` bounds it.
    Wake-ups are put without waiting: they carry no payload.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._items: deque[Item] = deque()
        self._bytes = 0
        self._max_items, self._max_bytes = max_items, max_bytes
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def full(self) -> bool:
        return len(self._items) >= self._max_items or self._bytes >= self._max_bytes

    def empty(self) -> bool:
        return not self._items

    async def put(self, item: Item) -> None:
        while self.full():
            self._room.clear()
            await self._room.wait()
        self.put_nowait(item)

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        self._bytes += len(item[3])
        self._ready.set()

    def get_nowait(self) -> Item | None:
        if not self._items:
            return None
        item = self._items.popleft()
        self._bytes -= len(item[3])
        if not self.full():
            self._room.set()
        return item

    async def get(self, timeout: float | None) -> Item | None:
        """The next item, or None after ``timeout`` seconds (None: no timeout)."""
        item = self.get_nowait()
        if item is not None or timeout == 0:
            return item
        self._ready.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self.get_nowait()

    def clear(self) -> None:
        """Drop everything queued (the consumer stopped: free the payloads now)."""
        self._items.clear()
        self._bytes = 0
        self._room.set()
