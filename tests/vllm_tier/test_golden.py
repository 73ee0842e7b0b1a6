"""The golden wire batches and hash vectors of this venv's vLLM release are what its
own code writes (:mod:`tests.vllm_tier.golden_vectors`): 0.33.0's in ../shared, later
releases' in tests/fixtures. The main suite checks kvindex against those files."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from tests.vllm_tier.golden_vectors import BASE, hash_vectors_text, wire_files

RELEASE = version("vllm")
HERE = BASE if RELEASE == "0.33.0" else Path(__file__).parents[1] / "fixtures" / f"vllm-{RELEASE}"


@pytest.fixture(scope="module")
def written() -> dict[str, bytes]:
    return {**wire_files(), "hash_vectors.json": hash_vectors_text().encode()}


def test_every_wire_batch_and_hash_vector_is_this_releases_own(written) -> None:
    assert set(written) >= {"hash_vectors.json", "wire/gpu_store_remove_clear.msgpack"}
    for name, data in written.items():
        assert (HERE / name).read_bytes() == data, name
