"""The compiled holder index equals the core's reference, and is the one in use.

Differential property tests: random streams (duplicates and holes, clears,
restarts, forgets, unknown removals, int and bytes hashes, hybrid groups) over
130 ranks, some batches spread over every rank or every other one, so that
rank sets run past 64 slots; after every step the store on the compiled index
must answer as :mod:`indexer.core`'s reference (counts, residency, prefix
matches), as the store without the build does, and its tables must hold, hash
by hash, the ranks the residency says. Below that, the tables alone against
plain dicts under random adds and discards of keys chosen to collide (an int
equal to a bytes hash's key, the ends of the 64-bit range, ints past it).
"""

from __future__ import annotations

import asyncio
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import CPU, GPU, MEDIA, EventBatch, RankId
from indexer.core.matching import PrefixMatch
from indexer.stores import MemoryStore, apply_events
from indexer.stores.memory import compiled

from .apikit import Api
from .conftest import REPO, run_without, serve_warning_without
from .events import stored
from .reference import CHAINS, EVENT, Reference, check_answers
from .test_holders import check_index

EXTENSION = "indexer.stores.memory._holders"
RANKS = [RankId(f"e{i % 4}", i // 4) for i in range(130)]
#: chunk sizes per engine: declared, learned, and two declared sizes at once
ENGINES = {"e0": 2, "e1": None, "e2": 3, "e3": 2}


def test_the_compiled_holder_index_is_in_use() -> None:
    assert compiled.PART.available, f"the holder index did not build or load: {compiled.PART.error}"
    module_file = Path(compiled.core.__file__)
    assert module_file.parent == REPO / "indexer" / "stores" / "memory"
    assert any(module_file.name.endswith(suffix) for suffix in EXTENSION_SUFFIXES)
    assert compiled.CORE is compiled.core
    assert type(MemoryStore()._holders) is compiled.core.HolderIndex


def test_the_store_counts_in_the_compiled_tables() -> None:
    async def run() -> MemoryStore:
        store = MemoryStore()
        await apply_events(store, RANKS[0], 0, EventBatch(0.0, [stored([1, 2, 2])], 0))
        return store

    store = asyncio.run(run())
    assert type(store._holders) is compiled.core.HolderIndex
    (table,) = store._ranks[RANKS[0]].tables.values()
    assert type(table.counts) is compiled.core.CountTable
    assert table.counts == {1: 1, 2: 2}


def test_without_the_extension_the_store_runs_the_reference_and_says_why() -> None:
    script = (
        "import asyncio, json\n"
        "from indexer.core.events import BlockStored, EventBatch, RankId\n"
        "from indexer.stores import MemoryStore, apply_events\n"
        "from indexer.stores.memory import compiled\n"
        "store, rank = MemoryStore(), RankId('e', 0)\n"
        "asyncio.run(apply_events(store, rank, 0, EventBatch(0.0, [BlockStored([1, 2])])))\n"
        "found = asyncio.run(store.prefix_match([1, 2, 3], {'e': None}))[rank]\n"
        "kind = type(store._ranks[rank])\n"
        "print(json.dumps([compiled.PART.status(), [kind.__module__, found.gpu_blocks]]))\n"
    )
    assert run_without(EXTENSION, script) == ["indexer.core.residency", 2]


async def test_stats_say_when_the_holder_index_is_not_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = Api()
    try:
        assert (await api.client.get("/stats")).json()["compiled_core"] is True
        monkeypatch.setattr(compiled.PART, "module", None)
        monkeypatch.setattr(compiled.PART, "error", "ImportError: no _holders")
        stats = (await api.client.get("/stats")).json()
        assert stats["compiled_core"] is False
        assert stats["compiled_core_error"] == "ImportError: no _holders"
    finally:
        await api.close()


@pytest.mark.slow
def test_serve_warns_on_start_without_the_holder_index() -> None:
    assert serve_warning_without(EXTENSION).startswith("compiled holder index not in use")


async def check_equal(fast: MemoryStore, slow: MemoryStore, ref: Reference, at: int) -> None:
    check_index(fast)
    await check_answers(fast, ref, RANKS, ENGINES, at)
    for chain in CHAINS:
        found = await fast.prefix_match(chain, ENGINES)
        assert found == await slow.prefix_match(chain, ENGINES), (at, chain)


_rank = st.integers(0, len(RANKS) - 1)
#: a batch to one rank, or the same batch to every ``stride``-th rank from ``start``
_step = st.one_of(
    st.tuples(st.just("batch"), _rank, st.sampled_from([1, 1, 0, 2]), st.lists(EVENT, max_size=6)),
    st.tuples(
        st.just("spread"), st.integers(0, 3), st.sampled_from([1, 2]), st.lists(EVENT, max_size=4)
    ),
    st.tuples(st.just("clear"), _rank, st.sampled_from([[CPU], [GPU, CPU]])),
    st.tuples(st.just("restart"), _rank),
    st.tuples(st.just("forget"), _rank),
)


async def run_stream(steps: list[tuple]) -> None:
    fast, slow, ref = MemoryStore(), MemoryStore(core=compiled.REFERENCE), Reference()
    seqs = dict.fromkeys(RANKS, -1)
    for at, (what, first, *args) in enumerate(steps):
        if what in ("batch", "spread"):
            if what == "batch":
                targets, (step, events) = [RANKS[first]], args
            else:
                targets, (step, events) = RANKS[first :: args[0]], (1, args[1])
            for rank in targets:
                seqs[rank] = max(0, seqs[rank] + step)
                batch = EventBatch(float(at), events, 0)
                applied = (await apply_events(fast, rank, seqs[rank], batch)).applied
                assert applied == ref.apply(rank, seqs[rank], batch), at
                await apply_events(slow, rank, seqs[rank], batch)
            await check_equal(fast, slow, ref, at)
            continue
        rank = RANKS[first]
        if what == "clear":
            media = args[0]
            reset = False
        else:  # a restart clears and numbers from 0 again; a forget drops the rank
            media, reset = [GPU, CPU], True
        for store in (fast, slow):
            if what == "forget":
                await store.forget(rank)
            else:
                await store.clear(rank, media, reset_seq=reset)
        if what == "forget":
            ref.forget(rank)
        else:
            ref.clear(rank, media, reset_seq=reset)
        if reset:
            seqs[rank] = -1
        await check_equal(fast, slow, ref, at)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(_step, min_size=1, max_size=12))
def test_the_compiled_store_equals_the_reference_after_every_batch(steps) -> None:
    asyncio.run(run_stream(steps))


#: keys that meet in the tables: an int equal to a bytes hash's 64-bit key, the ends of
#: the 64-bit range, ints past it (kept exactly in the side list), digests
_BYTES = [b"\x01" * 32, (1).to_bytes(32, "big"), b"z" * 16]
KEYS = [
    0,
    1,
    2**63,
    2**64 - 1,
    2**64,
    2**70 + 1,
    hash(_BYTES[0]) % 2**64,
    *_BYTES,
    *range(2, 40),
]
_op = st.tuples(
    st.booleans(),
    st.sampled_from(MEDIA),
    st.integers(0, 129),
    st.lists(st.sampled_from(KEYS), max_size=12),
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40))
def test_the_tables_equal_the_reference_dicts(ops) -> None:
    fast = compiled.core.HolderIndex()
    slow: dict[str, dict] = {m: {} for m in MEDIA}  # per medium, hash -> bits of its holders
    bits = [fast.take_bit() for _ in range(130)]
    assert bits == [1 << slot for slot in range(130)]
    for adding, medium, slot, hashes in ops:
        bit = bits[slot]
        (fast.add if adding else fast.discard)(medium, bit, hashes)
        for h in hashes:
            held = slow[medium].pop(h, 0)
            if mask := held | bit if adding else held & ~bit:
                slow[medium][h] = mask
        for m in MEDIA:
            assert dict(fast.media[m].items()) == slow[m], (medium, m)
            for h in KEYS:
                assert fast.media[m].get(h, 0) == slow[m].get(h, 0), h
                assert (h in fast.media[m]) == (h in slow[m]), h


