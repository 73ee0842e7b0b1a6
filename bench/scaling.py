"""Item 8: how ingest and query cost grow with engines and with prompt length.

- Engines (8 -> 1024): the same content, the first batches of every one of
  the fleet's N simulated engines, spread over ever more ranks. Below N an
  engine replays several sources (source ``s`` goes to engine ``s mod
  engines``, their batches interleaved); from N up engine ``e`` replays
  source ``e mod N`` (clones share their source's hashes, as replicas
  serving one popular prompt set would). So every count holds every distinct
  hash and a query walks as deep at 8 engines as at 1024: what grows is the
  fleet alone. Ingest is block-ops/s (and the decode floor of the same
  bytes); query is the p50 of a 512-block prefix match with every engine
  listed, on the compiled core and on the pure-Python reference core (each
  rank walked by the core's rule), each timed in rounds of its own: chain by
  chain between the compiled core's calls, the reference core's (5.6x as long
  at 512 engines as at 8) evicted the more of the compiled core's data the
  more engines, and the compiled figure grew with the reference's footprint.
  The details say how many ranks a query answers (those matching something:
  the clones of the engines holding the chain grow with the fleet).
- Prompt length (blocks): query p50 on the fleet's store (and Dynamo's), and
  ingest of an engine storing a prompt of that length in one event and then
  evicting it block by block, as vLLM does.
"""

from __future__ import annotations

import asyncio
import random

from bench import dynamo
from bench.fleet import BLOCK_SIZE, CHUNK_BLOCKS, Fleet, rank_of
from bench.ingest import decode_floor, kvindex
from bench.measure import interleaved, latency_ms
from bench.query import load, ours, reference_store, timed_calls
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockRemoved, BlockStored, EventBatch
from indexer.engines.vllm.wire import encode_batch
from indexer.stores import MemoryStore

SECTION = "8"


def spread_stream(fleet: Fleet, engines: int, batches: int) -> list:
    """Every source's first ``batches`` batches over ``engines`` ranks (see the module)."""
    sources = [run.payloads[:batches] for run in fleet.runs]
    n = len(sources)
    replays: dict[int, set[int]] = {e: {e % n} for e in range(engines)}
    for s in range(n):
        replays[s % engines].add(s)
    stream = []
    for e in range(engines):
        mine = [sources[s] for s in sorted(replays[e])]
        payloads = [p[i] for i in range(batches) for p in mine if i < len(p)]
        stream += [(rank_of(e), seq, payload) for seq, payload in enumerate(payloads)]
    return stream


def by_engines(fleet: Fleet, counts: list[int], batches: int, queries: int) -> dict:
    out = {}
    chains = fleet.chains(512, queries)
    for engines in counts:
        stream = spread_stream(fleet, engines, batches)
        ops = kvindex(stream)
        times = interleaved(3, {"kvindex": lambda s=stream: kvindex(s),
                                "floor": lambda s=stream: decode_floor(s)})  # fmt: skip
        store = MemoryStore()
        asyncio.run(load(store, stream))
        listed = {rank_of(e).engine: CHUNK_BLOCKS for e in range(engines)}
        candidates = {
            "kvindex": ours(store, listed),
            "reference": ours(reference_store(stream), listed),
        }
        answered = sum(len(candidates["kvindex"](chain)) for chain in chains) / len(chains)
        # each core in rounds of its own (see the module)
        samples = {name: timed_calls({name: call}, chains, 3)[name]
                   for name, call in candidates.items()}  # fmt: skip
        out[engines] = {
            "block_ops": ops,
            "ingest_us_per_op": 1e6 * times["kvindex"] / ops,
            "decode_floor_us_per_op": 1e6 * times["floor"] / ops,
            "query_512": latency_ms(samples["kvindex"]),
            "query_512_reference": latency_ms(samples["reference"]),
            "ranks_answered_per_query": answered,
        }
    return out


def length_stream(blocks: int, prompts: int) -> list:
    """One engine: each prompt stored in one event, then evicted one block per event."""
    rng = random.Random(blocks)
    stream, rank = [], rank_of(0)
    for seq in range(prompts):
        chain = [rng.getrandbits(64) for _ in range(blocks)]
        tokens = [rng.randrange(32_000) for _ in range(blocks * BLOCK_SIZE)]
        stored = BlockStored(chain, None, tokens, BLOCK_SIZE, medium="GPU")
        removed = [BlockRemoved([h], "GPU") for h in reversed(chain)]
        for i, events in enumerate(([stored], removed)):
            stream.append((rank, 2 * seq + i, encode_batch(EventBatch(0.0, events, 0))))
    return stream


def by_length(fleet: Fleet, store: MemoryStore, lengths: list[int], queries: int) -> dict:
    out: dict = {}
    candidates = {"kvindex": ours(store, {rank_of(e).engine: CHUNK_BLOCKS
                                          for e in range(fleet.config.engines)})}  # fmt: skip
    if dynamo.available():
        tree = dynamo.Tree()
        tree.apply(dynamo.convert(fleet.stream))
        candidates["dynamo"] = tree.find
    for blocks in lengths:
        samples = timed_calls(candidates, fleet.chains(blocks, queries), 3)
        stream = length_stream(blocks, max(2, 8192 // blocks))
        ops = kvindex(stream)
        times = interleaved(3, {"kvindex": lambda s=stream: kvindex(s),
                                "floor": lambda s=stream: decode_floor(s)})  # fmt: skip
        out[blocks] = {
            "query": {name: latency_ms(s) for name, s in samples.items()},
            "ingest_block_ops_per_s": ops / times["kvindex"],
            "decode_floor_block_ops_per_s": ops / times["floor"],
        }
    return out


def run(report: Report, fleet: Fleet, store: MemoryStore, full: bool, queries: int) -> dict:
    counts = [8, 32, 128, 512, 1024] if full else [8, 32, 128, 512]
    engines = by_engines(fleet, counts, 12 if full else 6, queries)
    lengths = by_length(fleet, store, [32, 128, 512, 2048, 4096], queries)
    low, high = engines[counts[0]], engines[counts[-1]]
    report.add(
        Figure(SECTION, f"scaling: ingest us/op at {counts[-1]} engines", high["ingest_us_per_op"],
               "us/op", f"same at {counts[0]} engines", low["ingest_us_per_op"]),
        Figure(SECTION, f"scaling: 512-block query p50 at {counts[-1]} engines",
               high["query_512"]["p50_ms"], "ms", f"same at {counts[0]} engines",
               low["query_512"]["p50_ms"], Goal(2.0, at_least=False)),
        Figure(SECTION, f"scaling: 512-block query p50 at {counts[-1]} engines, reference core",
               high["query_512_reference"]["p50_ms"], "ms", f"same at {counts[0]} engines",
               low["query_512_reference"]["p50_ms"], note="the core's rule, rank by rank"),
    )  # fmt: skip
    return {"by_engines": engines, "by_length": lengths}
