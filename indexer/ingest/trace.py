"""Replay a recorded trace (the fixtures' format) into a store.

A trace is a msgpack array of ``[seq, payload]``: every batch one engine rank
published. Replaying it is the quickest end-to-end check of decoding and the
residency model against vLLM's own answers, and a handy load source.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from indexer.core.events import MEDIA, RankId
from indexer.core.large_blocks import LargeBlocks
from indexer.core.matching import NO_MATCH
from indexer.engines import catalog
from indexer.kv_groups import KVGroup, large_blocks
from indexer.stores.base import Store, apply_events, match_chain

Trace = list[tuple[int, bytes]]
#: A trace whose payloads are views of the file (:func:`map_trace`) or bytes.
Payloads = Sequence[tuple[int, bytes | memoryview]]


class Probe(msgspec.Struct):
    """A prompt's block hashes and vLLM's own answer for it. In hybrid models
    ``gpu_tokens`` is the hit every group agrees on, and ``gpu_tokens_by_group``
    each group's own hit, in the engine's group order."""

    hashes: list[int | str]
    gpu_tokens: int | None = None
    cpu_prefix_tokens: int | None = None
    gpu_tokens_by_group: list[int] | None = None

    def answer(self, full_attention: int = 0) -> dict[str, int | None]:
        """vLLM's answer, in the shape of :func:`answer_probes`' answers; the
        full-attention groups' hit is the one of group ``full_attention``."""
        by_group = self.gpu_tokens_by_group
        return {
            "gpu_tokens": self.gpu_tokens,
            "cpu_prefix_tokens": self.cpu_prefix_tokens,
            "gpu_full_attention_tokens": by_group[full_attention] if by_group else self.gpu_tokens,
        }

    def matches(self, answer: dict[str, int], full_attention: int = 0) -> bool:
        """Whether ``answer`` agrees with vLLM's on every value the file states."""
        expected = self.answer(full_attention).items()
        return all(v is None or answer[k] == v for k, v in expected)


class TraceGroup(msgspec.Struct):
    kind: str
    block_size: int | None = None  # None: the engine's


class TraceEngine(msgspec.Struct):
    block_size: int
    blocks_per_chunk: int | None = None
    #: the model's KV groups in order (hybrid traces): which one is full attention
    groups: list[TraceGroup] = []
    #: the vLLM release that recorded the trace (None: the newest's rules)
    release: str | None = None

    @property
    def large_blocks(self) -> LargeBlocks | None:
        """The engine's shape if its groups' blocks span several hash blocks."""
        groups = [KVGroup(g.kind, None, g.block_size) for g in self.groups]
        return large_blocks(groups, self.block_size, self.blocks_per_chunk, self.release)

    @property
    def full_attention_group(self) -> int:
        """The position of the first full-attention group (0 for a model of one group):
        a model may list a sliding-window or Mamba group first."""
        kinds = [group.kind for group in self.groups]
        return kinds.index("full_attention") if "full_attention" in kinds else 0


class Expected(msgspec.Struct):
    """The parts of a fixture's ``EXPECTED.json`` that replay reads."""

    engine: TraceEngine
    probes: list[Probe] = []


def load_trace(path: str | Path) -> Trace:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=Trace)


#: msgpack's bin headers: the payload starts this many bytes into its encoding.
_BIN_HEADER = {0xC4: 2, 0xC5: 3, 0xC6: 5}


def map_trace(path: str | Path) -> list[tuple[int, memoryview]]:
    """:func:`load_trace` without copying: each payload a view of the file mapped in
    memory. Reading a 2M-block-op trace (145 MB) and copying each payload out of it
    took as long as decoding and applying the batches."""
    with open(path, "rb") as file:
        empty = not file.seek(0, 2)
        data = b"" if empty else mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    entries = msgspec.msgpack.decode(data, type=list[tuple[int, msgspec.Raw]])
    return [(seq, _bin_body(memoryview(raw))) for seq, raw in entries]


def _bin_body(encoded: memoryview) -> memoryview:
    header = _BIN_HEADER.get(encoded[0])
    if header is None:
        raise msgspec.ValidationError("a trace's payloads are msgpack bin")
    return encoded[header:]


def load_expected(path: str | Path) -> Expected:
    return msgspec.json.decode(Path(path).read_bytes(), type=Expected)


@dataclass(frozen=True, slots=True)
class ReplayStats:
    batches: int
    block_ops: int
    seconds: float


async def apply_trace(store: Store, rank: RankId, trace: Payloads) -> ReplayStats:
    """Decode and apply every batch of a trace in order, as one engine rank."""
    block_ops, started = 0, time.perf_counter()
    decode = catalog.adapter(catalog.DEFAULT).decode  # traces are recorded on its wire
    for seq, payload in trace:
        batch = decode(payload, tokens=False)
        block_ops += (await apply_events(store, rank, seq, batch)).block_ops
    return ReplayStats(len(trace), block_ops, time.perf_counter() - started)


async def answer_probes(
    store: Store, rank: RankId, engine: TraceEngine, probes: Sequence[Probe]
) -> list[dict[str, int]]:
    """vLLM's answers per probe: GPU hit tokens, CPU chunk-aligned tokens, and the
    full-attention groups' own GPU hit (vLLM's hit for a model that is not hybrid)."""
    answers = []
    size, shape = engine.block_size, engine.large_blocks
    chunk_blocks = {} if shape else {rank.engine: engine.blocks_per_chunk}
    shapes = {rank.engine: shape} if shape else {}
    for probe in probes:
        chain = [int(h) for h in probe.hashes]
        found = await match_chain(store, chain, chunk_blocks, shapes)
        match = found.get(rank, NO_MATCH)
        answers.append(
            {
                "gpu_tokens": match.gpu_blocks * size,
                "cpu_prefix_tokens": match.cpu_blocks * size,
                "gpu_full_attention_tokens": match.gpu_blocks_full_attention * size,
            }
        )
    return answers


async def replay_report(
    store: Store, trace: Payloads, expected: Expected | None, engine: str = "replay"
) -> tuple[dict, ReplayStats]:
    """Replay into ``store`` and build the ``kvindex replay`` JSON report."""
    rank = RankId(engine, 0)
    stats = await apply_trace(store, rank, trace)
    report: dict = {
        "blocks": await store.block_counts(rank),
        "anomalies": await store.anomalies(rank),
        "probes": [],
    }
    if expected is not None:
        report["probes"] = await answer_probes(store, rank, expected.engine, expected.probes)
    assert set(report["blocks"]) == set(MEDIA)
    return report, stats
