"""Block hashing must equal vLLM 0.33.0's bit for bit, or token-id lookups miss silently."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.engines.vllm import native
from indexer.engines.vllm.hashing import (
    HASH_ALGOS,
    HashSpec,
    MMFeature,
    NotReproducible,
    UnknownHashAlgo,
    block_hashes,
    published_ints,
)

from .conftest import FIXTURES, RELEASES
from .hash_cases import case_spec, hash_case

CASES = json.loads((FIXTURES / "hash_vectors.json").read_text())
REPO = Path(__file__).resolve().parents[1]
PROBES = [
    (path.name.removesuffix(".expected.json"), expected["engine"], probe)
    for folder in RELEASES.values()
    for path in sorted((folder / "traces").glob("*.expected.json"))
    for expected in [json.loads(path.read_text())]
    for probe in expected["probes"]
]
#: vLLM 0.33.0's lookahead hashes (tests/vllm_tier/lookahead_vectors.py wrote them).
LOOKAHEAD_CASES = json.loads(
    (REPO / "tests" / "fixtures" / "lookahead_hash_vectors.json").read_text()
)
#: block_hashes is the compiled core when it is built (tests/test_native.py fails the run
#: if not); the reference must keep agreeing with vLLM on its own.
reference_block_hashes = partial(block_hashes, compiled=False)
IMPLEMENTATIONS = {"compiled": block_hashes, "reference": reference_block_hashes}


def _case_id(case: dict) -> str:
    lookahead = case.get("lookahead_tokens", 0)
    return (
        f"{case['algo']}-seed={case['PYTHONHASHSEED']}-bs={case['block_size']}"
        f"-L={lookahead}-n={len(case['tokens'])}-{case['case']}"
    )


def test_fixture_covers_every_algorithm() -> None:
    assert {case["algo"] for case in CASES} == set(HASH_ALGOS)


def test_lookahead_fixture_covers_its_cases() -> None:
    """L = 1 and 3, each kind of extra keys, a lookahead past a block, and prompts whose
    last full block vLLM leaves unhashed (its lookahead tokens do not exist yet)."""
    kinds = {(c["lookahead_tokens"], c["case"]) for c in LOOKAHEAD_CASES}
    assert kinds >= {(n, k) for n in (1, 3) for k in ("plain", "lora", "mm", "lora+salt+mm")}
    assert any(c["lookahead_tokens"] > c["block_size"] for c in LOOKAHEAD_CASES)
    unhashed = [c for c in LOOKAHEAD_CASES if len(c["tokens"]) % c["block_size"] == 0]
    assert unhashed and all(
        len(c["block_hashes_hex"]) < len(c["tokens"]) // c["block_size"] for c in unhashed
    )


@pytest.mark.parametrize("case", CASES + LOOKAHEAD_CASES, ids=_case_id)
def test_none_hash_matches_vllm(case: dict) -> None:
    assert case_spec(case).none_hash.hex() == case["none_hash_hex"]


@pytest.mark.parametrize("hashes", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES + LOOKAHEAD_CASES, ids=_case_id)
def test_block_digests_match_vllm(case: dict, hashes) -> None:
    digests = hash_case(case, as_bytes=True, hashes=hashes)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]


@pytest.mark.parametrize("hashes", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES + LOOKAHEAD_CASES, ids=_case_id)
def test_published_ints_match_vllm(case: dict, hashes) -> None:
    assert hash_case(case, as_bytes=False, hashes=hashes) == case["block_hashes_int64"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_digests_convert_to_the_ints_vllm_publishes(
    case: dict, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a tokens query matches int-publishing engines with: digests, then ints."""
    if not compiled:
        monkeypatch.setattr(native, "chainhash", None)
    digests = [bytes.fromhex(d) for d in case["block_hashes_hex"]]
    assert published_ints(digests) == case["block_hashes_int64"]


@pytest.mark.parametrize("hashes", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS)
def test_trace_probe_prompts_hash_as_the_engine_hashed_them(hashes) -> None:
    assert len(PROBES) > 100
    for trace, engine, probe in PROBES:
        lookahead = engine.get("lookahead_tokens", 0)
        spec = HashSpec(engine["hash_algo"], None, engine["block_size"], lookahead)
        assert hashes(spec, probe["tokens"]) == probe["hashes"], trace


# --- the compiled core against the reference -----------------------------------

