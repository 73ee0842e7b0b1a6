"""The embedded routed entries' shared index (hash -> bits of the ranks holding it),
against each rank's own entries: a lookup walking the chain once for all ranks
must answer what walking each rank's entries would, through records, evictions,
expiry, confirmations, clears and removals."""

from __future__ import annotations

import random

from indexer.core.events import RankId
from indexer.core.routed import routed_run
from indexer.routed import MemoryRouted

ENGINES = ("e", "f", "g")
RANKS = [RankId(engine, dp) for engine in ENGINES for dp in range(4)]


def _chains(rng: random.Random) -> list[list[int]]:
    """Prompts sharing a few system prompts, some of them twice (a conversation)."""
    systems = [[rng.randrange(1 << 40) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    chains = [rng.choice(systems) + [rng.randrange(1 << 40) for _ in range(60)] for _ in range(6)]
    return chains + [[*c[: rng.randrange(1, len(c))], 7, 8, 9] for c in chains]


def _index_of(routed: MemoryRouted) -> dict[int, int]:
    index: dict[int, int] = {}
    for held in routed._ranks.values():
        for h in held.entries:
            index[h] = index.get(h, 0) | held.bit
    return index


async def test_one_walk_for_all_ranks_answers_what_each_ranks_walk_would() -> None:
    rng, now = random.Random(17), [0.0]
    routed = MemoryRouted(clock=lambda: now[0])
    chains = _chains(rng)
    checked = shared = 0
    for _ in range(600):
        op, rank, chain = rng.random(), rng.choice(RANKS), rng.choice(chains)
        if op < 0.5:
            start = rng.randrange(len(chain))
            await routed.record(rank, chain[start:], rng.uniform(1, 20), rng.randrange(40, 300))
        elif op < 0.65:
            await routed.confirm(rank, rng.sample(chain, min(len(chain), rng.randrange(1, 20))))
        elif op < 0.7:
            await routed.clear(rank)
        elif op < 0.73:
            await routed.forget(rank.engine)
        else:
            now[0] += rng.uniform(0, 2)
        asked = set(rng.sample(ENGINES, rng.randrange(1, 4)))
        starts = {r: rng.randrange(len(chain) + 1) for r in rng.sample(RANKS, 6)}
        got = await routed.lookup(chain, starts, asked)
        want = {}
        for r, held in routed._ranks.items():  # each rank's own walk, after the lookup's expiry
            start = starts.get(r, 0)
            if r.engine in asked and start < len(chain) and chain[start] in held.entries:
                want[r] = routed_run(chain, start, held.entries.__contains__)
        assert got == want
        assert routed._holders == _index_of(routed)
        checked += bool(want)
        shared += len(want) > 1
    assert checked > 100 and shared > 30  # the walk for several ranks was exercised
    bits = [held.bit for held in routed._ranks.values()]
    assert len(set(bits)) == len(bits)  # bits of dropped ranks were reused, never shared
    await routed.close()
    assert routed._holders == {}
