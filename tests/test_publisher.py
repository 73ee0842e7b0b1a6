"""kvindex's publisher speaks vLLM 0.33's wire byte for byte, live and on replay.

Its output is read with raw ZMQ sockets and decoded with :mod:`indexer.engines.vllm.wire`;
the subscriber tests use it as the vLLM-like engine in every scenario, and
the last test here rebuilds a trace's state from its replay socket alone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import zmq

from indexer.core.events import EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.engines.vllm.wire import decode_batch
from indexer.engines.zmq_framing import REPLAY_END, decode_frames, offset_endpoint
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores import MemoryStore
from producer.publisher import Publisher

from .conftest import FIXTURES, assert_matches_trace, free_ports, trace_batches, wait_until

GOLDEN = sorted(p for p in (FIXTURES / "wire").glob("*.msgpack") if "legacy" not in p.name)
END = [b"", b"\xff" * 8, b""]


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def local(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a replay ROUTER as vLLM's consumers do; every answer up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        answers.append(dealer.recv_multipart())
        if answers[-1] == END:
            dealer.close(linger=0)
            return answers


def seqs(answers: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(seq, "big") for _, seq, _ in answers[:-1]]


def test_live_frames_are_vllm_bytes(ctx: zmq.Context) -> None:
    port = free_ports()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(local(port))
    warmup = decode_batch(GOLDEN[0].read_bytes())
    with Publisher(local(port), topic="kv", bind=True) as pub:
        # A SUB only gets what is published after its subscription has arrived.
        while not sub.poll(20):
            pub.publish(warmup)
        first = decode_frames(sub.recv_multipart())[1]
        assert pub.flush()
        while sub.poll(20):
            first = decode_frames(sub.recv_multipart())[1]
        for path in GOLDEN:
            pub.publish(decode_batch(path.read_bytes()))
        got = [sub.recv_multipart() for _ in GOLDEN]
    assert got == [
        [b"kv", (first + i).to_bytes(8, "big"), path.read_bytes()]
        for i, path in enumerate(GOLDEN, 1)
    ]


def test_replay_answers_with_the_buffer_then_the_end_marker(ctx: zmq.Context) -> None:
    items = trace_batches("chat-gpu-only")[:30]
    endpoint = local(free_ports())
    with Publisher(local(free_ports()), endpoint, bind=True, buffer_steps=20) as pub:
        for batch in items:
            pub.publish(batch)
        assert pub.flush()
        everything, tail = replay(ctx, endpoint, 0), replay(ctx, endpoint, 25)
        assert replay(ctx, endpoint, 30) == [END]
    assert (-1).to_bytes(8, "big", signed=True) == REPLAY_END  # vLLM's end marker
    assert seqs(everything) == list(range(10, 30))  # the buffer keeps the last 20
    assert seqs(tail) == list(range(25, 30))
    assert [decode_batch(p) for _, _, p in everything[:-1]] == items[10:]


def test_data_parallel_rank_offsets_ports_and_tags_batches(ctx: zmq.Context) -> None:
    pub_port, replay_port = free_ports(3), free_ports(3)
    batch = EventBatch(1.0, [], None)
    with Publisher(local(pub_port), local(replay_port), data_parallel_rank=2, bind=True) as pub:
        assert (pub.endpoint, pub.replay_endpoint) == (
            local(pub_port + 2),
            local(replay_port + 2),
        )
        pub.publish(batch)
        pub.publish(EventBatch(2.0, [], 5))  # a rank the engine set itself is kept
        assert pub.flush()
        answers = replay(ctx, local(replay_port + 2), 0)
    assert [decode_batch(p).data_parallel_rank for _, _, p in answers[:-1]] == [2, 5]
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


def test_holes_and_live_drops(ctx: zmq.Context) -> None:
    """``holes`` are never sent nor buffered; ``drop_live`` seqs only reach replay."""
    port, endpoint = free_ports(), local(free_ports())
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(local(port))
    pub = Publisher(local(port), endpoint, bind=True, holes={13, 14}, drop_live={16})
    with pub:
        while not sub.poll(20):  # warm up until subscribed
            pub.publish(EventBatch(0.0, []))
        assert pub.flush()
        warm = pub.next_seq
        for i in range(20 - warm):
            pub.publish(EventBatch(float(i), []))
        assert pub.flush()
        live = []
        while sub.poll(100):
            live.append(decode_frames(sub.recv_multipart())[1])
        buffered = seqs(replay(ctx, endpoint, 0))
    assert warm <= 13, "warm-up ran into the holes"
    assert live[-1] == 19 and not {13, 14, 16} & set(live)
    assert buffered == [*range(13), *range(15, 20)]


def test_full_queue_drops_and_spends_the_seq(ctx: zmq.Context) -> None:
    """publish never blocks; a dropped batch leaves a hole consumers can see."""
    endpoint = local(free_ports())
    batch = trace_batches("chat-sha256")[5]
    with Publisher(local(free_ports()), endpoint, bind=True, max_queue_size=1) as pub:
        accepted = sum(pub.publish(batch) for _ in range(2000))
        assert pub.flush()
        assert pub.publish(EventBatch(1.0, []))
        assert pub.flush()
        buffered = seqs(replay(ctx, endpoint, 0))
        assert pub.dropped == 2000 - accepted
    assert buffered[-1] == 2000  # every batch, dropped or not, spent its seq
    assert len(buffered) == accepted + 1


def test_close_frees_the_ports_for_a_restarted_publisher() -> None:
    pub_port, replay_port = free_ports(), free_ports()
    for _ in range(2):
        with Publisher(local(pub_port), local(replay_port), bind=True) as pub:
            pub.publish(EventBatch(1.0, []))
            assert pub.flush()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(EventBatch(1.0, []))


def test_imports_no_server_dependency() -> None:
    code = (
        "import sys, producer.publisher; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'fastapi', 'starlette', 'uvicorn', 'redis', 'prometheus_client', 'api'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_subscriber_rebuilds_a_trace_from_replay_alone() -> None:
    """Nothing reaches the SUB socket: every batch comes through the replay ROUTER."""
    items = trace_batches("chat-sha256")
    spec = EngineSpec("e", local(free_ports()), replay_endpoint=local(free_ports()))
    pub = Publisher(spec.endpoint, spec.replay_endpoint, bind=True, drop_live=range(len(items)))
    registry, store = EngineRegistry(), MemoryStore()
    await registry.add(spec)
    subscriber = Subscriber(store, registry, SubscriberSettings(probe_interval=0.1))
    await subscriber.start()
    try:
        for batch in items:
            pub.publish(batch)
        await wait_until(lambda: subscriber.rank_status("e")[0].applied_seq == len(items) - 1)
    finally:
        await subscriber.stop()
        pub.close()
    await assert_matches_trace(store, RankId("e", 0), "chat-sha256")
