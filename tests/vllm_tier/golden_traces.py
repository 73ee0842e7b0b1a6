"""Golden chat traces from the vLLM release in this venv: every batch one engine
publishes during a multi-turn chat workload, with vLLM's own final state and answers.

The engine is the tier's (:mod:`tests.vllm_tier.snapshot_engine`: vLLM's config,
KV cache planning and ``Scheduler``, with the ``OffloadingConnector``'s scheduler
half and its ``CPUOffloadingManager`` and events tracker where there is a CPU tier),
stepped one request at a time by :class:`~tests.vllm_tier.stand_in.StandIn`. The
frames are the payloads vLLM's ``ZmqEventPublisher`` keeps for replay, byte for byte.
The layout is that of ``shared/fixtures/vllm-0.33.0/traces`` (its README):
``gpu_refcounts`` counts each hash's blocks in the pool, ``cpu_refcounts`` the CPU
chunks listing it, and each probe holds vLLM's GPU hit
(``find_longest_cache_hit``) and the leading whole chunks its CPU tier holds.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tests.vllm_tier.pool_truth import cached_copies
from tests.vllm_tier.snapshot_engine import (
    BLOCK,
    CHUNK_BLOCKS,
    Chats,
    CpuExecutor,
    engine_config,
    engine_ports,
    make_scheduler,
    plan_kv_cache,
)
from tests.vllm_tier.stand_in import StandIn


@dataclass(frozen=True)
class Trace:
    """One trace's engine and workload."""

    name: str
    gpu_blocks: int
    cpu_chunks: int  # 0: no CPU tier (no connector)
    self_describing: bool
    requests: int
    seed: int  # of the chats
    clear_after: int | None = None  # requests served before a ``reset_prefix_cache``
    sliding_window: int | None = None  # a second KV cache group, sliding window
    prefill_chunk: int | None = None  # tokens per prefill step (None: vLLM's default)
    probes: int = 12


TRACES = (
    Trace("chat-sha256", 160, 64, True, 120, seed=1),
    Trace("chat-gpu-only", 96, 0, True, 100, seed=2),
    Trace("chat-placeholders", 128, 48, False, 100, seed=3),
    Trace("chat-clear", 128, 48, True, 100, seed=4, clear_after=50),
    Trace(
        "hybrid-sliding",
        220,
        0,
        False,
        150,
        seed=5,
        sliding_window=64,
        prefill_chunk=128,
        probes=40,
    ),
)