def test_a_bytes_hash_never_matches_the_int_of_its_key() -> None:
    """A bytes hash is keyed by its Python hash: an int of that value is another hash."""
    digest = b"\x07" * 32
    twin = hash(digest) % 2**64

    async def run() -> tuple[dict, dict]:
        store = MemoryStore()
        # the digest first: its entry comes first where the two keys' probes meet
        await apply_events(store, RANKS[1], 0, EventBatch(0.0, [stored([digest, 5])], 0))
        await apply_events(store, RANKS[0], 0, EventBatch(0.0, [stored([twin, 5])], 0))
        engines = {"e0": None, "e1": None}
        return await store.prefix_match([digest, 5], engines), await store.prefix_match(
            [twin, 5], engines
        )

    by_digest, by_twin = asyncio.run(run())
    assert {r.engine: m.gpu_blocks for r, m in by_digest.items()} == {"e1": 2}
    assert {r.engine: m.gpu_blocks for r, m in by_twin.items()} == {"e0": 2}


def test_only_ranks_matching_something_are_answered_on_both_cores() -> None:
    """300 ranks (rank sets five words wide), most holding none of the chain's start:
    both cores answer exactly the ranks that match something, as each rank's own
    tables say, for declared and learned chunk sizes; a forgotten rank's learned
    chunk size leaves with it (the next rank on its slot learned none)."""
    chain = list(range(1000, 1032))
    held = [
        lambda i: [stored(chain[: 1 + i % 32])],  # a GPU run
        lambda i: [stored(chain[1:])],  # all but the first block: nothing
        lambda i: [stored(chain[:4], CPU)],  # teaches 4 blocks per chunk: one CPU chunk
        lambda i: [stored([chain[1]], CPU, block_size=0)],  # chunk 0's end at size 2
        lambda i: [stored([7, 8])],  # none of the chain
    ]
    ranks = [RankId(f"m{i % 3}", i // 3) for i in range(300)]
    queries = [{"m0": None, "m1": 2, "m2": None}, {"m0": 2, "m2": 4}, {"m1": None}]

    async def run(store: MemoryStore) -> list[dict]:
        for i, rank in enumerate(ranks):
            await apply_events(store, rank, 0, EventBatch(0.0, held[i % 5](i), 0))
        found = []
        for engines in queries:
            got = await store.prefix_match(chain, engines)
            for rank, state in store._ranks.items():
                declared = engines.get(rank.engine, 0)
                want = state.match(chain, declared or state.chunk_blocks)
                if rank.engine not in engines or want == PrefixMatch():
                    assert rank not in got, (engines, rank)
                else:
                    assert got[rank] == want, (engines, rank)
            found.append(got)
        await store.forget(ranks[2])  # it learned 4 blocks per chunk
        newcomer = RankId("m2", 999)
        placeholder = EventBatch(0.0, [stored([chain[3]], CPU, block_size=0)], 0)
        await apply_events(store, newcomer, 0, placeholder)
        if store._holders is not None:  # the reference keeps no slots
            assert store._ranks[newcomer].bit == 1 << 2  # the forgotten rank's slot
        found.append(await store.prefix_match(chain, {"m2": None}))
        assert newcomer not in found[-1]  # matched on GPU only: it holds nothing there
        return found

    fast, slow = asyncio.run(run(MemoryStore())), asyncio.run(run(MemoryStore(compiled.REFERENCE)))
    assert fast == slow
    assert 0 < len(fast[0]) < 200  # not vacuous: answered and left out ranks alike


def test_a_listing_changed_in_place_or_by_the_store_is_read_afresh() -> None:
    """The compiled index keeps each slot's size from the last ``chunk_blocks`` while a
    query passes the same keys and values in the same order; a dict changed in place
    between queries, a slot named for another rank and a chunk size learned meanwhile
    are all seen, as the reference sees them."""
    chain = list(range(1, 17))
    a0, b0, newcomer = RankId("a", 0), RankId("b", 0), RankId("c", 0)
    placeholder = stored([chain[3]], CPU, block_size=0)  # chunk 0's end at size 4

    async def run(store: MemoryStore) -> list[dict]:
        engines: dict[str, int | None] = {"a": None, "b": 2}
        await apply_events(store, a0, 0, EventBatch(0.0, [stored(chain[:2]), placeholder], 0))
        await apply_events(store, b0, 0, EventBatch(0.0, [stored(chain[:4], CPU)], 0))
        found = [await store.prefix_match(chain, engines)]
        engines["a"] = 4  # a's placeholder now ends its first chunk
        found.append(await store.prefix_match(chain, engines))
        del engines["b"]
        found.append(await store.prefix_match(chain, engines))
        engines["b"] = None  # b's learned 4 blocks per chunk
        found.append(await store.prefix_match(chain, engines))
        bit = getattr(store._ranks[b0], "bit", None)  # the reference keeps no slots
        await store.forget(b0)
        await apply_events(store, newcomer, 0, EventBatch(0.0, [stored(chain[:4], CPU)], 0))
        assert getattr(store._ranks[newcomer], "bit", None) == bit
        found.append(await store.prefix_match(chain, engines))  # on b's slot, not listed
        engines["c"] = engines.pop("b")  # the same value object
        found.append(await store.prefix_match(chain, engines))
        engines["a"] = None
        await apply_events(store, a0, 1, EventBatch(0.0, [stored(chain[4:8], CPU)], 0))
        found.append(await store.prefix_match(chain, engines))  # a learned 4 meanwhile
        return found

    fast, slow = asyncio.run(run(MemoryStore())), asyncio.run(run(MemoryStore(compiled.REFERENCE)))
    assert fast == slow
    assert [sorted(r.engine for r in answer) for answer in fast] == [
        ["a", "b"],
        ["a", "b"],
        ["a"],
        ["a", "b"],
        ["a"],
        ["a", "c"],
        ["a", "c"],
    ]
    assert fast[1][a0].cpu_blocks == 4 and fast[0][a0].cpu_blocks == 0
    assert fast[6][a0].cpu_blocks == 8  # its placeholder and the chunk it stored
