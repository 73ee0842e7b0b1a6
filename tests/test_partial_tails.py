"""Partial tails (issue 35 item 5): a hybrid Mamba model with blocks of 64 tokens hashed
every 16 (``--prefix-match-unit 16``) and the offloading connector at one block per
chunk, in vLLM's own traces (``mamba-partial-tail``, 0.34.0's and 0.33.0's).

What vLLM publishes is pinned here; kvindex does not map it yet (docs/vllm.md, "Not
covered yet"): the last test holds vLLM's answers to its probes and fails until it does.
"""

from __future__ import annotations

import pytest

from indexer.core.events import CPU, GPU, BlockStored
from indexer.engines.vllm.hashing import HashSpec, block_hashes

from .api_cases import check_trace_probes
from .conftest import load_expected_json, trace_batches

TAIL_TRACE_NAMES = ("0.34.0/mamba-partial-tail", "0.33.0-extra/mamba-partial-tail")
UNIT, BLOCK = 16, 64  # tokens per hash, per KV cache block (and per CPU chunk)


def stores(name: str, medium: str, group: int) -> list[BlockStored]:
    return [
        e
        for batch in trace_batches(name)
        for e in batch.events
        if type(e) is BlockStored and e.medium == medium and (e.group_idx or 0) == group
    ]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_the_engine_hashes_every_16_tokens_in_blocks_of_64(name: str) -> None:
    engine = load_expected_json(name)["engine"]
    assert engine["block_size"] == UNIT and engine["blocks_per_chunk"] == 1
    assert [g["block_size"] for g in engine["groups"]] == [BLOCK, BLOCK]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_one_group_publishes_blocks_of_64_and_of_16_on_the_gpu(name: str) -> None:
    """A full block: one hash per 64 tokens, the 16-token chain's hash at the block's
    end. A prompt ending inside a block: one hash and the last 16 tokens (a partial
    entry of the block, removed when the block fills)."""
    spec = HashSpec("sha256", None, UNIT)
    full = [e for e in stores(name, GPU, 0) if e.block_size == BLOCK]
    partial = [e for e in stores(name, GPU, 0) if e.block_size == UNIT]
    assert len(full) > 20 and len(partial) > 20
    assert {len(e.block_hashes) for e in partial} == {1}
    assert {len(e.token_ids) for e in partial} == {UNIT}
    for event in full:
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        if event.parent_block_hash is None:
            chain = block_hashes(spec, event.token_ids)
            assert event.block_hashes == chain[BLOCK // UNIT - 1 :: BLOCK // UNIT]


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_a_partial_tail_on_the_cpu_lists_the_hashes_up_to_its_boundary(name: str) -> None:
    """Full attention: a tail of n 16-token units is one store of ``block_size`` 16, n
    hashes and 16n tokens (n < 4); a whole chunk one of ``block_size`` 64. Mamba: one
    checkpoint, the boundary's hash (0.34: ``block_size`` 16 or 64; 0.33: 0)."""
    sizes = {(e.block_size, len(e.block_hashes), len(e.token_ids)) for e in stores(name, CPU, 0)}
    assert sizes == {(UNIT, 1, 16), (UNIT, 2, 32), (UNIT, 3, 48), (BLOCK, 1, 64)}
    mamba = {(e.block_size, len(e.block_hashes), len(e.token_ids)) for e in stores(name, CPU, 1)}
    assert mamba == ({(UNIT, 1, 0), (BLOCK, 1, 0)} if name.startswith("0.34") else {(0, 1, 0)})


@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
def test_vllm_loads_partial_tails_from_the_cpu(name: str) -> None:
    """Probes whose CPU hit ends inside a block (vLLM's own lookup), and GPU hits that
    do (the partial entries)."""
    probes = load_expected_json(name)["probes"]
    assert sum(p["cpu_prefix_tokens"] % BLOCK != 0 for p in probes) >= 10
    assert sum(p["gpu_tokens"] % BLOCK != 0 for p in probes) >= 10


@pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="issue 35 item 5: kvindex does not map them"
)
@pytest.mark.parametrize("name", TAIL_TRACE_NAMES)
async def test_partial_tail_traces_answer_like_vllm_by_tokens_and_by_hashes(name: str) -> None:
    """vLLM's GPU hit and its own CPU lookup, from token 0 and after the GPU hit."""
    await check_trace_probes(name)