class _Engine:
    """One engine of a trace, stepped on the caller's thread."""

    def __init__(self, model_dir: Any, trace: Trace) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.engine.core import EngineCore

        self.config = engine_config(
            model_dir,
            engine_ports(),
            0,
            ranks=1,
            gpu_blocks=trace.gpu_blocks,
            cpu_chunks=trace.cpu_chunks,
            self_describing=trace.self_describing,
            buffer=100_000,
            replay=False,
            prefill_chunk=trace.prefill_chunk,
        )
        executor = CpuExecutor(trace.sliding_window)
        kv_cache_config = plan_kv_cache(EngineCore.__new__(EngineCore), self.config, executor)
        self.scheduler = make_scheduler(self.config, kv_cache_config)
        self.stand_in = StandIn(self.scheduler)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.publisher = self.scheduler.kv_event_publisher
        self._published = 0
        publish = self.publisher.publish

        def counting(batch: Any) -> None:
            self._published += 1
            publish(batch)

        self.publisher.publish = counting
        self._served = 0

    def request(self, tokens: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._served += 1
        params = SamplingParams(max_tokens=1)
        return Request(str(self._served), tokens, params, None, block_hasher=self.hasher)

    def serve(self, tokens: list[int]) -> None:
        self.scheduler.add_request(self.request(tokens))
        while self.scheduler.has_requests():
            self.stand_in.step()

    def frames(self, timeout: float = 30.0) -> list[tuple[int, bytes]]:
        """Every batch published, as the publisher's thread sent it."""
        deadline = time.monotonic() + timeout
        while len(self.publisher._buffer) < self._published:
            assert time.monotonic() < deadline, "the publisher did not send every batch"
            time.sleep(0.01)
        return list(self.publisher._buffer)

    # --- vLLM's own state ----------------------------------------------------------

    def gpu_refcounts_by_group(self) -> dict[str, dict[str, int]]:
        """Per KV group, each hash's blocks in the pool."""
        from vllm.v1.core.kv_cache_utils import (
            get_block_hash,
            get_group_id,
            maybe_convert_block_hash,
        )

        groups: dict[str, dict[str, int]] = {}
        for key, n in cached_copies(self.scheduler.kv_cache_manager.block_pool).items():
            published = str(maybe_convert_block_hash(get_block_hash(key)))
            groups.setdefault(str(get_group_id(key)), {})[published] = n
        return groups

    def cpu_tier(self) -> tuple[dict[str, int], list[str]]:
        """Each hash's resident CPU chunks listing it, and the chunks' end hashes."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        from vllm.v1.kv_offload.base import get_offload_block_hash

        connector = self.scheduler.connector
        if connector is None:
            return {}, []
        scheduler = connector.connector_scheduler
        described = scheduler._events_tracker
        counts: Counter[int] = Counter()
        ends = []
        for key, chunk in scheduler.manager._policy.chunks.items():
            if not chunk.is_ready:
                continue
            end = get_offload_block_hash(key)
            meta = described._pending_event_metadata.get(key) if described else None
            hashes = meta.block_hashes if meta is not None else [end]
            counts.update(maybe_convert_block_hash(h) for h in hashes)
            ends.append(str(maybe_convert_block_hash(end)))
        return {str(h): n for h, n in counts.items()}, sorted(ends)

    def probe(self, tokens: list[int]) -> dict[str, Any]:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        from vllm.v1.kv_offload.base import make_offload_key

        hashes = list(self.request(tokens).block_hashes)
        coordinator = self.scheduler.kv_cache_manager.coordinator
        gpu = coordinator.find_longest_cache_hit(hashes, len(hashes) * BLOCK)[1]
        by_group = getattr(coordinator, "find_longest_cache_hit_per_group", None)
        cpu = 0
        if self.scheduler.connector is not None:
            chunks = self.scheduler.connector.connector_scheduler.manager._policy.chunks
            for end in range(CHUNK_BLOCKS - 1, len(hashes), CHUNK_BLOCKS):
                chunk = chunks.get(make_offload_key(hashes[end], 0))
                if chunk is None or not chunk.is_ready:
                    break
                cpu += CHUNK_BLOCKS * BLOCK
        answers = {"tokens": tokens, "gpu_tokens": gpu, "cpu_prefix_tokens": cpu}
        if by_group is not None:  # a hybrid model: each group's hit on its own too
            answers["gpu_tokens_by_group"] = list(by_group(hashes, len(hashes) * BLOCK)[1])
        return answers | {"hashes": [maybe_convert_block_hash(h) for h in hashes]}


def record(model_dir: Any, trace: Trace) -> tuple[bytes, str]:
    """``NAME.frames.msgpack`` and ``NAME.expected.json`` of ``trace``."""
    import msgspec

    engine = _Engine(model_dir, trace)
    chats = Chats(seed=trace.seed)
    prompts = []
    try:
        for n in range(trace.requests):
            if n == trace.clear_after:
                assert engine.scheduler.reset_prefix_cache()
            prompts.append(next(chats))
            engine.serve(prompts[-1])
        frames = engine.frames()
        # the last prompts, and earlier ones cut short and gone on otherwise
        rng = random.Random(trace.seed)
        asked = rng.sample(prompts[-30:], trace.probes // 2)
        for prompt in rng.sample(prompts, trace.probes // 2):
            asked.append([*prompt[: rng.randrange(BLOCK, len(prompt))], 1, 2, 3])
        cpu_refcounts, ends = engine.cpu_tier()
        by_group = engine.gpu_refcounts_by_group()
        gpu_refcounts: Counter[str] = Counter()
        for counts in by_group.values():
            gpu_refcounts.update(counts)
        expected = {
            "engine": _engine_of(trace),
            "frames": len(frames),
            "expected": {
                "gpu_refcounts": dict(gpu_refcounts),
                **({"gpu_refcounts_by_group": by_group} if trace.sliding_window else {}),
                "cpu_refcounts": cpu_refcounts,
                "cpu_chunk_end_hashes": ends,
            },
            "probes": [engine.probe(tokens) for tokens in asked],
        }
    finally:
        engine.publisher.shutdown()
    return msgspec.msgpack.encode([list(f) for f in frames]), json.dumps(expected)


def _engine_of(trace: Trace) -> dict[str, Any]:
    """The engine's configuration as the trace's ``expected.json`` states it."""
    engine: dict[str, Any] = {
        "block_size": BLOCK,
        "gpu_blocks": trace.gpu_blocks,
        "blocks_per_chunk": CHUNK_BLOCKS,
        "cpu_chunks": trace.cpu_chunks,
        "hash_algo": "sha256",
        "offload": bool(trace.cpu_chunks),
        "self_describing": trace.self_describing,
        "dp_rank": 0,
    }
    if trace.sliding_window:
        full = {"group_idx": 0, "kind": "full_attention", "sliding_window": None}
        window = {"group_idx": 1, "kind": "sliding_window", "sliding_window": trace.sliding_window}
        engine["groups"] = [g | {"block_size": BLOCK} for g in (full, window)]
        engine["prefill_chunk_tokens"] = trace.prefill_chunk
    return engine
