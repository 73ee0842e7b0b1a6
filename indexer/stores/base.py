"""The one protocol every store implements, and the values it speaks in.

A store is given planned, engine-neutral operations (what
:func:`indexer.core.residency.plan_batch` makes of a batch), never an
engine's wire batch: the caller plans once, and every store applies the same
operations by the same rules. Fencing is part of the protocol, so a writer
that shares a rank with others (indexer workers handing ranks over) writes to
any store the same way. The conformance suite (:mod:`indexer.stores.conformance`)
runs the same checks against every implementation (``await run(factory)``);
a new backend is done when it passes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from indexer.core.events import MEDIA, BlockHash, EventBatch, RankId
from indexer.core.large_blocks import LargeBlocks, large_block_match
from indexer.core.matching import NO_MATCH, PrefixMatch
from indexer.core.residency import Op, plan_batch
from indexer.core.snapshot import NOTHING_PUBLISHED, Snapshot, plan_snapshot
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
    "apply_events",
    "apply_snapshot",
]


class Fenced(RuntimeError):
    """A newer owner of the rank has claimed it: this writer must stop applying it.

    Raised by every store for a write made under a claim token (``fence=``)
    that is not the rank's newest, and by a store that lost data since the
    token was claimed from it (the tokens may have gone with the data); never
    retried.
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
    async def apply(
        self, rank: RankId, seq: int, ts: float, ops: Sequence[Op], *, fence: int | None = None
    ) -> ApplyResult:
        """Apply one batch's planned operations once: a seq at or below the rank's
        watermark is a no-op; the watermark becomes ``(seq, ts)``.

        ``fence``: the writer's claim token (:meth:`claim`); a write under one
        that is not the rank's newest raises :class:`Fenced` and changes
        nothing. None: an unfenced writer (the only one of its ranks).
        """

    async def watermark(self, rank: RankId) -> Watermark | None:
        """The last applied batch of the rank; None for a rank never seen."""

    async def clear(
        self,
        rank: RankId,
        media: Collection[str],
        *,
        reset_seq: bool = False,
        fence: int | None = None,
    ) -> None:
        """Drop a rank's counts on these media; ``reset_seq`` forgets its watermark
        too (the engine restarted and numbers batches from 0 again). ``fence`` as
        for :meth:`apply`."""

    async def forget(self, rank: RankId) -> None:
        """Drop everything about the rank (the engine was deregistered); its claim
        tokens keep rising."""

    async def claim(self, rank: RankId, owner: bytes) -> int | None:
        """Become the rank's only fenced writer: a token above every earlier claim's.

        The newest claim wins: writes under any older token raise
        :class:`Fenced` from here on. ``owner``: the rank's engine as the
        claimant has it registered; a store that keeps the engine registry
        beside the index (Redis) refuses, with None, a claim whose engine is
        no longer registered so, and a store without one never refuses.
        """

    async def block_residency(self, block_hash: BlockHash) -> list[Residency]:
        """Every residency of one block hash, across engines, media and groups."""

    async def prefix_match(
        self, chain: Sequence[BlockHash], chunk_blocks: Mapping[str, int | None]
    ) -> dict[RankId, PrefixMatch]:
        """Longest prefix of ``chain`` per rank and tier.

        ``chunk_blocks`` maps each engine to consider to its declared blocks per
        chunk (None: use what its events taught). Ranks of other engines are
        not looked at. Only ranks that match something are answered: a rank
        of a listed engine that is left out matches nothing (``PrefixMatch()``),
        so a query costs what the ranks holding the chain cost, not the fleet
        (callers that list every rank fill in the zeros).
        """

    async def chain_residency(
        self, chain: Sequence[BlockHash], engines: Collection[str]
    ) -> dict[RankId, dict[tuple[str, int], set[BlockHash]]]:
        """The hashes of ``chain`` each rank of ``engines`` holds, by (medium, group_idx),
        every ownership together: what rules no prefix match states are walked on
        (:mod:`indexer.core.large_blocks`). Ranks holding none are left out."""

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


def apply_events(
    store: Store,
    rank: RankId,
    seq: int,
    batch: EventBatch,
    fence: int | None = None,
    *,
    hold_gpu: bool = False,
) -> Awaitable[ApplyResult]:
    """Plan a decoded batch and apply it: for callers holding events (consumers,
    trace replay, tests, benchmarks) rather than operations. Plans now and returns
    the store's own call to await, so a batch pays no extra coroutine.
    ``hold_gpu``: as for :func:`~indexer.core.residency.plan_batch`."""
    ops = plan_batch(batch, hold_gpu=hold_gpu)
    return store.apply(rank, seq, batch.ts, ops, fence=fence)


async def match_chain(
    store: Store,
    chain: Sequence[BlockHash],
    chunk_blocks: Mapping[str, int | None],
    shapes: Mapping[str, LargeBlocks],
) -> dict[RankId, PrefixMatch]:
    """Each rank's match of ``chain``: the engines of ``chunk_blocks`` by the store's
    prefix match, those of ``shapes`` (blocks larger than the hash block) by the rule of
    :mod:`indexer.core.large_blocks` on what their ranks hold of it."""
    if not shapes:
        return await store.prefix_match(chain, chunk_blocks)
    found = await store.prefix_match(chain, chunk_blocks) if chunk_blocks else {}
    for rank, held in (await store.chain_residency(chain, shapes.keys())).items():
        match = large_block_match(chain, held, shapes[rank.engine])
        if match != NO_MATCH:
            found[rank] = match
    return found


async def apply_snapshot(
    store: Store, rank: RankId, snapshot: Snapshot, fence: int | None = None
) -> ApplyResult:
    """Make the rank's counts the snapshot's, its watermark the snapshot's seq.

    Two protocol calls, so every store restores the same way: every medium
    cleared with the watermark, then the snapshot applied as batch ``seq``. A
    writer stopped between them leaves an empty rank without a watermark,
    which its next consumer restores again; readers see the rank degraded
    meanwhile (its consumer says so until the snapshot is applied).
    """
    await store.clear(rank, MEDIA, reset_seq=True, fence=fence)
    if snapshot.seq == NOTHING_PUBLISHED:
        return ApplyResult(applied=True)
    return await store.apply(rank, snapshot.seq, snapshot.ts, plan_snapshot(snapshot), fence=fence)
