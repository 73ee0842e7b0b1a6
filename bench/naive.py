"""The naive consumer: what one writes first to follow vLLM's events.

Untyped ``msgspec.msgpack.decode`` and one dict of counts keyed by (rank,
medium, hash). It imports nothing but msgspec, so that run as a process
(``python -m bench.naive TRACE``) it pays what such a script pays and no more.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import msgspec


def naive(stream: Iterable[tuple[object, int, bytes]]) -> dict:
    """Count ``(rank, seq, payload)`` batches' blocks; the counts."""
    counts: dict[tuple, int] = {}
    decode = msgspec.msgpack.decode
    for rank, _, payload in stream:
        for event in decode(payload)[1]:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                for key in [k for k in counts if k[0] == rank and k[1] == "GPU"]:
                    del counts[key]
                continue
            medium = (event.get("medium") or "GPU").upper()
            for h in event["block_hashes"]:
                key = (rank, medium, h)
                n = counts.get(key, 0)
                if kind == "BlockStored":
                    counts[key] = n + 1
                elif n > 1:
                    counts[key] = n - 1
                elif n == 1:
                    del counts[key]
    return counts


def main(path: str) -> None:
    """Follow a recorded trace (``[[seq, payload], ...]``) as one rank; print the entries."""
    trace = msgspec.msgpack.decode(Path(path).read_bytes())
    print(len(naive((0, seq, payload) for seq, payload in trace)))


if __name__ == "__main__":
    main(sys.argv[1])
