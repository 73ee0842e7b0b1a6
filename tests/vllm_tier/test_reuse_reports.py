"""Reuse reports through vLLM 0.33.0's own KV cache manager and publisher.

A request with ``kv_cache_report_mode: full`` makes vLLM's ``KVCacheManager``
re-announce the prefix blocks it reused as ``BlockStored`` events shaped like
new copies. kvindex's plugin marks them where the block pool makes them and
publishes every batch again without them, beside vLLM's stream (ports + 1000);
vLLM's own stream is left as it was. Each stream is read back from its replay
socket and applied by kvindex's residency rules, then compared with what vLLM's
block pool really caches.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from indexer.core.events import GPU
from indexer.core.residency import RankResidency, Tier, plan_batch
from indexer.engines import catalog
from producer.vllm_plugin.reports import install
from producer.vllm_plugin.settings import PluginSettings
from tests.vllm_tier.conftest import free_port

BLOCK = 16
OFFSET = 1000
ADAPTER = catalog.adapter(catalog.DEFAULT)


class Engine:
    """vLLM's KV cache manager (one full-attention group of 10 blocks) publishing
    each scheduler step's events through vLLM's zmq publisher."""

    def __init__(self) -> None:
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16
        )
        config = KVCacheConfig(11, [], [KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(
            config, 512, BLOCK, BLOCK, enable_caching=True, enable_kv_cache_events=True
        )
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.replay = free_port()
        self.publisher = ZmqEventPublisher(
            0, f"tcp://*:{free_port()}", f"tcp://*:{self.replay}", topic="kv"
        )
        self.steps = 0

    def serve(self, tokens: list[int], report: bool = False) -> int:
        """Schedule one request to the end of its prompt and finish it; its hit in tokens."""
        extra = {"kv_cache_report_mode": "full"} if report else None
        params = SamplingParams(max_tokens=1, extra_args=extra)
        request = Request(str(self.steps), tokens, params, None, block_hasher=self.hasher)
        blocks, hit, *_ = self.manager.get_computed_blocks(request)
        self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        self.manager.free(request)
        self.publisher.publish(KVEventBatch(float(self.steps), self.manager.take_events()))
        self.steps += 1
        return hit

    def cached(self) -> set[int]:
        """The hashes vLLM's block pool holds in its prefix cache, as it publishes them."""
        keys = self.manager.block_pool.cached_block_hash_to_block._cache
        return {maybe_convert_block_hash(get_block_hash(key)) for key in keys}


def replayed(port: int, batches: int) -> list[bytes]:
    """Every buffered payload of a replay socket, in seq order."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)  # nobody at the port: fail, not hang at exit
        dealer.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while True:
            dealer.send_multipart(ADAPTER.replay_request(0))
            payloads = []
            while dealer.poll(2000):
                seq, payload = ADAPTER.split_replay(dealer.recv_multipart())
                if seq is None:
                    break
                payloads.append(payload)
            if len(payloads) == batches or time.monotonic() > deadline:
                return payloads
            time.sleep(0.1)  # the publisher's thread has not sent them all yet


def gpu_resident(payloads: list[bytes], hold_gpu: bool) -> dict[int, int]:
    """kvindex's GPU counts after a stream."""
    state = RankResidency()
    for payload in payloads:
        state.apply(plan_batch(ADAPTER.decode(payload), hold_gpu=hold_gpu))
    table = state.tables.get(Tier(GPU, None, 0))
    return dict(table.counts) if table else {}


@pytest.fixture
def engine():
    install(PluginSettings(events_port_offset=OFFSET))
    made = Engine()
    yield made
    made.publisher.shutdown()


def test_reports_are_left_out_of_kvindexs_stream_and_only_there(engine):
    prompt = list(range(100, 100 + 4 * BLOCK + 1))
    assert engine.serve(prompt) == 0
    for _ in range(4):  # four reused turns, each reported
        assert engine.serve(prompt, report=True) == 4 * BLOCK
    engine.serve(list(range(1000, 1000 + 10 * BLOCK)))  # evicts the whole prefix
    vllms = replayed(engine.replay, 6)
    kvindexs = replayed(engine.replay + OFFSET, 6)

    stored = [len(ADAPTER.decode(p).events) for p in vllms]
    assert stored[1:5] == [1, 1, 1, 1], "vLLM's stream carries each turn's report"
    assert [len(ADAPTER.decode(p).events) for p in kvindexs][1:5] == [0, 0, 0, 0]
    assert [vllms[0], vllms[5]] == [kvindexs[0], kvindexs[5]], "other batches byte for byte"

    truth = engine.cached()
    assert not truth & set(ADAPTER.decode(vllms[0]).events[0].block_hashes)
    assert set(gpu_resident(kvindexs, hold_gpu=False)) == truth
    assert set(gpu_resident(vllms, hold_gpu=True)) == truth, "capped: no phantom"
    phantoms = set(gpu_resident(vllms, hold_gpu=False)) - truth
    assert len(phantoms) == 4, "counting vLLM's reports as copies leaves the prefix behind"
