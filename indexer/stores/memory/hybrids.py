"""Hybrid models' ranks in the embedded store: their answers taken to vLLM's hybrid rule.

The holder index answers every rank by its full-attention groups; a rank of a
hybrid model (a sliding-window or Mamba group seen) keeps that answer only
where its window group holds what the answer ends with, else it is walked on
its own tables by :func:`~indexer.core.hybrid.hybrid_match`. The compiled
holder index computes the rule itself for the common hybrid (one full-attention
and one window group, on its window masks) and asks :meth:`Hybrids.walk` for
the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from indexer.core.events import BlockHash
from indexer.core.hybrid import GroupRule, HeldUnits, hybrid_match
from indexer.core.matching import PrefixMatch
from indexer.core.residency import RankResidency


class Hybrids:
    """The ranks of hybrid models in a store, by how their answers are refined.

    A rank with one full-attention group and one window group (the common
    hybrid: gpt-oss, hybrid Mamba models) keeps its full-attention answer
    where its window group holds the units that answer ends with: checked on
    the index's window masks, for every rank sharing an answer and a window
    at once. The other ranks, and those failing the check, are walked one by
    one on their own tables (:func:`~indexer.core.hybrid.hybrid_match`).
    """

    def __init__(self) -> None:
        self.bits = 0  # every hybrid rank
        self.unanchored = 0  # those without a full-attention group
        self.states: dict[int, RankResidency] = {}  # bit -> rank
        self.simple: dict[GroupRule, int] = {}  # window group's rule -> bits of such ranks
        self._rules: dict[int, tuple[GroupRule, ...]] = {}  # bit -> rules registered
        #: changes with the ranks registered: the compiled index reads them again then
        self.generation = 0

    def update(self, state: RankResidency, bit: int) -> None:
        """Register a rank after a batch (its groups may have changed kind)."""
        rules = state.group_rules()
        if self._rules.get(bit) is rules or (not rules and not self.bits & bit):
            return
        self.drop(bit)
        self.generation += 1
        if rules:
            self.bits |= bit
            self.states[bit] = state
            self._rules[bit] = rules
            windows = [r for r in rules if r.window is not None]
            if len(windows) == len(rules):
                self.unanchored |= bit
            if len(rules) == 2 and len(windows) == 1:
                self.simple[windows[0]] = self.simple.get(windows[0], 0) | bit

    def drop(self, bit: int) -> None:
        if self.bits & bit:
            self.generation += 1
            self.bits &= ~bit
            self.unanchored &= ~bit
            del self.states[bit], self._rules[bit]
            self.simple = {r: m & ~bit for r, m in self.simple.items() if m & ~bit}

    def walk(
        self, bit: int, full: PrefixMatch, chain: Sequence[BlockHash], size: int
    ) -> PrefixMatch:
        """One rank's hybrid answer walked on its own tables, given its full-attention
        answer and chunk size (0: GPU only)."""
        state = self.states[bit]
        return hybrid_match(chain, full, size, self._rules[bit], state.group_tables, HeldSlices)


class HeldSlices(HeldUnits):
    """:class:`~indexer.core.hybrid.HeldUnits` read in C a slice at a time.

    A rank walked one by one (its window group lost what its full-attention
    answer ends with) costs a Python step per unit with the plain lookups:
    about three times as long for the bench's hybrid fleet (item 10, windows
    evicted early). Held to the same answers by the differential tests.
    """

    __slots__ = ()

    def flags(self, start: int, stop: int) -> bytes:
        """One byte per unit of ``[start, stop)``: 1 if held."""
        part, tables = self.keys[start:stop], self.tables
        if len(tables) == 1:
            return bytes(map(tables[0].__contains__, part))
        if not tables:
            return bytes(len(part))
        return bytes(map(any, zip(*(map(t.__contains__, part) for t in tables), strict=True)))

    def leading_end(self, start: int, cap: int) -> int:
        miss = self.flags(start, cap).find(0)
        return cap if miss < 0 else start + miss

    def window_end(self, need: int, start: int, cap: int) -> int:
        """The run usually ends at the cap: that is read first, ``need`` keys only."""
        if cap - need >= start and self.flags(cap - need, cap).count(1) == need:
            return cap
        flags = self.flags(start, cap)
        at = flags.rfind(b"\x01" * need)
        if at >= 0:
            return start + at + need
        miss = flags.find(0)
        return start + (len(flags) if miss < 0 else miss)
