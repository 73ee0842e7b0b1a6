"""A golden hashing case (``hash_vectors.json``, ``lookahead_hash_vectors.json``) hashed
by kvindex: the main suite and the vLLM tier read the cases' fields one way."""

from __future__ import annotations

from typing import Any

from indexer.engines.vllm.hashing import HashSpec, MMFeature, block_hashes


def case_spec(case: dict) -> HashSpec:
    return HashSpec(
        case["algo"], case["PYTHONHASHSEED"], case["block_size"], case.get("lookahead_tokens", 0)
    )


def hash_case(case: dict, *, as_bytes: bool, hashes=block_hashes, **options: Any) -> list:
    """The case's prompt hashed by ``hashes`` (``options``: e.g. ``compiled``)."""
    return hashes(
        case_spec(case),
        case["tokens"],
        lora_name=case["lora_name"],
        lora_path=case["lora_path"],
        cache_salt=case["cache_salt"],
        mm_features=[MMFeature(**item) for item in case["mm"]],
        as_bytes=as_bytes,
        **options,
    )
