"""An engine started without ``--block-size``, registered by hand without one: kvindex
learns the size from its events and matches chat ``messages`` on it exactly.

vLLM's default block size is a fact of the release (16 in 0.33, 64 in 0.34, and the
attention backend may choose another); nothing here names it. The engine's config is
vLLM's own (``EngineArgs`` without ``block_size``), its KV cache planning and hash
block size vLLM's (``_initialize_kv_caches``, ``resolve_kv_cache_block_sizes``), its
prefix cache vLLM's ``KVCacheManager`` publishing through vLLM's ``ZmqEventPublisher``.
The prompt is a golden chat case's token ids as vLLM's OpenAI server rendered them; the
engine caches only its first part, so the answer is a prefix that vLLM's own
``find_longest_cache_hit`` gives.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.request import Request

from tests.vllm_tier.conftest import TOKEN, TOKENIZER, Serve, free_port
from tests.vllm_tier.test_plugin import engine_config, start_engine_core

pytestmark = pytest.mark.usefixtures("plugins")  # as every engine of the tier: loaded first

CASES = TOKENIZER.parent / "cases.json"
NAME = "unsized"
MODEL = "tiny-llama"
CACHED_TOKENS = 1000  # of the chat's 1531: the engine holds this part's full blocks


@pytest.fixture
def serve_with_tokenizer(tmp_path):
    """``kvindex serve`` that renders ``messages`` for the tier's model."""
    config = tmp_path / "kvindex.yaml"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(TOKENIZER)}}}))
    server = Serve(tmp_path, TOKEN, "--config", str(config))
    yield server
    server.stop()


def _chat_case() -> dict:
    cases = json.loads(CASES.read_text())["cases"]
    wanted = ("llama3ish", "chat_long_multi_turn")
    [case] = [c for c in cases if (c["tokenizer"], c["name"]) == wanted]
    return case


def test_an_unsized_engine_is_matched_by_messages_at_the_size_its_events_say(
    model_dir, serve_with_tokenizer
) -> None:
    config = engine_config(model_dir, block_size=None, prefix_caching_hash_algo="sha256")
    assert not config.cache_config.user_specified_block_size
    core = start_engine_core(config)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(core.kv_cache_config, config)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    manager = KVCacheManager(
        core.kv_cache_config,
        config.model_config.max_model_len,
        block_size,
        hash_block_size,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    port, replay = free_port(), free_port()
    publisher = ZmqEventPublisher(0, f"tcp://*:{port}", f"tcp://*:{replay}", topic="kv")
    http = httpx.Client(  # the first messages query loads the tokenizer: give it time
        base_url=serve_with_tokenizer.url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    try:
        spec = {
            "name": NAME,
            "model": MODEL,
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv",
        }
        assert http.post("/engines", json=spec).status_code == 201
        case = _chat_case()
        tokens = case["token_ids"]
        served = Request("cached", tokens[:CACHED_TOKENS], SamplingParams(max_tokens=1), None,
                         block_hasher=hasher)  # fmt: skip
        blocks, hit, *_ = manager.get_computed_blocks(served)
        manager.allocate_slots(served, served.num_tokens - hit, hit, blocks)
        manager.free(served)
        publisher.publish(KVEventBatch(time.time(), manager.take_events()))

        asked = Request("asked", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        coordinator = manager.coordinator
        want = coordinator.find_longest_cache_hit(asked.block_hashes, len(tokens))[1]
        assert 0 < want < len(tokens) - block_size, "a prefix, not the whole prompt"

        engine = _learned(http, hash_block_size)
        assert engine["misdeclared"] == [], engine
        body = {"model": MODEL, "messages": case["request"]["messages"], "engines": [NAME]}
        body |= {k: v for k, v in case["request"].items() if k not in ("messages", "model")}
        answer = http.post("/prefix-match", json=body)
        assert answer.status_code == 200, answer.text
        [row] = answer.json()["engines"]
        assert row["gpu_blocks"] * hash_block_size == want, (row, want)
    finally:
        http.close()
        publisher.shutdown()


def _learned(http: httpx.Client, size: int, timeout: float = 20.0) -> dict:
    """The engine's status once kvindex learned its block size (``size``, vLLM's)."""
    deadline = time.monotonic() + timeout
    while True:
        engine = http.get(f"/engines/{NAME}").json()
        if engine.get("learned_block_size") is not None:
            assert engine["learned_block_size"] == size, engine
            return engine
        assert time.monotonic() < deadline, engine
        time.sleep(0.05)
