"""Lookahead hashing: kvindex against vLLM 0.33.0's own ``get_request_block_hasher``.

Each case of :mod:`tests.vllm_tier.lookahead_vectors` (L = 1 and 3; plain, LoRA,
multimodal, LoRA with a salt and images; sha256, sha256_cbor, xxhash) is hashed
by vLLM here and by kvindex, compiled and reference; the event vLLM's block
pool publishes for it decodes in kvindex with the lookahead tokens of each
hash; and the main suite's fixture is exactly what vLLM computes now.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from indexer.engines.vllm import wire
from tests.hash_cases import case_spec, hash_case
from tests.vllm_tier.lookahead_vectors import cases, fixture_text, vllm_case

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lookahead_hash_vectors.json"
CASES = [vllm_case(case) for case in cases()]


def _id(case: dict) -> str:
    return (
        f"{case['algo']}-bs={case['block_size']}-L={case['lookahead_tokens']}"
        f"-n={len(case['tokens'])}-{case['case']}"
    )


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kvindex_hashes_as_vllm_with_lookahead(case: dict, compiled: bool) -> None:
    assert case_spec(case).none_hash.hex() == case["none_hash_hex"]
    digests = hash_case(case, as_bytes=True, compiled=compiled)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_vllms_lookahead_events_decode_with_each_hashs_tokens(case: dict) -> None:
    (stored,) = wire.decode_batch(bytes.fromhex(case["event_payload_hex"])).events
    size, lookahead, tokens = case["block_size"], case["lookahead_tokens"], case["tokens"]
    ends = range(size, size * (len(stored.block_hashes) + 1), size)
    assert stored.block_hashes == case["block_hashes_int64"]
    assert stored.lookahead_token_ids == [tokens[end : end + lookahead] for end in ends]


def test_the_main_suites_fixture_is_what_vllm_computes() -> None:
    assert FIXTURE.read_text() == fixture_text()
