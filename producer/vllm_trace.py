"""A single-engine trace at vLLM's granularity, for whole-process ingest figures.

vLLM publishes one ``BlockStored`` per request per scheduler step (the
blocks that request filled in that step) and one ``BlockRemoved`` per
evicted block, taken from the head of an LRU free queue; the simulated
engine keeps exactly those rules. Here one engine with a GPU pool only
(no offload tier) serves the long-context chat workload, a queue always
waiting so the pool stays under eviction pressure, until the trace holds
the asked number of block operations. The result is the replay fixtures'
format (``[[seq, payload], ...]``), so ``kvindex replay`` reads it as is.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from indexer.engines import catalog
from producer.sim import SimConfig, SimEngine
from producer.workload import Workload, WorkloadConfig


def long_chat(seed: int, max_context_tokens: int = 24_576) -> WorkloadConfig:
    """Chat with long pasted documents (1k-8k-token system prompts, 128-2k-token user
    turns, up to a dozen turns): prefills store hundreds of blocks at once, decodes
    one block per running request per step. The trace and the benchmarks' fleet
    run it, each with its own ``seed``."""
    return WorkloadConfig(
        seed=seed,
        system_prompts=16,
        system_prompt_tokens=(1024, 8192),
        user_tokens=(128, 2048),
        output_tokens=(32, 512),
        max_turns=12,
        max_context_tokens=max_context_tokens,
        active_conversations=8,
        new_conversation_prob=0.25,
    )


#: The trace's workload.
CHAT = long_chat(seed=13)
#: The trace is vLLM's: its payloads are encoded as vLLM's adapter encodes them.
VLLM = catalog.adapter("vllm")
ENGINE = SimConfig(
    block_size=16, gpu_blocks=8192, cpu_chunks=0, max_running=16, decode_tokens_per_step=16
)


def generate(block_ops: int, stream: int = 0) -> tuple[list[tuple[int, bytes]], int]:
    """``(trace, block operations in it)``: batches until at least ``block_ops``."""
    engine = SimEngine(ENGINE, clock=lambda: 0.0)
    requests = Workload(CHAT, stream=stream)
    trace: list[tuple[int, bytes]] = []
    ops = 0
    while ops < block_ops:
        while len(engine._waiting) < 2:  # a queue always waits: the pool keeps evicting
            request = next(requests)
            engine.submit(request.prompt, request.output)
        batch = engine.step()
        if batch is None:
            continue
        ops += sum(len(event.block_hashes) for event in batch.events)
        trace.append((len(trace), VLLM.encode(batch)))
    return trace, ops


def write(path: Path, trace: list[tuple[int, bytes]]) -> None:
    path.write_bytes(msgspec.msgpack.encode(trace))