#: Where pickle and CBOR change how they encode an int, and past int64 (the compiled
#: code hands such blocks to the reference).
EDGE_TOKENS = [
    *(bound + d for bound in (0, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32) for d in (-1, 0)),
    *(-bound + d for bound in (24, 25, 256, 257, 65536, 2**31, 2**32, 2**63) for d in (0, 1)),
    *(bound + d for bound in (2**40, 2**63, 2**64) for d in (-1, 0)),
    -(2**63) - 1,
    True,  # not a plain int: vLLM would pickle it as a bool
]
tokens_st = st.lists(
    st.one_of(
        st.integers(0, 200_000),
        st.sampled_from(EDGE_TOKENS),
        st.integers(-(2**70), 2**70),
    ),
    max_size=160,
)
# Few names, so items and LoRA name/path often share one str object (pickle's memo).
names_st = st.sampled_from(["img-a", "img-b", "adapter", "salt", "h" * 300])
mm_st = st.lists(
    st.builds(MMFeature, names_st, st.integers(0, 150), st.integers(1, 40)), max_size=6
).map(lambda items: sorted(items, key=lambda item: item.offset))


@st.composite
def requests_st(draw) -> dict:
    lora = draw(st.none() | st.tuples(names_st, names_st | st.text(max_size=4)))
    return {
        "lora_name": lora and lora[0],
        "lora_path": lora and lora[1],
        "cache_salt": draw(st.none() | names_st | st.text(max_size=6)),
        "mm_features": draw(mm_st),
    }


@pytest.mark.parametrize("algo", HASH_ALGOS)
@settings(max_examples=150, deadline=None)
@given(
    tokens=tokens_st,
    block_size=st.integers(1, 40),
    seed=st.sampled_from(["0", "42", "-"]) | st.text(max_size=6),
    request=requests_st(),
    as_bytes=st.booleans(),
    lookahead=st.sampled_from([0, 0, 1, 3]) | st.integers(0, 50),
)
def test_compiled_core_hashes_as_the_reference(
    algo: str,
    tokens: list,
    block_size: int,
    seed: str,
    request: dict,
    as_bytes: bool,
    lookahead: int,
) -> None:
    spec = HashSpec(algo, seed, block_size, lookahead)
    want = reference_block_hashes(spec, tokens, as_bytes=as_bytes, **request)
    assert block_hashes(spec, tokens, as_bytes=as_bytes, **request) == want


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("block_size", range(13_094, 13_104))
def test_blocks_around_one_pickle_frame_hash_as_the_reference(
    algo: str, block_size: int, lookahead: int
) -> None:
    """The pickler closes a frame at 64 KiB; a 5-byte-per-token block crosses it here
    (two lookahead tokens 10 bytes earlier)."""
    spec = HashSpec(algo, "0", block_size, lookahead)
    tokens = list(range(100_000, 100_000 + 2 * block_size + lookahead))
    assert block_hashes(spec, tokens) == reference_block_hashes(spec, tokens)


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("repeated", [125, 126, 127, 128])
def test_a_repeat_far_into_the_pickle_memo_hashes_as_the_reference(
    algo: str, repeated: int
) -> None:
    """An item naming the same object as an earlier one pickles as a memo reference; its
    slot moves by two inside the block and needs four bytes from slot 256 on."""
    items = [MMFeature(f"image-{n}", n, 1) for n in range(200)]
    items.append(MMFeature(items[repeated].identifier, 200, 1))
    spec = HashSpec(algo, "0", 256)
    tokens = list(range(512))
    want = reference_block_hashes(spec, tokens, mm_features=items)
    assert block_hashes(spec, tokens, mm_features=items) == want


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


def test_lookahead_leaves_out_the_blocks_whose_next_tokens_are_missing() -> None:
    """vLLM hashes a block once the L tokens after it exist: 8 tokens in blocks of 4
    with L = 1 give one hash, and the second once a ninth token follows."""
    spec = HashSpec("sha256", None, 4, 1)
    assert len(block_hashes(spec, range(8))) == 1
    assert len(block_hashes(spec, range(9))) == 2
    assert block_hashes(spec, range(9))[0] == block_hashes(spec, range(8))[0]
    assert block_hashes(spec, range(4)) == []
    assert block_hashes(spec, range(9))[0] != block_hashes(HashSpec("sha256", None, 4), range(9))[0]


@pytest.mark.parametrize(("lookahead", "error"), [(-1, ValueError), (True, TypeError)])
def test_a_lookahead_that_is_no_count_is_rejected(lookahead: int, error: type) -> None:
    with pytest.raises(error, match="lookahead_tokens"):
        HashSpec("sha256", None, 16, lookahead)


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
        "from indexer.engines.vllm.hashing import HashSpec, block_hashes\n"
        "assert block_hashes(HashSpec('sha256', None, 4), range(8))\n"
        "assert 'xxhash' not in sys.modules and 'cbor2' not in sys.modules, 'eager import'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
