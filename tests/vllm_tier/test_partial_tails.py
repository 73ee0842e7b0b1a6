"""A hybrid Mamba engine whose KV blocks span several hash blocks, as the plugin announces
it, answers in kvindex as vLLM's own engine does.

vLLM's engine parts record the ``mamba-partial-tail`` trace of this release (blocks of
64 tokens hashed every 16, one block per CPU chunk: partial entries on the GPU, partial
tails on the CPU, as :mod:`tests.vllm_tier.golden_traces` records them); the plugin's
announcement of that engine registers it in kvindex (before, refused: "one block size
only"); every probe's GPU hit and CPU lookups are then vLLM's, by tokens and by hashes.
"""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import version

import msgspec

from indexer.core.events import RankId
from indexer.core.large_blocks import LargeBlocks
from indexer.engine_registry import EngineSpec
from indexer.ingest.trace import load_trace
from producer.vllm_plugin.settings import PluginSettings
from producer.vllm_plugin.spec import announcement
from tests.api_cases import check_probes
from tests.apikit import Api
from tests.vllm_tier.golden_traces import TRACES, Engine, record


def test_the_plugins_partial_tail_engine_answers_like_vllm(model_dir, tmp_path) -> None:
    (trace,) = [t for t in TRACES if t.name == "mamba-partial-tail"]
    engine = Engine(model_dir, trace)
    body = announcement(engine.config, engine.kv_cache_config, PluginSettings()).spec
    spec = msgspec.convert({**body, "name": "vllm-a"}, EngineSpec)
    assert spec.release == version("vllm")
    anchored = not version("vllm").startswith("0.33.")
    assert spec.large_blocks == LargeBlocks(4, 1, (0,), (1,), anchored)
    frames, expected = record(model_dir, trace, engine)
    path = tmp_path / "t.frames.msgpack"
    path.write_bytes(frames)
    probes = json.loads(expected)["probes"]
    assert sum(p["cpu_prefix_tokens"] % 64 != 0 for p in probes) >= 5  # tails were loaded

    async def check() -> None:
        api = Api()
        try:
            await api.add(spec)
            await api.consumers.apply_trace(RankId("vllm-a", 0), load_trace(path))
            await check_probes(api, probes)
        finally:
            await api.close()

    asyncio.run(check())
