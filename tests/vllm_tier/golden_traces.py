"""Golden traces from the vLLM release in this venv: every batch one engine publishes
during a multi-turn chat workload, with vLLM's own final state and answers.

The engine is the tier's (:mod:`tests.vllm_tier.snapshot_engine`: vLLM's config,
KV cache planning and ``Scheduler``, with the ``OffloadingConnector``'s scheduler
half and its ``CPUOffloadingManager`` and events tracker where there is a CPU tier),
stepped one request at a time by :class:`~tests.vllm_tier.stand_in.StandIn`. The
frames are the payloads vLLM's ``ZmqEventPublisher`` keeps for replay, byte for byte.
The layout is that of ``shared/fixtures/vllm-0.33.0/traces`` (its README):
``gpu_refcounts`` counts each hash's blocks in the pool, ``cpu_refcounts`` the CPU
chunks listing it, and each probe holds vLLM's GPU hit (``find_longest_cache_hit``)
and what the connector's own lookup finds on the CPU tier: from token 0
(``cpu_prefix_tokens``) and, added to the GPU hit, after it (``prefix_tokens``).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tests.vllm_tier.golden_storage import (
    add_storage_tier,
    answering,
    settle,
    settle_io,
    shut_down,
    storage_refcounts,
)
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
from tests.vllm_tier.stand_in import SAMPLED, StandIn


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
    mamba: bool = False  # a second KV cache group, Mamba in "align" mode
    eagle: bool = False  # EAGLE drafting: vLLM hashes with lookahead where it can
    prefill_chunk: int | None = None  # tokens per prefill step (None: vLLM's default)
    probes: int = 12
    #: tokens per KV cache block, hashed every BLOCK (``--prefix-match-unit``) when
    #: larger, one block per CPU chunk: vLLM then stores and loads partial tails
    block: int = BLOCK
    storage: bool = False  # a storage tier below the CPU's (:mod:`.golden_storage`)


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
    Trace("hybrid-mamba", 240, 0, False, 240, seed=6, mamba=True, prefill_chunk=128, probes=40),
    Trace("mamba-offload", 200, 48, True, 200, seed=7, mamba=True, prefill_chunk=128, probes=40),
    Trace("eagle-offload", 64, 48, True, 120, seed=8, eagle=True, probes=40),
    Trace(
        "mamba-partial-tail",
        60,
        40,
        True,
        80,
        seed=9,
        mamba=True,
        prefill_chunk=128,
        probes=40,
        block=4 * BLOCK,
    ),
    Trace("storage-context", 64, 16, True, 120, seed=10, probes=40, storage=True),
)


class Engine:
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
            mamba=trace.mamba,
            speculative_config=_drafter(model_dir) if trace.eagle else None,
            block=trace.block,
        )
        if trace.storage:
            add_storage_tier(self.config, Path(model_dir) / trace.name)
        self.storage = trace.storage
        #: tokens after a block that its hash covers (vLLM resolves it from the drafter
        #: and the connector)
        self.lookahead = self.config.num_hash_lookahead_tokens
        executor = CpuExecutor(trace.sliding_window, trace.mamba, trace.block)
        kv_cache_config = plan_kv_cache(EngineCore.__new__(EngineCore), self.config, executor)
        self.kv_cache_config = kv_cache_config
        self.scheduler = make_scheduler(self.config, kv_cache_config)
        self.stand_in = StandIn(self.scheduler)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn, self.lookahead)
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
            if self.storage:
                settle_io(self.scheduler)
            self.stand_in.step()
        if self.storage:
            settle(self.stand_in, self.scheduler)

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
        cpu = getattr(scheduler.manager, "primary_tier", scheduler.manager)
        for key, chunk in cpu._policy.chunks.items():
            if not chunk.is_ready:
                continue
            end = get_offload_block_hash(key)
            meta = described._pending_event_metadata.get(key) if described else None
            hashes = meta.block_hashes if meta is not None else [end]
            counts.update(maybe_convert_block_hash(h) for h in hashes)
            ends.append(str(maybe_convert_block_hash(end)))
        return {str(h): n for h, n in counts.items()}, sorted(ends)

    def storage_state(self, prompts: list[list[int]]) -> dict[str, Any]:
        """What the storage tier holds (nothing without one)."""
        if not self.storage:
            return {}
        hashes = [self.request(p).block_hashes for p in prompts]
        return {"storage_refcounts": storage_refcounts(self.scheduler, hashes)}

    def probe(self, tokens: list[int]) -> dict[str, Any]:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(self.request(tokens).block_hashes)
        coordinator = self.scheduler.kv_cache_manager.coordinator
        gpu = coordinator.find_longest_cache_hit(hashes, len(hashes) * BLOCK)[1]
        by_group = getattr(coordinator, "find_longest_cache_hit_per_group", None)
        blocks = tokens[: len(hashes) * BLOCK + self.lookahead]
        if self.storage:  # each tier on its own from token 0, both after the GPU hit
            with answering(self.scheduler, storage=False):
                answers = {"cpu_prefix_tokens": self.load(blocks, 0)}
            with answering(self.scheduler, cpu=False):
                answers["storage_prefix_tokens"] = self.load(blocks, 0)
            with answering(self.scheduler):
                answers["prefix_tokens"] = gpu + self.load(blocks, gpu)
        else:
            answers = {"cpu_prefix_tokens": self.load(blocks, 0)}
            if self.scheduler.connector is not None:  # and what it loads after its GPU hit
                answers["prefix_tokens"] = gpu + self.load(blocks, gpu)
        answers = {"tokens": tokens, "gpu_tokens": gpu} | answers
        if by_group is not None:  # a hybrid model: each group's hit on its own too
            answers["gpu_tokens_by_group"] = list(by_group(hashes, len(hashes) * BLOCK)[1])
        return answers | {"hashes": [maybe_convert_block_hash(h) for h in hashes]}

    def load(self, blocks: list[int], computed: int) -> int:
        """The tokens of whole blocks ``blocks`` (and the lookahead after them) past the
        first ``computed`` that vLLM's own lookup would load from its CPU tier (the
        ``OffloadingConnector``'s, over every KV group); 0 with no CPU tier."""
        if self.scheduler.connector is None:
            return 0
        offload = self.scheduler.connector.connector_scheduler
        # and one token more: vLLM computes a prompt's last token, so its lookup then
        # reaches as far as the blocks' hashes do
        request = self.request([*blocks, SAMPLED])
        offload.on_new_request(request)
        try:
            hit, _ = offload.get_num_new_matched_tokens(request, computed)
        finally:
            offload._release_step()  # schedule() releases it after each step
            offload._req_status.pop(request.request_id)
        assert hit is not None, "a lookup deferred: a store still in flight"
        return hit


