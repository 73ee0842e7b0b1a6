"""vLLM 0.34's offloading connector in its own traces (tests/fixtures/vllm-0.34.0):
Mamba checkpoints and EAGLE lookahead stores on the CPU tier, a storage tier below it,
and kvindex answering their probes as vLLM's own lookup does, by tokens and by hashes."""

from __future__ import annotations

import pytest

from indexer.core.events import CPU, STORAGE, BlockStored

from .api_cases import check_trace_probes
from .conftest import (
    LOOKAHEAD_TRACE_NAMES,
    STORAGE_TRACE_NAMES,
    load_expected_json,
    trace_batches,
)

OFFLOAD_TRACE_NAMES = ("0.34.0/mamba-offload", *LOOKAHEAD_TRACE_NAMES, *STORAGE_TRACE_NAMES)


def cpu_stores(name: str, group: int, medium: str = CPU) -> list[BlockStored]:
    return [
        e
        for batch in trace_batches(name)
        for e in batch.events
        if type(e) is BlockStored and e.medium == medium and (e.group_idx or 0) == group
    ]


def test_a_mamba_chunk_on_the_cpu_is_one_self_describing_checkpoint() -> None:
    """The chunk's last hash, chained to the hash before it, no tokens, its block size,
    kind "mamba": the state at the end of a chunk the full-attention group stored too."""
    chunks = {tuple(e.block_hashes[-2:]) for e in cpu_stores("0.34.0/mamba-offload", 0)}
    checkpoints = cpu_stores("0.34.0/mamba-offload", 1)
    assert len(checkpoints) > 10
    for event in checkpoints:
        assert event.kv_cache_spec_kind == "mamba" and event.block_size == 16
        assert event.token_ids == [] and len(event.block_hashes) == 1
        assert (event.parent_block_hash, event.block_hashes[0]) in chunks


def test_an_eagle_engines_cpu_stores_carry_each_blocks_lookahead() -> None:
    """Each block's hash covers the token after it: the store says which, one list per
    hash (inside the chunk, the next block's first token)."""
    expected = load_expected_json("0.34.0/eagle-offload")
    lookahead = expected["engine"]["lookahead_tokens"]
    assert lookahead == 1
    stores = cpu_stores("0.34.0/eagle-offload", 0)
    assert len(stores) > 10
    for event in stores:
        after = event.lookahead_token_ids
        assert after is not None and len(after) == len(event.block_hashes) == 4
        assert all(len(tokens) == lookahead for tokens in after)
        assert after[:-1] == [[event.token_ids[(i + 1) * 16]] for i in range(len(after) - 1)]


def test_storage_stores_are_built_from_the_request_context() -> None:
    """vLLM 0.34 describes a chunk its file-system tier stored as the CPU tier's: every
    per-block hash, chained, with the chunk's tokens (0.33: its end hash, block size 0);
    the tier keeps chunks the CPU tier evicted, and vLLM's lookup finds them there."""
    (name,) = STORAGE_TRACE_NAMES
    stores = cpu_stores(name, 0, STORAGE)
    assert len(stores) > 10
    on_cpu = {tuple(e.block_hashes): e for e in cpu_stores(name, 0)}
    for event in stores:
        assert len(event.block_hashes) == 4 and event.block_size == 16
        assert len(event.token_ids) == 64
        cpu = on_cpu[tuple(event.block_hashes)]  # cascaded from the CPU tier
        assert (cpu.parent_block_hash, cpu.token_ids) == (event.parent_block_hash, event.token_ids)
    probes = load_expected_json(name)["probes"]
    assert any(p["storage_prefix_tokens"] > p["cpu_prefix_tokens"] for p in probes)


#: 0.34's traces with a CPU tier, whose probes hold vLLM's own lookup after the GPU hit
PREFIX_TRACE_NAMES = tuple(f"0.34.0/chat-{n}" for n in ("sha256", "placeholders", "clear"))


@pytest.mark.parametrize("name", PREFIX_TRACE_NAMES + OFFLOAD_TRACE_NAMES)
async def test_offload_traces_answer_like_vllm_by_tokens_and_by_hashes(name: str) -> None:
    """vLLM's GPU hit and its own lookup (the connector's) per probe: of its CPU tier
    (and storage tier) from token 0, and after the GPU hit (which loads nothing shorter
    than a chunk)."""
    await check_trace_probes(name)
