"""The snapshot tier's engine as configured (vLLM 0.33.0's config for each
data-parallel rank, a stand-in executor) and the chats it serves, in one place:
the pool and tier sizes are what make both the GPU and the CPU tier evict."""

from __future__ import annotations

import random

import torch
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager

from tests.servers import port_free
from tests.vllm_tier.stand_in import SAMPLED

BLOCK = 16
CHUNK_BLOCKS = 4  # offloaded chunks of 64 tokens
GPU_BLOCKS = 40
CPU_CHUNKS = 12
BUFFER = 10  # vLLM's replay buffer, in batches
OFFSET = 1000  # the plugin's stream beside vLLM's; snapshots beside it
RANKS = 2
NAME = "tier-snapshots"
MAX_PROMPT = 440  # tokens; the model's context is 512
LAYER = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 2 * CHUNK_BLOCKS  # 2 layers of K and V, fp16


def mamba_spec(block: int) -> MambaSpec:
    """A Mamba layer ("align" mode), its state padded to an attention layer's page of
    ``block`` tokens (one page size per pool)."""
    return MambaSpec(
        block_size=block,
        mamba_cache_mode="align",
        shapes=((32,),),
        dtypes=(torch.float16,),
        page_size_padded=2 * block * 2 * 16 * 2,
    )


class CpuExecutor:
    """The model executor's answers about the KV cache: two full-attention layers, or
    a full-attention and a sliding-window or Mamba ("align" mode) one (a hybrid model:
    two KV cache groups), with blocks of ``block`` tokens."""

    def __init__(
        self, sliding_window: int | None = None, mamba: bool = False, block: int = BLOCK
    ) -> None:
        self._window, self._mamba, self._block = sliding_window, mamba, block

    def get_kv_cache_specs(self):
        layer = LAYER | {"block_size": self._block}
        second = FullAttentionSpec(**layer)
        if self._window:
            second = SlidingWindowSpec(**layer, sliding_window=self._window)
        if self._mamba:
            second = mamba_spec(self._block)
        return [{"model.layers.0.self_attn.attn": FullAttentionSpec(**layer),
                 "model.layers.1.self_attn.attn": second}]  # fmt: skip

    def get_supported_kv_cache_layouts(self):
        return [["LBNHC"]]

    def set_kv_cache_layout(self, name, interleave):
        pass

    def determine_available_memory(self):
        return [64 << 20]

    def initialize_from_config(self, configs):
        pass

    def compile_or_warm_up_model(self):
        pass


def engine_ports() -> int:
    """A base port B with vLLM's events at B + r, its replay at B + 2 + r, the plugin's
    at + 1000 and its snapshots at + 2000 all free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        if all(
            port_free(base + o + i, "0.0.0.0") for o in (0, OFFSET, 2 * OFFSET) for i in range(4)
        ):
            return base
    raise RuntimeError("no free ports")


def engine_config(
    model_dir,
    base: int,
    rank: int,
    *,
    ranks: int = RANKS,
    gpu_blocks: int = GPU_BLOCKS,
    cpu_chunks: int = CPU_CHUNKS,
    self_describing: bool = True,
    buffer: int = BUFFER,
    replay: bool = True,
    prefill_chunk: int | None = None,
    mamba: bool = False,
    speculative_config: dict | None = None,
    block: int = BLOCK,
):
    """vLLM's config as ``vllm serve`` builds it for data-parallel rank ``rank``: events
    at ``base`` (replay at ``base + 2``), a CPU tier of ``cpu_chunks`` chunks through
    the ``OffloadingConnector`` (none: no connector), prefills chunked at
    ``prefill_chunk`` tokens (None: vLLM's default); ``mamba``: Mamba states cached
    in "align" mode (``--mamba-cache-mode align``; the model's second layer is one);
    ``speculative_config``: drafting (``--speculative-config``); ``block``: the KV cache
    blocks' tokens, hashed every ``BLOCK`` tokens (``--prefix-match-unit``) when larger,
    each block then a chunk of its own."""
    transfer = None
    if cpu_chunks:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "block_size": max(block, BLOCK * CHUNK_BLOCKS),
                "cpu_bytes_to_use": cpu_chunks * CHUNK_BYTES,
                "self_describing_kv_events": self_describing,
            },
        )
    config = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,  # nothing here tokenizes
        served_model_name=["tiny-llama"],
        block_size=block,
        prefix_match_unit=BLOCK if block != BLOCK else None,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
        max_model_len=512,
        num_gpu_blocks_override=gpu_blocks,
        data_parallel_size=ranks,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{base}",
            replay_endpoint=f"tcp://*:{base + 2}" if replay else None,
            buffer_steps=buffer,
            topic="kv@tier",
        ),
        kv_transfer_config=transfer,
        speculative_config=speculative_config,
        **({"max_num_batched_tokens": prefill_chunk} if prefill_chunk else {}),
    ).create_engine_config()
    if mamba:  # set past the check that the model has Mamba layers (the executor's has)
        config.cache_config.mamba_cache_mode = "align"
    # what the rank's own engine core process is started with
    config.parallel_config.data_parallel_rank = rank
    config.parallel_config.data_parallel_index = rank
    return config


def plan_kv_cache(core, config, executor: CpuExecutor | None = None):
    """vLLM's KV cache planning for ``core`` (an engine core made with ``__new__``: the
    parts of its start the tier needs), without the plugin's wrapper (which announces);
    its ``kv_cache_config``."""
    core.vllm_config = config
    core.model_executor = executor or CpuExecutor()
    core.available_gpu_memory_for_kv_cache = -1
    init = EngineCore._initialize_kv_caches
    return getattr(init, "__wrapped__", init)(core, config)


def make_scheduler(config, kv_cache_config):
    """vLLM's scheduler over the planned KV cache (it creates vLLM's event publisher)."""
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        include_finished_set=True,
    )


class Chats:
    """Multi-turn chats over a few system prompts shared by every rank, and now and
    then a system prompt alone: block-aligned and cached, vLLM recomputes its last
    block (a hit stops a token short of the prompt), a second physical copy."""

    SYSTEM = [[random.Random(n).randrange(1, 4000) for _ in range(size)] for n, size in
              enumerate((96, 64, 128))]  # fmt: skip

    def __init__(self, seed: int, chats: int = 6) -> None:
        self._rng = random.Random(seed)
        self._histories: list[list[int]] = [[] for _ in range(chats)]

    def __next__(self) -> list[int]:
        i = self._rng.randrange(len(self._histories))
        system = self.SYSTEM[i % len(self.SYSTEM)]
        if self._rng.random() < 0.1:
            return list(system)
        history = self._histories[i]
        turn = [self._rng.randrange(1, 4000) for _ in range(self._rng.randrange(12, 60))]
        if len(system) + len(history) + len(turn) > MAX_PROMPT:
            history.clear()  # a new chat
        prompt = system + history + turn
        history.extend([*turn, SAMPLED])  # the next turn holds this one and its answer
        return prompt
