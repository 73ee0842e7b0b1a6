"""Two engines at once: each exact for its own prompts, neither matching the other's."""

from __future__ import annotations

from tests.real_server.harness import Turns, assert_exact, completion_prompts, settle


def test_two_engines_each_exact_for_its_own_prompts(kv, announced_a, announced_b) -> None:
    a = Turns(kv, announced_a, "two servers")
    b = Turns(kv, announced_b, "two servers")
    only_a, only_b = completion_prompts(5, 12), completion_prompts(6, 12)
    done = []
    for i, (pa, pb) in enumerate(zip(only_a, only_b, strict=True)):
        done.append(a.turn(f"A's {i}", {"prompt": pa}))
        done.append(b.turn(f"B's {i}", {"prompt": pb}))
    for i, (pa, pb) in enumerate(zip(only_a[-4:], only_b[-4:], strict=True)):
        settle(kv, announced_a.name, announced_a.tap)
        settle(kv, announced_b.name, announced_b.tap)
        held = kv.gpu_blocks({"prompt": pa})
        assert held[announced_a.name] > 0 and held[announced_b.name] == 0, held
        held = kv.gpu_blocks({"prompt": pb})
        assert held[announced_b.name] > 0 and held[announced_a.name] == 0, held
        done.append(a.turn(f"A's {i} again", {"prompt": pa}))
        done.append(b.turn(f"B's {i} again", {"prompt": pb}))
    # a prompt only A was sent matches nothing on B: B itself, asked then, has none cached
    crossed = [b.turn(f"A's {i} on B", {"prompt": p}) for i, p in enumerate(only_a[-2:])]
    assert all(t.kvindex_tokens == 0 for t in crossed), [str(t) for t in crossed]
    assert_exact(done + crossed)
