"""What the conformance checks are made of: the registry, events built here, reads.

Engine-neutral on purpose: events are built from :mod:`indexer.core.events`,
written through :func:`~indexer.stores.base.apply_events`, and read back
through the protocol only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from indexer.core.events import (
    CPU,
    GPU,
    STORAGE,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    RankId,
)
from indexer.core.matching import PrefixMatch
from indexer.stores.base import Fenced, Store, apply_events

RANK = RankId("engine-a", 0)
ENGINE = {"engine-a": None}
#: What the checks' claims present as the engine's registration.
OWNER = b"conformance"

Check = Callable[[Store], Awaitable[None]]

#: name -> check, in the order they are written (and run)
CHECKS: dict[str, Check] = {}


def check(fn: Check) -> Check:
    """Register a check under its function's name."""
    CHECKS[fn.__name__] = fn
    return fn


def expect(got: object, want: object, what: str) -> None:
    """Fail with both values (checks run outside pytest's assertion rewriting)."""
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def stored(
    hashes: Iterable[BlockHash],
    medium: str = GPU,
    group: int = 0,
    kind: str | None = "full_attention",
    owner: str | None = None,
    locality: str | None = None,
    block_size: int = 16,
    window: int | None = None,
) -> BlockStored:
    """A store of ``hashes``; ``block_size=0`` makes it a chunk-end placeholder.

    ``window``: a sliding-window group's window in tokens.
    """
    hashes = list(hashes)
    return BlockStored(
        hashes,
        None,
        [0] * block_size * len(hashes),
        block_size,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        ownership=owner,
        locality=locality,
    )


def removed(
    hashes: Iterable[BlockHash], medium: str = GPU, group: int = 0, owner: str | None = None
) -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group, ownership=owner)


def batch(*events: object, ts: float = 1.0) -> EventBatch:
    return EventBatch(ts, list(events), 0)


async def apply(
    store: Store,
    seq: int,
    *events: object,
    rank: RankId = RANK,
    ts: float = 1.0,
    fence: int | None = None,
    hold_gpu: bool = False,
) -> bool:
    written = apply_events(store, rank, seq, batch(*events, ts=ts), fence, hold_gpu=hold_gpu)
    return (await written).applied


async def refused(write: Awaitable[object], what: str) -> None:
    """Fail unless the write raises :class:`Fenced`."""
    try:
        await write
    except Fenced:
        return
    raise AssertionError(f"{what}: not refused with Fenced")


async def claim(store: Store, rank: RankId = RANK) -> int:
    token = await store.claim(rank, OWNER)
    if not isinstance(token, int) or token <= 0:
        raise AssertionError(f"claim of {rank}: got {token!r}, want a positive token")
    return token


async def where(store: Store, h: BlockHash) -> set[tuple]:
    """A block's residencies as comparable tuples."""
    return {
        (r.engine, r.dp_rank, r.medium, r.ownership, r.group_idx, r.locality, r.count)
        for r in await store.block_residency(h)
    }


async def counts(store: Store, h: BlockHash, rank: RankId = RANK) -> dict[str, int]:
    """Reference count of one hash per medium for one rank (all groups and owners)."""
    found: dict[str, int] = {}
    for r in await store.block_residency(h):
        if (r.engine, r.dp_rank) == rank:
            found[r.medium] = found.get(r.medium, 0) + r.count
    return found


async def hit(store: Store, chain: list, chunk: int | None = None) -> PrefixMatch:
    return (await store.prefix_match(chain, {RANK.engine: chunk})).get(RANK, PrefixMatch())


def blocks(gpu: int = 0, cpu: int = 0, storage: int = 0) -> dict[str, int]:
    return {GPU: gpu, CPU: cpu, STORAGE: storage}
