"""kvindex killed mid-run and started again: the engine's lease renewal registers it
again (the embedded store keeps nothing), replay brings back what it published meanwhile,
and the answers are exact again."""

from __future__ import annotations

import signal

from tests.real_server.harness import Turns, Vllm, assert_exact, completion_prompts, settle


def test_kvindex_killed_and_restarted_is_exact_again(kv, serve, announced_a) -> None:
    name = announced_a.name
    turns = Turns(kv, announced_a, "kvindex restart")
    prompts = completion_prompts(3, 24)
    done = [turns.turn(f"before {i}", {"prompt": p}) for i, p in enumerate(prompts[:8])]
    instance = kv.engine(name)["lease"]["instance"]

    serve.signal(signal.SIGKILL)
    vllm = Vllm(announced_a.url)  # the engine serves on: what it stores now only replay has
    for p in prompts[8:16]:
        vllm.send({"prompt": p})
    serve.start()  # with nothing kept: the engine comes back by itself

    engine = kv.wait_registered(name, timeout=3 * announced_a.lease)
    assert engine["lease"]["instance"] == instance  # a renewal, not a new engine
    settle(kv, name, announced_a.tap)
    rank = kv.rank(name)
    assert rank["replays"] >= 1, rank
    assert rank["blocks"]["GPU"] > 0, rank  # rebuilt from the replay buffer alone
    last = kv.prefix(name, {"prompt": prompts[15]})
    assert last["gpu_blocks"] == last["num_blocks"], last  # sent while kvindex was down

    done += [turns.turn(f"after {i}", {"prompt": p}) for i, p in enumerate(prompts[8:], 8)]
    assert_exact(done)