def record(model_dir: Any, trace: Trace, engine: Engine | None = None) -> tuple[bytes, str]:
    """``NAME.frames.msgpack`` and ``NAME.expected.json`` of ``trace`` (``engine``: the
    trace's engine made already, whose config a test reads too)."""
    import msgspec

    engine = engine or Engine(model_dir, trace)
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
            "engine": _engine_of(trace, engine.lookahead),
            "frames": len(frames),
            "expected": {
                "gpu_refcounts": dict(gpu_refcounts),
                **({"gpu_refcounts_by_group": by_group} if _hybrid(trace) else {}),
                "cpu_refcounts": cpu_refcounts,
                "cpu_chunk_end_hashes": ends,
                **engine.storage_state(prompts),
            },
            "probes": [engine.probe(tokens) for tokens in asked],
        }
    finally:
        engine.publisher.shutdown()
        if engine.storage:
            shut_down(engine.scheduler)
    return msgspec.msgpack.encode([list(f) for f in frames]), json.dumps(expected)


def _engine_of(trace: Trace, lookahead: int) -> dict[str, Any]:
    """The engine's configuration as the trace's ``expected.json`` states it."""
    engine: dict[str, Any] = {
        "block_size": BLOCK,
        "gpu_blocks": trace.gpu_blocks,
        "blocks_per_chunk": max(1, CHUNK_BLOCKS * BLOCK // trace.block),
        "cpu_chunks": trace.cpu_chunks,
        "hash_algo": "sha256",
        "offload": bool(trace.cpu_chunks),
        "self_describing": trace.self_describing,
        "dp_rank": 0,
        "release": version("vllm"),  # the rules that changed between releases follow it
    }
    if trace.eagle:
        engine["lookahead_tokens"] = lookahead
    if trace.storage:
        engine["storage"] = "fs"
    if _hybrid(trace):
        full = {"group_idx": 0, "kind": "full_attention", "sliding_window": None}
        second = {"group_idx": 1, "kind": "sliding_window", "sliding_window": trace.sliding_window}
        if trace.mamba:
            second = {"group_idx": 1, "kind": "mamba", "sliding_window": None}
            second["mamba_cache_mode"] = "align"
        engine["groups"] = [g | {"block_size": trace.block} for g in (full, second)]
        engine["prefill_chunk_tokens"] = trace.prefill_chunk
    return engine


def _drafter(model_dir: Any) -> dict[str, Any]:
    """An EAGLE drafter of one layer beside the model (a config only, as the model)."""
    from pathlib import Path

    from tests.vllm_tier.conftest import TINY_LLAMA

    folder = Path(model_dir) / "drafter"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA | {"num_hidden_layers": 1}))
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": 2}


def _hybrid(trace: Trace) -> bool:
    return bool(trace.sliding_window) or trace.mamba
