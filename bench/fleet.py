"""The synthetic fleet every benchmark runs on: simulated engines, recorded once.

Each engine is a :class:`~producer.sim.SimEngine` fed by its own stream of
one long-context chat :class:`~producer.workload.Workload` (so engines share
popular system prompts, conversations resend their history turn after turn,
and GPU and CPU pools are small enough to evict). The engines are stepped
as fast as they go, not in real time, and what they publish is kept as the
exact vLLM-wire payloads. Benchmarks replay those bytes (ingest), apply them
to build a resident fleet (queries, memory), and query with prompts the
engines really served, cut or extended to the length a benchmark asks for.

Engines are independent, so they are simulated on every core.
"""

from __future__ import annotations

import multiprocessing
import random
from dataclasses import dataclass
from functools import cached_property

from indexer.core.events import RankId
from indexer.engines.vllm.hashing import HashSpec, block_hashes
from indexer.engines.vllm.wire import encode_batch
from producer.sim import SimConfig, SimEngine
from producer.vllm_trace import long_chat
from producer.workload import Workload, WorkloadConfig

BLOCK_SIZE = 16
CHUNK_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How many engines, how big their pools, how long they run."""

    engines: int = 64
    steps: int = 120
    gpu_blocks: int = 2048
    cpu_chunks: int = 640
    max_context_tokens: int = 24_576

    def sim(self) -> SimConfig:
        return SimConfig(
            block_size=BLOCK_SIZE,
            gpu_blocks=self.gpu_blocks,
            blocks_per_chunk=CHUNK_BLOCKS,
            cpu_chunks=self.cpu_chunks,
            max_running=4,
            decode_tokens_per_step=64,
        )

    def workload(self) -> WorkloadConfig:
        return long_chat(seed=11, max_context_tokens=self.max_context_tokens)


#: About 290k resident entries over 64 engines (GPU ~1.9k + CPU ~2.5k blocks each).
QUICK = FleetConfig(steps=40)
#: About 1M resident entries over 64 engines (GPU ~6k + CPU ~9.6k blocks each).
FULL = FleetConfig(steps=150, gpu_blocks=6144, cpu_chunks=2400, max_context_tokens=40_960)


@dataclass(frozen=True, slots=True)
class EngineRun:
    """What one simulated engine published, and prompts it served (tokens)."""

    payloads: list[bytes]
    served: list[tuple[int, ...]]


def _simulate(args: tuple[FleetConfig, int]) -> EngineRun:
    config, index = args
    engine = SimEngine(config.sim(), clock=lambda: 0.0)
    stream = Workload(config.workload(), stream=index)
    payloads, served = [], []
    for _ in range(config.steps):
        while len(engine._waiting) < 2:  # always a queue: the pools stay under pressure
            request = next(stream)
            engine.submit(request.prompt, request.output)
        batch = engine.step()
        if batch is not None:
            payloads.append(encode_batch(batch))
        served.extend(engine.recently_served)
        engine.recently_served.clear()
    return EngineRun(payloads, served)


def rank_of(index: int) -> RankId:
    return RankId(f"engine-{index:04d}", 0)


class Fleet:
    """Every engine's published payloads, in the order an indexer would receive them."""

    def __init__(self, config: FleetConfig, processes: int | None = None) -> None:
        self.config = config
        jobs = [(config, i) for i in range(config.engines)]
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            self.runs: list[EngineRun] = pool.map(_simulate, jobs, chunksize=1)

    @cached_property
    def stream(self) -> list[tuple[RankId, int, bytes]]:
        """``(rank, seq, payload)`` round-robin over engines, one batch each in turn."""
        longest = max(len(run.payloads) for run in self.runs)
        return [
            (rank_of(e), seq, run.payloads[seq])
            for seq in range(longest)
            for e, run in enumerate(self.runs)
            if seq < len(run.payloads)
        ]

    def stream_of(self, engines: int) -> list[tuple[RankId, int, bytes]]:
        """The stream of the first ``engines`` engines only."""
        names = {rank_of(e) for e in range(engines)}
        return [item for item in self.stream if item[0] in names]

    def spec(self) -> HashSpec:
        """The fleet's hashing (sha256 without a seed: the same in every engine)."""
        sim = self.config.sim()
        return HashSpec(sim.hash_algo, sim.hash_seed, sim.block_size)

    def prompts(self, tokens: int, count: int, seed: int = 5) -> list[list[int]]:
        """``count`` token prompts of exactly ``tokens`` tokens.

        Each is a prompt some engine served, cut to length, or continued with
        fresh tokens (a new user turn) when it is shorter: the engine that
        served it holds much of it, others hold its system prompt, if any.
        """
        rng = random.Random(seed)
        served = [prompt for run in self.runs for prompt in run.served]
        out = []
        for _ in range(count):
            prompt = list(rng.choice(served)[:tokens])
            out.append(prompt + [rng.randrange(32_000) for _ in range(tokens - len(prompt))])
        return out

    def chains(self, blocks: int, count: int, seed: int = 5) -> list[list[int]]:
        """``count`` query chains of exactly ``blocks`` blocks (see :meth:`prompts`)."""
        spec = self.spec()
        return [block_hashes(spec, p) for p in self.prompts(blocks * BLOCK_SIZE, count, seed)]
