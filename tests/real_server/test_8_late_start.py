"""kvindex started after the engine's replay buffer moved on: the engine ran 40 chat
turns with a 10-step buffer while its kvindex was not yet listening, so replay cannot
fill the batches from 0 on. The plugin's announcer registers the engine once kvindex is
up, kvindex asks the plugin for a snapshot of the engine's prefix cache, applies it as
the rank's state, and answers every following turn exactly; the engine never restarts.
Without the snapshot kvindex held only what the last 10 steps stored: the system prompt
and the chats' older turns, which every following turn reuses, were unknown to it."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.real_server.conftest import Serve, VllmServer
from tests.real_server.harness import (
    Conversations,
    Kvindex,
    Turns,
    Vllm,
    assert_exact,
    settle,
)

BUFFER_STEPS = 10
BEFORE = 40  # chat turns the engine serves before kvindex starts
AFTER = 20  # chat turns compared once kvindex restored the snapshot
CHATS = 6  # conversations, round robin: more history than the 128-block cache holds


@pytest.fixture
def late(tmp_path_factory, model_dir) -> Iterator[tuple[Serve, VllmServer]]:
    """An engine with a 10-step replay buffer announcing itself to a kvindex whose port
    is chosen but which is not started."""
    kvindex = Serve(tmp_path_factory.mktemp("kvindex-late"), model_dir)
    engine = VllmServer(
        tmp_path_factory.mktemp("real-late"),
        "real-late",
        model_dir,
        kvindex.url,
        lease=30,
        events_config={"buffer_steps": BUFFER_STEPS},
    )
    try:
        engine.start()
        yield kvindex, engine
    finally:
        engine.stop()
        engine.tap.close()
        kvindex.signal(signal.SIGTERM)


def test_kvindex_started_after_the_replay_buffer_moved_on_is_exact(late) -> None:
    serve, engine = late
    name = engine.name
    vllm = Vllm(engine.url)
    sources = vllm.http.get("/kv_event_sources").raise_for_status().json()
    assert sources["0"]["buffer_steps"] == BUFFER_STEPS, sources

    chats = Conversations(8, CHATS)
    for _ in range(BEFORE):
        index, messages = chats.ask()
        answer = vllm.send({"messages": messages}, max_tokens=8)
        chats.answer(index, answer["choices"][0]["message"]["content"])
    stored = engine.tap.stored()
    published = engine.tap.seq
    assert engine.tap.first == 0, engine.tap.first  # the tap saw the engine's whole stream
    # far more batches than the replay buffer holds: replay cannot fill 0..published-10
    assert published is not None and published >= 4 * BUFFER_STEPS, published

    serve.start()  # the announcer, retrying all along, registers the engine
    kv = Kvindex(serve.url)
    kv.wait_registered(name, timeout=60)
    settle(kv, name, engine.tap)
    rank = kv.rank(name)
    assert rank["restores"] >= 1, rank  # the snapshot was applied ...
    assert rank["snapshot_error"] is None, rank
    assert not rank["degraded"], rank  # ... and the rank is whole again
    assert rank["restarts"] == 0, rank  # the same engine incarnation throughout
    assert rank["applied_seq"] == engine.tap.seq, (rank, engine.tap.seq)
    # what the engine holds includes blocks stored long before the last 10 steps
    assert rank["blocks"]["GPU"] > 0, rank

    turns = Turns(kv, engine, "late start")
    removed = engine.tap.counts.get("BlockRemoved", 0)
    done = []
    for i in range(AFTER):
        index, messages = chats.ask()
        turn = turns.turn(f"chat {index} turn {BEFORE + i}", {"messages": messages}, max_tokens=8)
        chats.answer(index, turn.reply)
        done.append(turn)
    assert_exact(done)
    # every following turn reused history the engine cached before kvindex started
    assert done[0].cached_tokens > 0, str(done[0])
    assert engine.tap.counts.get("BlockRemoved", 0) > removed, engine.tap.counts  # evictions

    settle(kv, name, engine.tap)
    rank = kv.rank(name)
    assert not rank["degraded"], rank
    assert rank["restarts"] == 0, rank
    assert rank["anomalies"]["unknown_removals"] == 0, rank
    assert engine.tap.stored() > stored  # the engine served on, unrestarted
