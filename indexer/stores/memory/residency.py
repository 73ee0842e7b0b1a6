"""A rank's exact residency in the embedded store, keeping its bit in the holder index.

The counts are :class:`~indexer.core.residency.RankResidency`'s, changed by
its own rules, kept in the compiled tables (``hash -> refcount`` in 12-byte
slots: no Python int per hash held); this flavour only watches, through the
methods the reference leaves to be overridden, which hashes enter or leave a
medium's union of scored (or window) tables, and sets or clears the rank's bit
for them in the compiled holder index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from indexer.core.events import MEDIA, BlockHash
from indexer.core.hybrid import is_scored, is_windowed
from indexer.core.residency import (
    RankResidency,
    Tier,
    TierOp,
    TierTable,
)
from indexer.stores.memory.compiled import core

#: per medium, ``hash -> the rank slots holding it`` (the compiled index's tables)
Media = dict[str, Any]


@dataclass
class IndexedResidency(RankResidency):
    """A rank's exact residency that keeps its bit in the compiled ``HolderIndex`` in step.

    A group's hashes go to the index's scored media, to its window media (a
    hybrid model's sliding-window or Mamba group), or nowhere (a kind with no
    rule), by the group's kind.
    """

    index: Any = None  # the compiled HolderIndex
    bit: int = 0
    #: tier -> its index and the other tables of its medium going there, or None;
    #: valid while the rank's tables and group kinds stay as they were.
    _peers: dict[Tier, tuple[Media, list] | None] = field(
        default_factory=dict, repr=False, compare=False
    )
    _peers_of: int = -1  # len(tables) when _peers was filled

    def add(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> None:
        fresh = self.added(counts, hashes)
        if fresh:
            found = self._index_peers(tier)
            if found is not None:
                self.index.add(tier.medium, self.bit, _alone(fresh, found[1]), found[0])

    def drop(self, tier: Tier, counts: dict[BlockHash, int], hashes: Sequence[BlockHash]) -> int:
        unknown, gone = self.dropped(counts, hashes)
        if gone:
            found = self._index_peers(tier)
            if found is not None:
                self.index.discard(tier.medium, self.bit, _alone(gone, found[1]), found[0])
        return unknown

    def new_table(self) -> TierTable:
        return TierTable(core.CountTable())

    def added(self, counts, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """One more reference per hash, counted in C; the hashes given their first."""
        return counts.add(hashes)

    def dropped(self, counts, hashes: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        """One reference fewer per hash: the removals of hashes not held, the hashes gone."""
        return counts.drop(hashes)

    def learn_kind(self, op: TierOp) -> None:
        group = op.tier.group_idx
        was = self._media_of(group)
        super().learn_kind(op)
        now = self._media_of(group)
        if now is not was:
            self._rescore(group, was, now)

    def clear(self, media: Iterable[str]) -> None:
        media = list(media)
        for medium in media:
            for index in (self.index.media, self.index.windows):
                self.index.discard(medium, self.bit, self._union(medium, index), index)
        super().clear(media)
        self._peers_of = -1

    def release(self) -> None:
        """Leave the index: the rank is forgotten."""
        self.clear(MEDIA)
        self.index.release_bit(self.bit)

    def _media_of(self, group: int) -> Media | None:
        """Where a group's hashes are indexed, by its kind."""
        kind = self.group_kinds.get(group)
        if is_scored(kind):
            return self.index.media
        return self.index.windows if is_windowed(kind) else None

    def _index_peers(self, tier: Tier) -> tuple[Media, list] | None:
        """None if the tier is indexed nowhere, else its index and the other tables
        of its medium indexed there."""
        if self._peers_of != len(self.tables):
            self._peers.clear()
            self._peers_of = len(self.tables)
        if tier not in self._peers:
            index = self._media_of(tier.group_idx)
            self._peers[tier] = (
                None
                if index is None
                else (
                    index,
                    [
                        t.counts
                        for other, t in self.tables.items()
                        if other != tier
                        and other.medium == tier.medium
                        and self._media_of(other.group_idx) is index
                    ],
                )
            )
        return self._peers[tier]

    def _union(self, medium: str, index: Media) -> Iterable[BlockHash]:
        tables = [
            t.counts
            for tier, t in self.tables.items()
            if tier.medium == medium and self._media_of(tier.group_idx) is index
        ]
        if not tables:
            return ()
        return tables[0].keys() if len(tables) == 1 else set().union(*tables)

    def _rescore(self, group: int, was: Media | None, now: Media | None) -> None:
        """A group's kind moved it to another index (or none): move its tables' hashes."""
        self._peers_of = -1
        media = {tier.medium for tier in self.tables if tier.group_idx == group}
        for medium in media:
            moved = set().union(
                *(
                    t.counts
                    for tier, t in self.tables.items()
                    if tier.medium == medium and tier.group_idx == group
                )
            )
            if was is not None:  # out, unless another table indexed there still holds them
                self.index.discard(
                    medium, self.bit, moved.difference(self._union(medium, was)), was
                )
            if now is not None:
                self.index.add(medium, self.bit, moved, now)


def _alone(hashes: list[BlockHash], peers: list[dict[BlockHash, int]]) -> list[BlockHash]:
    """The hashes none of ``peers`` holds: those that enter or leave the medium's union."""
    if not peers:
        return hashes
    return [h for h in hashes if not any(h in t for t in peers)]
