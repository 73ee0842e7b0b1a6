"""Golden vectors of lookahead hashing, computed by vLLM 0.33.0's own code.

An engine with ``num_hash_lookahead_tokens`` L > 0 hashes each block over the L
tokens after it. Each case here is a prompt (token ids, LoRA adapter, cache
salt, multimodal items) and an engine (algorithm, PYTHONHASHSEED, block size,
L); :func:`vllm_case` hashes it with vLLM's ``Request`` and the hasher of
``get_request_block_hasher``, and has vLLM's ``BlockPool`` cache those blocks
and publish the ``BlockStored`` event, encoded as its ZMQ publisher does.

``tests/vllm_tier/test_lookahead.py`` compares kvindex with these cases live;
the main suite (``tests/test_hashing.py``, ``tests/test_lookahead.py``) checks
kvindex against the same vectors written once to
``tests/fixtures/lookahead_hash_vectors.json``, without vLLM. To write them
again, in the tier's venv (``scripts/vllm-tier.sh`` builds it)::

    PYTHONPATH=$PWD ~/.cache/kvindex/vllm-0.33.0-venv/bin/python \\
        -m tests.vllm_tier.lookahead_vectors > tests/fixtures/lookahead_hash_vectors.json
"""

from __future__ import annotations

import json
import os
import random
import sys
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: Items chosen against 16-token blocks: one starting in block 0's lookahead
#: window, one across blocks 1-3, one inside block 3, one only in block 3's window.
MM_ITEMS = [
    {"identifier": "img-a", "offset": 17, "length": 5},
    {"identifier": "img-b", "offset": 30, "length": 20},
    {"identifier": "img-c", "offset": 50, "length": 2},
    {"identifier": "img-d", "offset": 64, "length": 3},
]
LORA = {"lora_name": "sql-adapter", "lora_path": "/adapters/sql"}
KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "lora": LORA,
    "mm": {"mm": MM_ITEMS},
    "lora+salt+mm": LORA | {"cache_salt": "tenant-7", "mm": MM_ITEMS},
}
#: (algorithm, PYTHONHASHSEED): the default, the CBOR serialisation, xxhash seeded.
ENGINES = [("sha256", None), ("sha256_cbor", None), ("xxhash", "7")]


def cases() -> list[dict[str, Any]]:
    """Every case's inputs: each kind at L = 1 and 3 on every engine, prompts of
    full blocks whose last one lacks its lookahead tokens and of blocks and a
    tail; and a lookahead longer than a block."""
    rng = random.Random(33)
    out = []
    for lookahead in (1, 3):
        for algo, seed in ENGINES:
            for kind, extras in KINDS.items():
                for n_tokens in (64, 75):
                    tokens = [rng.randrange(150_000) for _ in range(n_tokens)]
                    out.append(_case(kind, algo, seed, 16, lookahead, tokens, extras))
    out.append(_case("plain", "sha256", None, 2, 3, list(range(500, 511)), {}))
    return out


def _case(kind, algo, seed, block_size, lookahead, tokens, extras) -> dict[str, Any]:
    return {
        "case": kind,
        "algo": algo,
        "PYTHONHASHSEED": seed,
        "block_size": block_size,
        "lookahead_tokens": lookahead,
        "tokens": tokens,
        "lora_name": extras.get("lora_name"),
        "lora_path": extras.get("lora_path"),
        "cache_salt": extras.get("cache_salt"),
        "mm": extras.get("mm", []),
    }


@contextmanager
def _hash_seed(seed: str | None):
    """PYTHONHASHSEED as the engine had it while vLLM derives NONE_HASH from it."""
    before = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = before


def _request(case: dict[str, Any], hasher: Any) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    lora = None
    if case["lora_name"] is not None:
        lora = LoRARequest(case["lora_name"], 1, case["lora_path"])
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=item["identifier"],
            mm_position=PlaceholderRange(item["offset"], item["length"]),
        )
        for item in case["mm"]
    ]
    return Request(
        "r",
        case["tokens"],
        SamplingParams(max_tokens=1),
        None,
        mm_features=features or None,
        lora_request=lora,
        cache_salt=case["cache_salt"],
        block_hasher=hasher,
    )


def vllm_case(case: dict[str, Any]) -> dict[str, Any]:
    """The case with vLLM's answers: ``none_hash_hex``, the block hashes (digests
    and published ints) and ``event_payload_hex``, the batch of the ``BlockStored``
    event its block pool publishes once the request's hashed blocks are cached."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    size, lookahead = case["block_size"], case["lookahead_tokens"]
    fn = get_hash_fn_by_name(case["algo"])
    with _hash_seed(case["PYTHONHASHSEED"]):
        kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(size, fn, lookahead)
    request = _request(case, hasher)
    digests = list(request.block_hashes)
    # One block more than the request needs: the pool keeps one as its null block.
    pool = BlockPool(
        len(digests) + 1,
        enable_caching=True,
        hash_block_size=size,
        enable_kv_cache_events=True,
        num_hash_lookahead_tokens=lookahead,
    )
    pool.cache_full_blocks(request, pool.get_new_blocks(len(digests)), 0, len(digests), size, 0)
    batch = KVEventBatch(ts=1.0, events=pool.take_events())
    return case | {
        "none_hash_hex": kv_cache_utils.NONE_HASH.hex(),
        "block_hashes_hex": [d.hex() for d in digests],
        "block_hashes_int64": [kv_cache_utils.maybe_convert_block_hash(d) for d in digests],
        "event_payload_hex": msgspec.msgpack.encode(batch).hex(),
    }


def fixture_text() -> str:
    """The fixture's text: one case a line, so a change shows case by case."""
    return "[\n" + ",\n".join(json.dumps(vllm_case(case)) for case in cases()) + "\n]\n"


def main() -> None:
    sys.stdout.write(fixture_text())


if __name__ == "__main__":
    main()
