"""kvindex started after the engine's replay buffer moved on: the engine serves 40 chat
turns with a 10-step buffer while its kvindex is not yet listening, so replay cannot
fill the batches from 0 on. The plugin's announcer, retrying all along, registers the
engine once kvindex is up; kvindex asks the plugin for a snapshot of the engine's prefix
cache, applies it as the rank's state, and answers every following turn exactly. The
engine never restarts.

Without the snapshot kvindex holds only what the replay buffer's last 10 steps stored:
the shared system prompt and the chats' older turns, which every following turn reuses,
are unknown to it (it answered 0 blocks for them), and the rank stays degraded.

The same publisher is also followed under a second name registered by hand with the
plugin's snapshot endpoint: kvindex and the plugin's snapshot server on their own,
whatever the announcement says.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from tests.real_server.conftest import BESIDE, SNAPSHOTS, TOKEN, Serve, VllmServer
from tests.real_server.harness import (
    MODEL,
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
BY_HAND = "real-late-by-hand"


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


def _restored(kv: Kvindex, name: str, timeout: float = 60.0) -> dict:
    """The rank once its snapshot is applied: replay's last batches can bring it to the
    engine's newest seq before the snapshot it asked for has arrived (still degraded)."""
    deadline = time.monotonic() + timeout
    while (rank := kv.rank(name))["restores"] < 1 or rank["degraded"]:
        if time.monotonic() > deadline or rank["snapshot_error"] is not None:
            break
        time.sleep(0.1)
    assert rank["snapshots"], rank  # kvindex knows where the engine answers snapshots
    assert rank["restores"] >= 1, rank  # the snapshot was applied ...
    assert rank["snapshot_error"] is None, rank
    assert not rank["degraded"], rank  # ... and the rank is whole again
    assert rank["restarts"] == 0, rank  # the same engine incarnation throughout
    assert rank["blocks"]["GPU"] > 0, rank
    return rank


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
    assert engine.tap.first == 0, engine.tap.first  # the tap saw the engine's whole stream
    # far more batches than the replay buffer holds: replay cannot fill 0..seq-10
    assert engine.tap.seq is not None and engine.tap.seq >= 3 * BUFFER_STEPS, engine.tap.seq

    serve.start()  # the announcer, retrying all along, registers the engine
    kv = Kvindex(serve.url)
    announced = kv.wait_registered(name, timeout=60)
    mirror, snapshots = engine.events + BESIDE, engine.events + SNAPSHOTS
    kv.register(
        {
            "name": BY_HAND,
            "endpoint": f"tcp://127.0.0.1:{mirror}",
            "replay_endpoint": f"tcp://127.0.0.1:{engine.replay + BESIDE}",
            "snapshot_endpoint": f"tcp://127.0.0.1:{snapshots}",
            "model": MODEL,
            "block_size": 32,
            "hash_algo": "sha256",
            "reuse_reports": "filtered",
        },
        TOKEN,
    )
    kv.wait_registered(BY_HAND, leased=False)
    for each in (BY_HAND, name):
        settle(kv, each, engine.tap)
    # the plugin's snapshot server answers kvindex: the rank is exact from the snapshot on
    _restored(kv, BY_HAND)
    # the engine announced where it answers snapshots (it binds its event endpoints)
    assert announced["endpoint"] == f"tcp://127.0.0.1:{mirror}", announced
    assert announced["snapshot_endpoint"] == f"tcp://127.0.0.1:{snapshots}", announced
    _restored(kv, name)
    # replay's batches were applied before the snapshot replaced them (their removals
    # of blocks stored earlier were unknown then); none is unknown from the snapshot on
    unknown = {each: kv.rank(each)["anomalies"]["unknown_removals"] for each in (name, BY_HAND)}

    turns = Turns(kv, engine, "late start", also=(BY_HAND,))
    removed = engine.tap.counts.get("BlockRemoved", 0)
    done = chats.turns(turns, AFTER, first=BEFORE)
    assert_exact(turns.done)
    # the first turn already reused history cached before kvindex started
    assert done[0].cached_tokens > 0, str(done[0])
    assert engine.tap.counts.get("BlockRemoved", 0) > removed, engine.tap.counts  # evictions

    for each in (name, BY_HAND):
        settle(kv, each, engine.tap)
        rank = kv.rank(each)
        assert not rank["degraded"], rank
        assert rank["restarts"] == 0, rank
        assert rank["anomalies"]["unknown_removals"] == unknown[each], (unknown, rank)
    assert engine.tap.stored() > stored  # the same engine served on, unrestarted
