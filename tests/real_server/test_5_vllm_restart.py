"""The vLLM server killed and started again on the same ports: the same engine to
kvindex (still within its lease), whose new incarnation's seq starts at 0 with an empty
cache. kvindex must drop what the old one held and be exact again."""

from __future__ import annotations

import signal

from tests.real_server.harness import Turns, assert_exact, completion_prompts, settle


def test_vllm_restarted_kvindex_drops_the_old_cache(kv, announced_b) -> None:
    name = announced_b.name
    turns = Turns(kv, announced_b, "vLLM restart")
    prompts = completion_prompts(7, 16)
    done = [turns.turn(f"before {i}", {"prompt": p}) for i, p in enumerate(prompts[:6])]
    settle(kv, name, announced_b.tap)
    held = kv.prefix(name, {"prompt": prompts[5]})
    assert held["gpu_blocks"] > 0, held
    instance = kv.engine(name)["lease"]["instance"]

    announced_b.signal(signal.SIGKILL)  # no clean shutdown: nothing deregisters it
    assert kv.engine(name)["lease"]["instance"] == instance  # still within its lease
    announced_b.start()
    kv.wait_registered(name, other_than=instance)
    settle(kv, name, announced_b.tap)
    gone = kv.prefix(name, {"prompt": prompts[5]})
    assert gone["gpu_blocks"] == 0, gone

    again = [turns.turn(f"after {i}", {"prompt": p}) for i, p in enumerate(prompts[5:], 5)]
    assert again[0].cached_tokens == 0, str(again[0])  # the new incarnation's cache is empty
    assert announced_b.tap.first == 0  # the new incarnation counts its batches from 0
    assert_exact(done + again)
