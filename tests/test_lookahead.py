"""An engine hashing with lookahead (vLLM 0.33's ``num_hash_lookahead_tokens``) is
matched by tokens, and one declared with another lookahead is caught.

vLLM's own event batches (``event_payload_hex`` of
``tests/fixtures/lookahead_hash_vectors.json``, from its ``BlockPool``) go over
real ZMQ to the real subscriber; the ``tokens`` queries are the prompts that
made them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from indexer.core.events import BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import Prompt

from .apikit import LiveApi
from .test_e2e import until
from .test_misdeclared import _count, _flagged

CASES = json.loads((Path(__file__).parent / "fixtures" / "lookahead_hash_vectors.json").read_text())


def _cases(lookahead: int, algo: str = "sha256") -> list[dict]:
    return [
        c
        for c in CASES
        if (c["lookahead_tokens"], c["algo"], c["block_size"]) == (lookahead, algo, 16)
    ]


def _query(case: dict, tokens: list[int] | None = None, field: str = "tokens") -> dict:
    """The prefix-match body of a case's prompt (``tokens`` instead of its own), its
    token ids given as ``field``."""
    body = {field: case["tokens"] if tokens is None else tokens, "mm_features": case["mm"]}
    extras = {key: case[key] for key in ("lora_name", "lora_path", "cache_salt")}
    return body | {key: value for key, value in extras.items() if value is not None}


async def _publish(live: LiveApi, name: str, cases: list[dict], **declared) -> None:
    """vLLM's batches of ``cases`` from an engine declared as ``declared`` says (by
    default with the cases' hashing)."""
    hashing = {"hash_algo": cases[0]["algo"], "hash_seed": cases[0]["PYTHONHASHSEED"]}
    (publisher,) = await live.add_published(name, block_size=16, **hashing | declared)
    for case in cases:
        publisher.publish_encoded(bytes.fromhex(case["event_payload_hex"]))
    await live.wait_applied(name, [len(cases) - 1])


async def _gpu_blocks(live: LiveApi, name: str, body: dict) -> int:
    answer = (await live.client.post("/prefix-match", json=body | {"engines": [name]})).json()
    return answer["engines"][0]["gpu_blocks"]


@pytest.fixture
async def live() -> LiveApi:
    async with LiveApi() as api:
        yield api


@pytest.mark.parametrize("learned", [False, True], ids=["hashed", "learned"])
@pytest.mark.parametrize(("lookahead", "algo"), [(1, "sha256"), (3, "sha256"), (3, "xxhash")])
async def test_a_lookahead_engine_is_matched_by_tokens(
    live, lookahead: int, algo: str, learned: bool
) -> None:
    """Every block vLLM hashed, plain, with a LoRA adapter, a salt or images, and none
    it could not hash yet; a prompt going on past them matches the same blocks, one
    whose lookahead tokens differ matches none of the blocks they follow. Hashed as
    vLLM does, or (the hashing not declared) walked through the learned token index."""
    cases = _cases(lookahead, algo)
    hashing = {"hash_algo": None} if learned else {}
    await _publish(live, "ahead", cases, lookahead_tokens=lookahead, **hashing)
    for case in cases:
        hashed = len(case["block_hashes_hex"])
        assert await _gpu_blocks(live, "ahead", _query(case)) == hashed, case["case"]
        as_prompt = _query(case, field="prompt")  # a completions prompt of token ids
        assert await _gpu_blocks(live, "ahead", as_prompt) == hashed
        longer = case["tokens"] + [7] * 40
        assert await _gpu_blocks(live, "ahead", _query(case, longer)) == hashed
        changed = case["tokens"][:]
        changed[16 * hashed] += 1  # the first token after the last hashed block
        assert await _gpu_blocks(live, "ahead", _query(case, changed)) == hashed - 1
    assert (await live.client.get("/engines/ahead")).json()["misdeclared"] == []


@pytest.mark.parametrize(
    ("declared", "published", "reason"),
    [
        (0, 3, "lookahead_tokens: declared 0, events show 3"),
        (1, 3, "lookahead_tokens: declared 1, events show 3"),
        (3, 1, "lookahead_tokens: declared 3, events show 1"),
    ],
)
async def test_another_lookahead_than_declared_is_caught(
    live, declared: int, published: int, reason: str
) -> None:
    cases, name = _cases(published), f"wrong-{declared}-{published}"
    await _publish(live, name, cases, lookahead_tokens=declared)
    await until(lambda: _flagged(live, name), 5, "the lookahead mismatch to be reported")
    assert (await live.client.get(f"/engines/{name}")).json()["misdeclared"] == [reason]
    assert _count(name, "lookahead_tokens") == 1
    assert await _gpu_blocks(live, name, _query(cases[0])) == 0  # left out of tokens matching


async def test_an_engine_declared_with_lookahead_whose_events_carry_none_is_caught(live) -> None:
    (publisher,) = await live.add_published("legacy", lookahead_tokens=2)
    hasher = catalog.adapter("vllm").hasher("sha256", None, 16)
    tokens = list(range(32))
    stored = BlockStored(
        block_hashes=hasher.published(hasher.digests(Prompt(tuple(tokens)))),
        token_ids=tokens,
        block_size=16,
        extra_keys=[None, None],
        medium="GPU",
    )
    publisher.publish(EventBatch(ts=1.0, events=[stored]))
    await live.wait_applied("legacy", [0])
    await until(lambda: _flagged(live, "legacy"), 5, "the missing lookahead to be reported")
    reasons = (await live.client.get("/engines/legacy")).json()["misdeclared"]
    assert reasons == ["lookahead_tokens: declared 2, events carry no lookahead_token_ids"]
