"""The compiled key tables against dicts, where their layout could go wrong.

The tables take any capacity (a key's slot is its mixed bits multiplied onto
the capacity), grow by half, and probe linearly, wrapping at the capacity; a
hash that is not an int below 2**64 is keyed by its place in a side list. So:
counts through many growths, with deletions between, must equal a dict's; a
cluster of keys all homed on the table's last slot (their mixed bits one apart,
found by inverting the mix) wraps past the end onto keys homed at the start,
and deleting out of it (backward shifts across the wrap) must lose none, at
every capacity the table passes through; and the holder index's walk must find
the same chains there as the core's reference, rank by rank.
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc

from indexer.core.events import EventBatch, RankId
from indexer.core.residency import add_references, drop_references
from indexer.stores import MemoryStore, apply_events
from indexer.stores.memory import compiled

from .events import removed, stored

_M = 2**64 - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def _unshift(k: int) -> int:
    return k ^ (k >> 33)  # its own inverse: 2 * 33 > 64


def unmix(mixed: int) -> int:
    """The key whose mix() (the tables' 64-bit finaliser) is ``mixed``."""
    k = _unshift(mixed)
    k = _unshift(k * pow(_C2, -1, 2**64) & _M)
    return _unshift(k * pow(_C1, -1, 2**64) & _M)


def mix(k: int) -> int:
    k = _unshift(k)
    k = _unshift(k * _C1 & _M)
    return _unshift(k * _C2 & _M)


#: keys homed on the last slot at any capacity below 2**50 (mixed bits at the top),
#: then keys homed on the first (mixed bits at the bottom): one cluster across the wrap
TOP = [unmix(_M - i) for i in range(40)]
BOTTOM = [unmix(i) for i in range(40)]


def test_unmix_inverts_the_mix() -> None:
    assert [mix(k) for k in TOP[:3]] == [_M, _M - 1, _M - 2]
    assert mix(BOTTOM[5]) == 5


def check(table: compiled.core.CountTable, want: dict) -> None:
    assert len(table) == len(want)
    assert dict(table.items()) == want
    for h, n in want.items():
        assert table.get(h) == n, h


def test_counts_through_many_growths_with_deletions_equal_a_dict() -> None:
    """Ints (some past 2**64) and bytes, added in rounds that grow the table to ~6000
    entries, a third dropped after each: after every round the table is the dict."""
    rng = random.Random(7)
    table, want = compiled.core.CountTable(), {}
    pool = [rng.getrandbits(64) for _ in range(4000)] + [2**64 + i for i in range(50)]
    pool += [rng.randbytes(32) for _ in range(200)] + TOP + BOTTOM
    held: list = []
    for size in (3, 10, 30, 100, 300, 1000, 3000, 6000):
        batch = rng.choices(pool, k=size)
        fresh: list = []
        add_references(want, batch, fresh)
        assert table.add(batch) == fresh
        held = list(want)
        out = [*rng.sample(held, len(held) // 3), b"never held", 2**70]
        gone: list = []
        unknown = drop_references(want, out, gone)
        assert table.drop(out) == (unknown, gone)
        check(table, want)
    assert len(want) > 1000 and any(n > 1 for n in want.values())


def test_a_cluster_across_the_wrap_survives_deletions_at_every_capacity() -> None:
    """At each size the table grows through, the wrapped cluster is filled in, then
    emptied from its middle and both ends: every key left is found, none removed is."""
    rng = random.Random(3)
    filler = [rng.getrandbits(64) for _ in range(2000)]
    for size in (0, 5, 9, 20, 37, 70, 150, 400, 2000):
        table = compiled.core.CountTable()
        cluster = [k for pair in zip(TOP, BOTTOM, strict=True) for k in pair]
        table.add(filler[:size] + cluster)
        want = dict.fromkeys(filler[:size] + cluster, 1)
        check(table, want)
        for k in cluster[10:30] + cluster[:4] + cluster[-4:]:
            assert table.drop([k]) == (0, [k])
            del want[k]
            check(table, want)
        table.add(TOP[:8])
        add_references(want, TOP[:8])
        check(table, want)


def test_side_places_are_reused_and_never_meet_ints() -> None:
    """A bytes hash freed leaves its side place to the next; an int equal to a side
    key's place or to its Python hash is another hash."""
    table = compiled.core.CountTable()
    digests = [bytes([i]) * 32 for i in range(6)]
    table.add(digests)
    table.drop(digests[:3])
    later = [b"new" * 8, 0, 1, 2, hash(digests[4]) % 2**64]
    table.add(later)
    want = dict.fromkeys([*digests[3:], *later], 1)
    check(table, want)
    assert table.get(digests[0]) is None and 5 not in table


def test_the_walk_over_a_wrapped_cluster_equals_the_reference() -> None:
    """Chains of the wrapped cluster's keys, held by two ranks (one dropping some),
    match the same on the compiled core and the reference."""
    chain = [k for pair in zip(TOP, BOTTOM, strict=True) for k in pair]
    a, b = RankId("a", 0), RankId("b", 0)

    async def run(store: MemoryStore) -> list[dict]:
        await apply_events(store, a, 0, EventBatch(0.0, [stored(chain)], 0))
        await apply_events(store, b, 0, EventBatch(0.0, [stored(chain[:50])], 0))
        found = [await store.prefix_match(chain, {"a": None, "b": None})]
        await apply_events(store, a, 1, EventBatch(0.0, [removed(chain[20:24])], 0))
        found.append(await store.prefix_match(chain, {"a": None, "b": None}))
        return found

    fast = asyncio.run(run(MemoryStore()))
    slow = asyncio.run(run(MemoryStore(compiled.REFERENCE)))
    assert fast == slow
    assert fast[0][a].gpu_blocks == 80 and fast[0][b].gpu_blocks == 50
    assert fast[1][a].gpu_blocks == 20
    assert MemoryStore(compiled.REFERENCE)._holders is None  # each rank by the core's rule


def test_a_table_emptied_gives_its_room_back() -> None:
    """Filled with 120k hashes (ints and bytes) and emptied but for a few, a table
    shrinks, side list and all: it keeps the room of a few hashes, not of 120k (a
    rank cleared, or an engine refused over its bound, leaves no room behind)."""
    rng = random.Random(11)
    ints = [rng.getrandbits(64) for _ in range(100_000)]
    digests = [rng.randbytes(32) for _ in range(20_000)]
    keep = ints[:10] + digests[:10]
    tracemalloc.start()
    try:
        table = compiled.core.CountTable()
        base = tracemalloc.get_traced_memory()[0]
        table.add(ints + digests)
        full = tracemalloc.get_traced_memory()[0] - base
        table.drop(ints[10:] + digests[10:])
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    check(table, dict.fromkeys(keep, 1))
    assert full > 1_000_000 and left < full // 50, (full, left)
