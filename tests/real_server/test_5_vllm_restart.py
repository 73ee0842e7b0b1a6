"""The vLLM server killed and started again on the same ports, with an empty cache and
its seq counted from 0 again: kvindex must drop what the old incarnation held and be
exact again. Followed under two names: as announced by the plugin (still within its
lease, so the new instance id tells kvindex), and registered by hand on the same
endpoints, where only the seq going back to 0 tells it."""

from __future__ import annotations

import signal

from tests.real_server.conftest import TOKEN
from tests.real_server.harness import MODEL, Turns, assert_exact, completion_prompts, settle

BY_HAND = "real-b-by-hand"


def test_vllm_restarted_kvindex_drops_the_old_cache(kv, announced_b) -> None:
    name = announced_b.name
    spec = {
        "name": BY_HAND,
        "endpoint": f"tcp://127.0.0.1:{announced_b.events}",
        "replay_endpoint": f"tcp://127.0.0.1:{announced_b.replay}",
        "model": MODEL,
        "block_size": 32,
        "hash_algo": "sha256",
    }
    kv.register(spec, TOKEN)
    try:
        kv.wait_registered(BY_HAND, leased=False)
        turns = Turns(kv, announced_b, "vLLM restart", also=(BY_HAND,))
        prompts = completion_prompts(7, 16)
        for i, p in enumerate(prompts[:6]):
            turns.turn(f"before {i}", {"prompt": p})
        for engine in (name, BY_HAND):
            settle(kv, engine, announced_b.tap)
            held = kv.prefix(engine, {"prompt": prompts[5]})
            assert held["gpu_blocks"] > 0, held
        instance = kv.engine(name)["lease"]["instance"]

        announced_b.signal(signal.SIGKILL)  # no clean shutdown: nothing deregisters it
        assert kv.engine(name)["lease"]["instance"] == instance  # still within its lease
        announced_b.start()
        kv.wait_registered(name, other_than=instance)
        settle(kv, name, announced_b.tap)
        gone = kv.prefix(name, {"prompt": prompts[5]})
        assert gone["gpu_blocks"] == 0, gone  # the new instance id said it

        # the hand-registered name learns of the restart from the new incarnation's first
        # batch (seq 0 again): one prompt of no other turn's
        stored = announced_b.tap.stored()
        turns.vllm.send({"prompt": completion_prompts(70, 1)[0]})
        announced_b.tap.expect(stored + 1)
        settle(kv, BY_HAND, announced_b.tap)
        gone = kv.prefix(BY_HAND, {"prompt": prompts[5]})
        assert gone["gpu_blocks"] == 0, gone
        assert announced_b.tap.first == 0  # the new incarnation counts its batches from 0
        assert kv.rank(BY_HAND)["restarts"] >= 1, kv.rank(BY_HAND)

        again = [turns.turn(f"after {i}", {"prompt": p}) for i, p in enumerate(prompts[5:], 5)]
        assert again[0].cached_tokens == 0, str(again[0])  # the new cache is empty
        assert_exact(turns.done)
    finally:
        kv.remove(BY_HAND, TOKEN)
