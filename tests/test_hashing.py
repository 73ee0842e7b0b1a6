"""Block hashing must equal vLLM 0.33.0's bit for bit, or token-id lookups miss silently."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from indexer.hashing import (
    HASH_ALGOS,
    HashSpec,
    MMFeature,
    NotReproducible,
    UnknownHashAlgo,
    block_hashes,
)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "vllm-0.33.0"
CASES = json.loads((FIXTURES / "hash_vectors.json").read_text())
REPO = Path(__file__).resolve().parents[1]


def _case_id(case: dict) -> str:
    return f"{case['algo']}-seed={case['PYTHONHASHSEED']}-bs={case['block_size']}-{case['case']}"


def _hash_case(case: dict, *, as_bytes: bool) -> list:
    spec = HashSpec(case["algo"], case["PYTHONHASHSEED"], case["block_size"])
    return block_hashes(
        spec,
        case["tokens"],
        lora_name=case["lora_name"],
        lora_path=case["lora_path"],
        cache_salt=case["cache_salt"],
        mm_features=[MMFeature(**item) for item in case["mm"]],
        as_bytes=as_bytes,
    )


def test_fixture_covers_every_algorithm() -> None:
    assert {case["algo"] for case in CASES} == set(HASH_ALGOS)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_none_hash_matches_vllm(case: dict) -> None:
    spec = HashSpec(case["algo"], case["PYTHONHASHSEED"], case["block_size"])
    assert spec.none_hash.hex() == case["none_hash_hex"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_block_digests_match_vllm(case: dict) -> None:
    digests = _hash_case(case, as_bytes=True)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_published_ints_match_vllm(case: dict) -> None:
    assert _hash_case(case, as_bytes=False) == case["block_hashes_int64"]


def test_unknown_algo_is_a_clear_value_error() -> None:
    with pytest.raises(UnknownHashAlgo, match=r"'md5'.*sha256") as excinfo:
        HashSpec("md5", None, 16)
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_seed_is_not_reproducible(algo: str) -> None:
    spec = HashSpec(algo, None, 16)
    assert spec.reproducible is False
    with pytest.raises(NotReproducible, match="PYTHONHASHSEED"):
        block_hashes(spec, range(32))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_without_seed_is_reproducible(algo: str) -> None:
    assert HashSpec(algo, None, 16).reproducible is True
    assert HashSpec("xxhash", "0", 16).reproducible is True


def test_partial_last_block_is_ignored() -> None:
    spec = HashSpec("sha256", None, 4)
    tokens = list(range(100, 111))
    full = block_hashes(spec, tokens[:8])
    assert len(full) == 2
    assert block_hashes(spec, tokens) == full
    assert block_hashes(spec, tokens[:3]) == []


@pytest.mark.parametrize("block_size", [0, -16])
def test_non_positive_block_size_is_rejected(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        HashSpec("sha256", None, block_size)


def test_integer_seed_is_rejected() -> None:
    with pytest.raises(TypeError, match="PYTHONHASHSEED"):
        HashSpec("sha256", 0, 16)  # type: ignore[arg-type]


def test_lora_name_without_path_is_rejected() -> None:
    with pytest.raises(ValueError, match="lora_path"):
        block_hashes(HashSpec("sha256", None, 4), range(8), lora_name="sql-adapter")


def test_empty_cache_salt_is_no_salt_as_in_vllm() -> None:
    spec = HashSpec("sha256", None, 4)
    assert block_hashes(spec, range(8), cache_salt="") == block_hashes(spec, range(8))
    assert block_hashes(spec, range(8), cache_salt="s") != block_hashes(spec, range(8))


def test_token_sequence_type_does_not_change_hashes() -> None:
    spec = HashSpec("sha256", "0", 4)
    tokens = [5, 70000, 3, 2**31 - 1, 9, 8, 7, 6]
    want = block_hashes(spec, tokens)
    assert block_hashes(spec, tuple(tokens)) == want
    assert block_hashes(spec, array("q", tokens)) == want


def test_sha256_needs_neither_xxhash_nor_cbor2() -> None:
    script = (
        "import sys\n"
        "from indexer.hashing import HashSpec, block_hashes\n"
        "assert block_hashes(HashSpec('sha256', None, 4), range(8))\n"
        "assert 'xxhash' not in sys.modules and 'cbor2' not in sys.modules, 'eager import'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
