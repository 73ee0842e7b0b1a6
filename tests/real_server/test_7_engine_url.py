"""An engine given by its URL alone: kvindex reads the real server's ``/kv_event_sources``
and ``/v1/models``, learns the block size from its events, checks the hash algorithm
against the tokens they carry, and is exact turn by turn on vLLM's own stream."""

from __future__ import annotations

from tests.real_server.conftest import TOKEN
from tests.real_server.harness import (
    MODEL,
    Turns,
    Vllm,
    assert_exact,
    completion_prompts,
    settle,
)

BY_URL = "real-a-by-url"
MISDECLARED = "real-a-cbor"


def test_an_engine_registered_by_its_url_is_exact(kv, announced_a) -> None:
    kv.register({"url": announced_a.url, "name": BY_URL}, TOKEN)
    try:
        kv.wait_registered(BY_URL, leased=False)
        engine = kv.engine(BY_URL)
        # the server said where its events are and what it serves; vLLM's own stream
        assert engine["endpoint"] == f"tcp://127.0.0.1:{announced_a.events}"
        assert engine["replay_endpoint"] == f"tcp://127.0.0.1:{announced_a.replay}"
        assert (engine["model"], engine["topic"], engine["dp_ranks"]) == (MODEL, "kv-events", 1)
        assert (engine["block_size"], engine["reuse_reports"]) == (None, "capped")

        turns = Turns(kv, announced_a, "by url", also=(BY_URL,))
        first, *prompts = completion_prompts(91, 9)
        turns.vllm.send({"prompt": first})  # its first store teaches the block size
        settle(kv, BY_URL, announced_a.tap)
        engine = kv.engine(BY_URL)
        assert (engine["learned_block_size"], engine["unmatched"]) == (32, None), engine
        assert engine["misdeclared"] == []
        for i, prompt in enumerate(prompts):
            turns.turn(f"by url {i}", {"prompt": prompt})
        assert_exact(turns.done)
    finally:
        kv.remove(BY_URL, TOKEN)


def test_a_hash_algorithm_its_events_contradict_is_flagged(kv, announced_a) -> None:
    """The server hashes with sha256: declared sha256_cbor, its first stores say so."""
    kv.register({"url": announced_a.url, "name": MISDECLARED, "hash_algo": "sha256_cbor"}, TOKEN)
    try:
        kv.wait_registered(MISDECLARED, leased=False)
        Vllm(announced_a.url).send({"prompt": completion_prompts(92, 1)[0]})
        settle(kv, MISDECLARED, announced_a.tap)
        reasons = kv.engine(MISDECLARED)["misdeclared"]
        assert any("hash" in reason for reason in reasons), reasons
    finally:
        kv.remove(MISDECLARED, TOKEN)
