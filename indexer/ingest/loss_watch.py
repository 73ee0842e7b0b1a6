"""A rank consumer's ear for the store's losses of data.

The store notices a loss (a wipe, a rollback) once, for the whole process;
every rank must then resynchronise, also one sleeping between two retries
of a failing store call, which would otherwise find out only at the end of
its backoff. The rank is degraded from the moment the store knows.
"""

from __future__ import annotations

import asyncio
import contextlib

from indexer.core.sequencer import Sequencer
from indexer.stores.base import Store, StoreLost


class LossWatch:
    """What one rank heard of the store's losses, for its ``sequencer``."""

    def __init__(self, store: Store, sequencer: Sequencer) -> None:
        self._store, self._seq = store, sequencer
        self._heard = asyncio.Event()  # the store noticed a loss: retry now
        if (loss := store.last_loss()) is not None:  # what it applies is read after it
            sequencer.losses_seen = loss.number

    def heard(self) -> None:
        self._heard.set()

    def in_doubt(self) -> str | None:
        """:meth:`Sequencer.loss_in_doubt` of the store's last loss."""
        loss = self._store.last_loss()
        return None if loss is None else self._seq.loss_in_doubt(loss.number, loss.reason)

    async def pause(self, seconds: float) -> None:
        """Wait between two attempts of a failing store call, or until the store notices
        a loss. A loss heard that the rank is yet to resynchronise after ends the
        retries (:class:`StoreLost`): the loop resynchronises at once, not after
        its backoff, and the batch in hand comes back by replay."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), seconds)
        heard = self._heard.is_set()
        self._heard.clear()  # so the resynchronisation's own retries back off
        if heard and (doubt := self.in_doubt()) is not None:
            raise StoreLost(doubt)
