"""The one protocol every store implements, and the values it speaks in.

The conformance suite (:mod:`indexer.stores.conformance`) runs the same
checks against every implementation (``await run(factory)``); a new backend is
done when it passes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from indexer.core.events import BlockHash, EventBatch, RankId
from indexer.core.matching import PrefixMatch
from indexer.errors import StoreUnavailable

__all__ = [
    "ApplyResult",
    "Fenced",
    "Loss",
    "Residency",
    "Store",
    "StoreLost",
    "StoreUnavailable",
    "Watermark",
]


class Fenced(RuntimeError):
    """A newer owner of the rank has claimed it: this writer must stop applying it.

    Raised by stores shared by several indexer processes (Redis) for writes
    made under a lease token older than the rank's newest; never retried.
    """


class StoreLost(RuntimeError):
    """The store no longer holds writes it acknowledged (a flush, a restart without
    persistence, a restart from an older snapshot, a failover to a lagging replica).

    Raised by a write that found it out; by then the store has taken note
    (:meth:`Store.last_loss` says what happened), so the writer resynchronises
    from the store's watermark and writes again. Never retried as such.
    """


@dataclass(frozen=True, slots=True)
class Loss:
    """A loss of data the store noticed: the ``number``-th since it was opened.

    ``wiped``: the store's contents were replaced (every rank starts again
    empty, watermark None); False: the store came back with older data (each
    rank's state is exact as of its, older, watermark).
    """

    number: int
    wiped: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Watermark:
    """The last batch applied for a rank, with its ``ts``.

    The ts tells a replayed duplicate (ts no newer) from a restarted engine's
    new seq 0.. stream (newer ts) when an indexer restarts after the engine.
    """

    seq: int
    ts: float


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: bool  # False: seq at or below the watermark, nothing changed
    block_ops: int = 0


@dataclass(frozen=True, slots=True)
class Residency:
    """One residency of a block: whose, where, and how many references."""

    engine: str
    dp_rank: int
    medium: str
    ownership: str | None
    group_idx: int
    locality: str | None
    count: int


class Store(Protocol):
    async def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> ApplyResult:
        """Apply a batch once: a seq at or below the rank's watermark is a no-op."""

    async def watermark(self, rank: RankId) -> Watermark | None:
        """The last applied batch of the rank; None for a rank never seen."""

    async def clear(self, rank: RankId, media: Collection[str], *, reset_seq: bool = False) -> None:
        """Drop a rank's counts on these media; ``reset_seq`` forgets its watermark
        too (the engine restarted and numbers batches from 0 again)."""

    async def forget(self, rank: RankId) -> None:
        """Drop everything about the rank (the engine was deregistered)."""

    async def block_residency(self, block_hash: BlockHash) -> list[Residency]:
        """Every residency of one block hash, across engines, media and groups."""

    async def prefix_match(
        self, chain: Sequence[BlockHash], chunk_blocks: Mapping[str, int | None]
    ) -> dict[RankId, PrefixMatch]:
        """Longest prefix of ``chain`` per rank and tier.

        ``chunk_blocks`` maps each engine to consider to its declared blocks per
        chunk (None: use what its events taught). Ranks of other engines are
        not looked at; every rank of a listed engine the store knows is answered.
        """

    async def block_counts(self, rank: RankId) -> dict[str, int]:
        """Distinct resident hashes per medium (all three media present)."""

    async def anomalies(self, rank: RankId) -> dict[str, int]:
        """Counted oddities of the rank's stream, e.g. ``unknown_removals``."""

    async def ranks(self) -> list[RankId]:
        """Every rank the store holds state for."""

    async def ping(self) -> None:
        """Raise :class:`StoreUnavailable` unless the store answers."""

    def last_loss(self) -> Loss | None:
        """The latest loss of data noticed (None: none since the store was opened).

        A consumer that applied batches before it resynchronises from the
        store's watermark before writing again.
        """

    def on_loss(self, listener: Callable[[Loss], None]) -> None:
        """Call ``listener(loss)`` whenever a loss is noticed (it must not block)."""

    async def close(self) -> None: ...
