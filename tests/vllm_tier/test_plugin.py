"""kvindex's plugin inside vLLM 0.33.0: what kvindex registers is the engine's config.

The engine core is vLLM's own ``EngineCore`` class with the plugin's wrapper,
loaded by ``load_general_plugins``; ``_initialize_kv_caches`` runs vLLM's real KV
cache planning (grouping the layers' specs, sizing blocks, resolving the hash
block size). Only the model executor is a CPU stand-in: it reports the layers'
KV cache specs (vLLM's own spec classes) and a memory budget, where a GPU worker
would profile a loaded model.
"""

from __future__ import annotations

import json
import time
from importlib.metadata import entry_points

import httpx
import pytest
import torch
import vllm
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm_tier.conftest import TINY_LLAMA, TOKEN, TOKENIZER, free_port

pytestmark = pytest.mark.usefixtures("plugins")

WINDOW = 128


class CpuExecutor:
    """The model executor's answers about the KV cache, for two layers: one full
    attention, one sliding window (a hybrid model: two KV cache groups)."""

    def __init__(self, block_size: int) -> None:
        shape = {
            "block_size": block_size,
            "num_kv_heads": 2,
            "head_size": 16,
            "dtype": torch.float16,
        }
        self.specs = {
            "model.layers.0.self_attn.attn": FullAttentionSpec(**shape),
            "model.layers.1.self_attn.attn": SlidingWindowSpec(**shape, sliding_window=WINDOW),
        }
        self.shut = False

    def get_kv_cache_specs(self):
        return [self.specs]

    def get_supported_kv_cache_layouts(self):
        return [["LBNHC"]]

    def set_kv_cache_layout(self, name, interleave):
        self.layout = name

    def determine_available_memory(self):
        return [64 << 20]

    def initialize_from_config(self, configs):
        self.configs = configs

    def compile_or_warm_up_model(self):
        pass

    def shutdown(self):
        self.shut = True


def engine_config(model_dir, **overrides):
    """vLLM's config as ``vllm serve`` builds it from these flags."""
    port = free_port()
    fields = {
        "model": str(model_dir),
        "tokenizer": str(TOKENIZER),
        "served_model_name": ["tiny-llama"],
        "block_size": 16,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256_cbor",
        "max_model_len": 2048,
        "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{port + 1}",
            topic="kv@tiny",
        ),
    }
    return EngineArgs(**(fields | overrides)).create_engine_config()


def start_engine_core(vllm_config) -> EngineCore:
    """The engine core's start as far as the plugin sees it: the KV cache set up by
    the (wrapped) ``_initialize_kv_caches``."""
    core = EngineCore.__new__(EngineCore)
    core.vllm_config = vllm_config
    core.model_executor = CpuExecutor(vllm_config.cache_config.block_size)
    core.available_gpu_memory_for_kv_cache = -1
    core.structured_output_manager = StructuredOutputManager(vllm_config)
    core.scheduler = None
    core.kv_cache_config = core._initialize_kv_caches(vllm_config)
    return core


def beside(endpoint: str) -> str:
    """Where the plugin's report-free stream is announced beside a vLLM endpoint."""
    host, port = endpoint.replace("*", "127.0.0.1").rsplit(":", 1)
    return f"{host}:{int(port) + 1000}"


def registered(serve, name: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while (answer := serve.engine(name)).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)
    return answer.json()


def test_the_plugin_is_loaded_through_vllms_entry_points():
    found = entry_points(group="vllm.general_plugins")
    assert [e.value for e in found if e.name == "kvindex"] == ["producer.vllm_plugin:register"]
    assert EngineCore._initialize_kv_caches._kvindex is True
    assert EngineCore.shutdown.__wrapped__ is not None


def test_kvindex_registers_the_engines_real_config(serve, model_dir, monkeypatch):
    monkeypatch.setenv("KVINDEX_ANNOUNCE_TOKEN", TOKEN)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-hybrid")
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    config = engine_config(
        model_dir,
        data_parallel_size=2,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"block_size": 64, "cpu_bytes_to_use": 1 << 20},
        ),
    )
    core = start_engine_core(config)
    engine = registered(serve, "tier-hybrid")

    events = config.kv_events_config
    groups = core.kv_cache_config.kv_cache_groups
    assert engine["model"] == "tiny-llama" == config.model_config.served_model_name
    assert engine["block_size"] == config.cache_config.block_size == 16
    assert engine["block_size"] == core.kv_cache_config.hash_block_size
    assert engine["hash_algo"] == config.cache_config.prefix_caching_hash_algo == "sha256_cbor"
    assert engine["hash_seed"] == "4242"  # read with the token
    assert httpx.get(f"{serve.url}/engines/tier-hybrid").json()["hash_seed"] is None
    assert engine["lookahead_tokens"] == config.num_hash_lookahead_tokens == 0  # a KV connector
    assert engine["dp_ranks"] == config.parallel_config.data_parallel_size == 2
    assert engine["gpu_blocks"] == core.kv_cache_config.num_blocks  # bounds a rank's GPU blocks
    assert engine["release"] == vllm.__version__  # rules that changed between releases follow it
    # the plugin's stream without reuse reports, beside vLLM's (ports + 1000)
    assert engine["reuse_reports"] == "filtered"
    assert engine["endpoint"] == beside(events.endpoint)
    assert engine["replay_endpoint"] == beside(events.replay_endpoint)
    assert engine["topic"] == events.topic
    assert engine["bind"] is False
    # 64 offloaded tokens a chunk over 16-token blocks
    assert engine["blocks_per_chunk"] == 4
    assert [(g["kind"], g["sliding_window"]) for g in engine["kv_groups"]] == [
        ("full_attention", None),
        ("sliding_window", WINDOW),
    ]
    assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, SlidingWindowSpec]
    assert engine["lease"]["instance"]

    core.shutdown()
    assert core.model_executor.shut
    assert serve.engine("tier-hybrid").status_code == 404


