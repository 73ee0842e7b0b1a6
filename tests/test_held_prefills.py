"""Long prefills held behind a gap stay within the bound the settings promise.

A real engine (:class:`~producer.publisher.Publisher`) sends ``kvindex serve``
batches of ~1 MB (a 128k-token prefill: 8,192 hashes and 131,072 token ids)
behind a lost seq, and its replay ROUTER never answers. The server decodes
their token ids (its check of an engine's first stores reads them, and no
store is applied while they are held), and when the gap is given up every
held batch is applied: decoded all at once, they took 2.4 times the whole
bound (peak +221 MB for a 92 MB promise), decoded one at a time +68 MB.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import zmq

from indexer.core.events import BlockStored, EventBatch
from indexer.engines.vllm.wire import encode_batch
from indexer.ingest.settings import SubscriberSettings
from producer.publisher import Publisher

from .conftest import free_ports
from .served import get, memory, reset_peak, serve
from .test_ingest_limits import HELD_LIMITS, MB, promised

BATCHES = 150
LOST = 5
#: The server's growth besides received batches: the batch being decoded with
#: its token ids (~6 MB), allocator slack.
SLACK = 48 * MB


def prefill() -> bytes:
    """A 128k-token prefill's batch: 8,192 blocks of 16 tokens (token ids over 65,535)."""
    hashes = [hashlib.sha256(b"%d" % block).digest() for block in range(8192)]
    tokens = list(range(100_000, 100_000 + 8192 * 16))
    return encode_batch(EventBatch(1000.0, [BlockStored(hashes, token_ids=tokens, block_size=16)]))


def config(tmp_path: Path, pub: int, replay: int) -> Path:
    path = tmp_path / "kvindex.yaml"
    limits = "".join(f"  {name}: {value}\n" for name, value in HELD_LIMITS.items())
    path.write_text(
        f"engines:\n  - name: e\n    endpoint: tcp://127.0.0.1:{pub}\n"
        f"    replay_endpoint: tcp://127.0.0.1:{replay}\n"
        f"subscriber:\n  replay_timeout: 30\n{limits}"
    )
    return path


def rank(port: int) -> dict:
    return get(port, "/engines/e")["ranks"][0]


def wait_for(port: int, what: str, condition, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not condition(status := rank(port)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {status}"
        time.sleep(0.1)
    return status


@pytest.mark.slow
def test_prefills_held_behind_a_gap_are_decoded_one_at_a_time(tmp_path: Path) -> None:
    pub, replay = free_ports(), free_ports()
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # replay is there, and never answers
    silent.bind(f"tcp://127.0.0.1:{replay}")
    engine = Publisher(f"tcp://127.0.0.1:{pub}", bind=True, holes={LOST}, buffer_steps=1)
    try:
        with serve(config(tmp_path, pub, replay)) as (port, pid):
            wait_for(port, "the engine", lambda r: r["connected"], 30)
            before = reset_peak(pid)
            payload = prefill()
            for _ in range(BATCHES):
                engine.publish_encoded(payload)
            status = wait_for(port, "every batch", lambda r: r["applied_seq"] == BATCHES - 1, 120)
            grew = memory(pid, "VmHWM") - before
            left = memory(pid, "VmRSS") - before
    finally:
        engine.close()
        context.destroy(linger=0)
    bound = promised(SubscriberSettings(**HELD_LIMITS))
    assert grew < bound + SLACK, (
        f"peak grew {grew / MB:.0f} MB for {BATCHES} batches of {len(payload) / MB:.1f} MB;"
        f" the settings promise {bound / MB:.0f} MB (+{SLACK / MB:.0f} MB slack)"
    )
    assert left < SLACK, f"{left / MB:.0f} MB still held once every batch was applied"
    assert status["degraded"] and [(g["first"], g["last"]) for g in status["missing"]] == [
        (LOST, LOST)
    ]
