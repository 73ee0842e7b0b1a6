"""kvindex's GPU prefix equals vLLM's cached_tokens, turn by turn, through evictions."""

from __future__ import annotations

from tests.real_server.harness import (
    Agents,
    Conversations,
    Turns,
    assert_exact,
    completion_prompts,
    settle,
)

TURNS = 40


def test_completion_turns_are_exact(kv, announced_a) -> None:
    turns = Turns(kv, announced_a, "completions")
    prompts = completion_prompts(1, TURNS)
    done = [turns.turn(f"prompt {i}", {"prompt": p}) for i, p in enumerate(prompts)]
    assert_exact(done)


def test_chat_turns_are_exact(kv, announced_a) -> None:
    turns = Turns(kv, announced_a, "chat")
    assert_exact(Conversations(2, 4).turns(turns, TURNS))


def test_agent_chat_turns_with_tools_are_exact(kv, announced_a) -> None:
    """A chat with six tools (rendered by the template) and a growing tool-call history."""
    turns = Turns(kv, announced_a, "chat with tools")
    assert_exact(Agents(3, 3).turns(turns, 15, "chat"))


def test_responses_turns_are_exact(kv, announced_a) -> None:
    """The same kind of agent through ``/v1/responses``: instructions, function tools,
    function_call and function_call_output items."""
    turns = Turns(kv, announced_a, "responses")
    assert_exact(Agents(4, 3).turns(turns, 15, "responses"))


def test_the_cache_evicted_and_kvindex_followed(kv, announced_a) -> None:
    """The 4 MB cache (128 blocks) evicted during the turns above: vLLM published
    removals, kvindex applied them (no unknown ones), and the first prompt, held in
    full before, is now answered as vLLM answers it."""
    tap = announced_a.tap
    settle(kv, announced_a.name, tap)
    assert tap.counts.get("BlockRemoved", 0) > 0, tap.counts
    assert tap.counts.get("AllBlocksCleared", 0) == 0, tap.counts
    rank = kv.rank(announced_a.name)
    assert rank["anomalies"]["unknown_removals"] == 0, rank
    assert rank["restarts"] == 0, rank
    # every hash vLLM stored or removed is one op kvindex applied; what is resident is
    # at most what was stored and not removed
    ops = kv.metric("kvindex_ingest_block_ops_total", announced_a.name)
    stored, removed = tap.hashes["BlockStored"], tap.hashes["BlockRemoved"]
    assert ops == stored + removed, (ops, tap.hashes)
    assert rank["blocks"]["GPU"] <= stored - removed, (rank["blocks"], tap.hashes)
    first = completion_prompts(1, 1)[0]
    turn = Turns(kv, announced_a, "completions").turn("prompt 0 again", {"prompt": first})
    assert turn.exact, str(turn)
    assert turn.cached_tokens < (turn.prompt_tokens - 1) // 32 * 32, str(turn)
