"""Walks of a chain over the holder index's masks: every rank's runs in one pass.

Each hash maps to the bitmask of the rank slots holding it. A walk reads the
masks in C a slice at a time and reports where each rank's bit drops out
(:func:`segments`); lower-tier runs then combine with the GPU run by classes
of ranks sharing every run length (:func:`run_classes`, :func:`extended`), and
:class:`Digits` hands each rank its class's answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import compress, count
from operator import ne

from indexer.core.events import BlockHash, RankId
from indexer.core.matching import NO_MATCH as EMPTY
from indexer.core.matching import PrefixMatch

#: Keys looked up per C pass of a walk: more passes cost Python, longer ones overshoot.
#: A walk starts with a short pass (many end at once), or as far as it guesses it goes.
MIN_STEP, MAX_STEP = 16, 64
#: per medium, ``hash -> bitmask of the rank slots holding it``
Media = dict[str, dict[BlockHash, int]]


def segments(
    get: Callable[[BlockHash], int | None],
    keys: Sequence[BlockHash],
    active: int,
    step: int = MIN_STEP,
    start: int = 0,
) -> list[tuple[int, int]]:
    """``(end, bits)`` pairs: where each bit of ``active`` stops holding ``keys[start:]``.

    ``get`` gives a key's holder mask (None: no holder). The pairs partition
    ``active``; a bit holding every key ends at ``len(keys)``. Keys are read
    in C, a slice at a time (``step`` keys, doubling up to ``MAX_STEP``), so
    a walk ends within a slice of where the last bit drops out. Masks come in long
    runs of equal values (a shared system prompt, then one rank's turns):
    a slice that only repeats the last mask is passed over in C (``count``),
    and elsewhere only the positions where the mask changes are looked at.
    """
    out: list[tuple[int, int]] = []
    pos, last, length = start, None, len(keys)
    while active and pos < length:
        piece = list(map(get, keys[pos : pos + step]))
        step = min(2 * step, MAX_STEP)
        if piece.count(last) != len(piece):
            for i in compress(count(pos), map(ne, piece, [last, *piece])):
                kept = active & (piece[i - pos] or 0)
                if kept != active:
                    out.append((i, active ^ kept))
                    active = kept
                    if not active:
                        break
            last = piece[-1]
        pos += len(piece)
    if active:
        out.append((length, active))
    return out


def runs_of(
    get: Callable[[BlockHash], int | None],
    keys: Sequence[BlockHash],
    group: int,
    first: int,
    step: int = MIN_STEP,
) -> list[tuple[int, int]]:
    """:func:`segments` over ``group``, given ``first``, the mask of ``keys[0]``.

    Most walks of a lower tier end at once: those cost no slice.
    """
    active = group & first
    out = segments(get, keys, active, step) if active else []
    if group != active:
        out.append((0, group & ~active))
    return out


def run_classes(
    gpu: list[tuple[int, int]],
    on_cpu: list[tuple[int, int]],
    on_storage: list[tuple[int, int]],
    group: int,
) -> list[tuple[int, int, int, int]]:
    """``(bits, GPU run, CPU run, STORAGE run)``: the ``group`` ranks sharing all three runs."""
    out = []
    for g, on_gpu in gpu:
        on_gpu &= group
        for c, bits in on_cpu:
            if on_gpu & bits:
                for s, more in on_storage:
                    if on_gpu & bits & more:
                        out.append((on_gpu & bits & more, g, c, s))
    return out


def extended(
    classes: list[tuple[int, int, int, int]],
    get: Callable[[BlockHash], int | None],
    ends: Sequence[BlockHash],
    size: int,
) -> list[tuple[int, int, int, int, int]]:
    """Each class with ``n``, the chunk where its prefix stops if only CPU may extend it.

    Chunk ``g // size`` is the first not wholly inside the GPU run. A CPU
    run reaching it ends there too; otherwise the CPU run starting at that
    chunk is walked (once for all the classes starting there), and the
    classes split by it.
    """
    out = []
    later: dict[int, list[tuple[int, int, int, int]]] = {}
    for bits, g, c, s in classes:
        if c >= g // size:
            out.append((bits, g, c, s, c))
        else:
            later.setdefault(g // size, []).append((bits, g, c, s))
    for first, waiting in later.items():
        active = sum(bits for bits, *_ in waiting)
        if first < len(ends):
            on = active & (get(ends[first]) or 0)
            runs = segments(get, ends, on, MIN_STEP, first) if on else []
            if active != on:
                runs.append((first, active & ~on))
        else:
            runs = [(first, active)]
        for bits, g, c, s in waiting:
            out += [(bits & held, g, c, s, n) for n, held in runs if bits & held]
    return out


def bits_of(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


#: ``_CLASS[k]`` turns a mask's binary digits into bytes: k for each 1, 0 for each 0.
_CLASS = [bytes.maketrans(b"01", bytes((0, k))) for k in range(256)]


class Digits:
    """The binary digits of a rank mask, to hand whole classes of ranks their answer in C."""

    __slots__ = ("spec", "width")

    def __init__(self, width: int) -> None:
        self.width, self.spec = width, f"0{width}b"

    def spread(
        self, answers: list[tuple[int, PrefixMatch]], ranks: Sequence[RankId], bits: Sequence[int]
    ) -> dict[RankId, PrefixMatch]:
        """Each rank's answer: that of the (disjoint) mask holding its bit, else the empty one.

        Class k numbers its digits k in one byte string (up to 255 classes;
        the rest, rare, one bit at a time); a rank then reads its digit.
        """
        table, ids = [EMPTY], 0
        for mask, match in answers[:255]:
            ids |= int.from_bytes(format(mask, self.spec).encode().translate(_CLASS[len(table)]))
            table.append(match)
        by_bit = [EMPTY, *map(table.__getitem__, ids.to_bytes(self.width)[::-1])]
        for mask, match in answers[255:]:
            for bit in bits_of(mask):
                by_bit[bit.bit_length()] = match
        return dict(zip(ranks, map(by_bit.__getitem__, map(int.bit_length, bits)), strict=True))
