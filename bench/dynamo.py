"""NVIDIA Dynamo's radix-tree KV indexer, as a reference, through its Python binding.

``dynamo._core.RadixTree`` (PyPI ``ai-dynamo-runtime``) is Dynamo's router
index: one tree of block hashes per fleet, workers on its nodes. It takes
Dynamo's own ``KvCacheEvent`` JSON, so the fleet's events are converted
once, outside any timed region; what is timed is ``apply_event`` and
``find_matches`` (with reading ``.scores``), each a call through PyO3. Its
per-call cost is therefore the binding's (argument conversion, JSON parsing,
building the Python result), not what its Rust core costs inside a Rust
router.

Dynamo indexes one tier per worker, so each engine rank's medium becomes a
worker of its own. Its tree needs a stored block's parent to be present and
a removed block to be known; events it refuses (a parent evicted first, a
chunk offloaded after its predecessor left CPU) raise and are counted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import msgspec

from indexer.core.events import AllBlocksCleared, BlockStored, RankId, normalise_medium
from indexer.engines.vllm.wire import decode_batch

os.environ.setdefault("DYN_LOG", "error")  # its tracing logs every refused event otherwise

try:
    from dynamo._core import RadixTree
except ImportError:  # the bench extra is not installed
    RadixTree = None

_encode = msgspec.json.encode


def available() -> bool:
    return RadixTree is not None


def convert(stream: Iterable[tuple[RankId, int, bytes]]) -> list[tuple[int, bytes]]:
    """The fleet's payloads as ``(worker id, KvCacheEvent JSON)``, event by event."""
    workers: dict[tuple[RankId, str], int] = {}
    out = []
    for rank, seq, payload in stream:
        for event in decode_batch(payload).events:
            if type(event) is AllBlocksCleared:
                medium, data = "GPU", "cleared"
            else:
                medium = normalise_medium(event.medium)
                data = _data(event)
            worker = workers.setdefault((rank, medium), len(workers))
            out.append((worker, _encode({"event_id": seq, "data": data})))
    return out


def _data(event) -> dict:
    if type(event) is BlockStored:
        blocks = [{"block_hash": h, "tokens_hash": h} for h in event.block_hashes]
        return {"stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}}
    return {"removed": {"block_hashes": list(event.block_hashes)}}


def block_ops(events: Sequence[tuple[int, bytes]]) -> int:
    return sum(len(e.get("blocks", e.get("block_hashes", ()))) for e in _bodies(events))


def _bodies(events: Sequence[tuple[int, bytes]]) -> Iterable[dict]:
    for _, raw in events:
        data = msgspec.json.decode(raw)["data"]
        if isinstance(data, dict):
            yield next(iter(data.values()))


class Tree:
    """A RadixTree and the events it refused."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self.refused = 0

    def apply(self, events: Sequence[tuple[int, bytes]]) -> None:
        apply, refused = self.tree.apply_event, 0
        for worker, raw in events:
            try:
                apply(worker, raw)
            except RuntimeError:
                refused += 1
        self.refused += refused

    def find(self, chain: Sequence[int]) -> dict:
        return self.tree.find_matches(chain).scores