def test_with_reports_unfiltered_kvindex_reads_vllms_stream_capped(serve, model_dir, monkeypatch):
    monkeypatch.setenv("KVINDEX_ANNOUNCE_TOKEN", TOKEN)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-capped")
    monkeypatch.setenv("KVINDEX_FILTER_REPORTS", "false")
    config = engine_config(model_dir)
    core = start_engine_core(config)
    engine = registered(serve, "tier-capped")
    assert engine["reuse_reports"] == "capped"
    assert engine["endpoint"] == config.kv_events_config.endpoint.replace("*", "127.0.0.1")
    core.shutdown()


def test_an_eagle_engine_announces_its_lookahead_hashing(serve, model_dir, tmp_path, monkeypatch):
    """EAGLE drafting that drops blocks, prefix caching on and no KV connector: vLLM
    hashes each block over the token after it, and kvindex is told so."""
    monkeypatch.setenv("KVINDEX_ANNOUNCE_TOKEN", TOKEN)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-eagle")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA | {"num_hidden_layers": 1}))
    drafter = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2}
    config = engine_config(model_dir, speculative_config=drafter)
    core = start_engine_core(config)
    engine = registered(serve, "tier-eagle")
    assert config.speculative_config.use_eagle_block_drop()
    assert engine["lookahead_tokens"] == config.num_hash_lookahead_tokens == 1
    core.shutdown()


def test_an_eagle_engine_offloading_to_the_cpu_announces_what_vllm_hashes(
    serve, model_dir, tmp_path, monkeypatch
):
    """With a KV connector vLLM 0.33 never hashes with lookahead; 0.34 does where the
    connector says it supports it (the OffloadingConnector does). kvindex is told what
    the release does: the lookahead its config resolved, which its connector decides."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setenv("KVINDEX_ANNOUNCE_TOKEN", TOKEN)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-eagle-offload")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA | {"num_hidden_layers": 1}))
    drafter = {"method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 2}
    offload = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"block_size": 64, "cpu_bytes_to_use": 1 << 20},
    )
    config = engine_config(model_dir, speculative_config=drafter, kv_transfer_config=offload)
    connector = KVConnectorFactory.get_connector_class(offload)
    supports = getattr(connector, "supports_lookahead_block_hashes", None)
    lookahead = 1 if supports is not None and supports(offload) else 0
    core = start_engine_core(config)
    engine = registered(serve, "tier-eagle-offload")
    assert engine["lookahead_tokens"] == config.num_hash_lookahead_tokens == lookahead
    assert engine["blocks_per_chunk"] == 4
    core.shutdown()


def test_without_a_token_kvindex_learns_only_that_a_seed_is_in_force(
    open_serve, model_dir, monkeypatch
):
    monkeypatch.setenv("KVINDEX_ANNOUNCE_URL", open_serve.url)
    monkeypatch.delenv("KVINDEX_ANNOUNCE_TOKEN", raising=False)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-seeded")
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    core = start_engine_core(engine_config(model_dir, prefix_caching_hash_algo="sha256"))
    engine = registered(open_serve, "tier-seeded")
    assert engine["hash_seed"] is None
    assert engine["hash_algo"] is None  # its hashes cannot be recomputed: learned matching
    assert [g["kind"] for g in engine["kv_groups"]] == ["full_attention", "sliding_window"]
    core.shutdown()


def test_xxhash_without_pythonhashseed_is_seeded_at_random(open_serve, model_dir, monkeypatch):
    """vLLM draws a random per-process seed for the xxhash algorithms when
    PYTHONHASHSEED is unset: a seed kvindex cannot be told, so it is "seeded"."""
    monkeypatch.setenv("KVINDEX_ANNOUNCE_URL", open_serve.url)
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-xxhash")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    core = start_engine_core(engine_config(model_dir, prefix_caching_hash_algo="xxhash"))
    engine = registered(open_serve, "tier-xxhash")
    assert (engine["hash_algo"], engine["hash_seed"]) == (None, None)
    core.shutdown()


def test_an_engine_without_kv_events_is_not_announced(serve, model_dir, monkeypatch):
    monkeypatch.setenv("KVINDEX_ENGINE_NAME", "tier-silent")
    core = start_engine_core(engine_config(model_dir, kv_events_config=None))
    assert core.kv_cache_config.kv_cache_groups  # the engine itself started
    time.sleep(1.0)
    assert serve.engine("tier-silent").status_code == 404
    core.shutdown()
