"""Item 16's production workload: a Mooncake-format trace replayed open loop.

The format (Mooncake's FAST'25 trace release; ``../shared/traces/README.md``): one JSON
object a line, ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
the prompt's blocks (512 tokens each in the original), equal ids being the same block.
Any file in that format replays, so a user can bring theirs.

Its sharing lies far apart in time (the conversation trace's first 500 requests can reuse
at most 18% of their blocks, the whole hour 37%), so a window of it shows almost no reuse.
Instead whole sessions are sampled (a session: the requests sharing their first two ids;
every request of the conversation trace shares the first) and time is compressed: the
sampled requests keep the trace's order and relative arrival times, scaled to one request
a second (:func:`bench.routing.traffic.at_rate` scales that to a rung's rate).

Each id becomes a fixed block of :data:`BLOCK_WORDS` words (about one 32-token block of
the tiny model: the same id always the same words, so vLLM's prefix cache sees the same
sharing); a request's last block is cut as its ``input_length`` says. Prompts are cut to
:data:`MAX_BLOCKS` blocks (the engines' context is 2,048 tokens), outputs scaled like the
blocks (1/16) within :data:`OUTPUT_TOKENS`. The reuse bound of what is replayed (block
references to an id seen before, over all references: what a cache of unlimited size
could serve) goes into the report.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

from bench.routing.traffic import Request, Workload
from tests.real_server.tiny_model import WORDS

TRACE = Path(__file__).resolve().parents[3] / "shared/traces/mooncake-conversation.jsonl"
ORIGINAL_BLOCK = 512
BLOCK_WORDS = 11
MAX_BLOCKS = 40
SCALE = 16  # 512-token blocks replayed as 32-token ones
OUTPUT_TOKENS = (4, 48)


def read(path: Path) -> list[dict]:
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def sessions(rows: list[dict]) -> list[list[dict]]:
    """The trace's requests by session (their first two ids), each in arrival order."""
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["timestamp"]):
        by_key[tuple(row["hash_ids"][:2])].append(row)
    return list(by_key.values())


def block_text(block: int, words: int = BLOCK_WORDS) -> str:
    rng = random.Random(block)
    return " ".join(rng.choices(WORDS, k=words)) + " "


def prompt(row: dict) -> str:
    ids = row["hash_ids"][:MAX_BLOCKS]
    last = row["input_length"] - ORIGINAL_BLOCK * (len(row["hash_ids"]) - 1)
    words = [BLOCK_WORDS] * len(ids)
    if len(ids) == len(row["hash_ids"]) and 0 < last < ORIGINAL_BLOCK:
        words[-1] = max(1, round(BLOCK_WORDS * last / ORIGINAL_BLOCK))
    return "".join(block_text(b, w) for b, w in zip(ids, words, strict=True))


def reuse_bound(rows: list[dict]) -> float:
    """The share of block references (as replayed) to an id an earlier request had."""
    seen: set[int] = set()
    hits = total = 0
    for row in rows:
        for block in row["hash_ids"][:MAX_BLOCKS]:
            hits += block in seen
            total += 1
            seen.add(block)
    return hits / total if total else 0.0


def sample(path: Path, requests: int, seed: int = 36) -> Workload:
    """Whole sessions drawn at random until ``requests`` requests, time compressed to one
    request a second."""
    pool = sessions(read(path))
    random.Random(seed).shuffle(pool)
    chosen: list[dict] = []
    for session in pool:
        if len(chosen) >= requests:
            break
        chosen.extend(session)
    chosen.sort(key=lambda r: r["timestamp"])
    first, last = chosen[0]["timestamp"], chosen[-1]["timestamp"]
    per_second = (len(chosen) - 1) / ((last - first) / 1000) if last > first else 1.0
    low, high = OUTPUT_TOKENS
    out = tuple(
        Request(
            f"s{i}",
            (row["timestamp"] - first) / 1000 * per_second,
            ({"role": "user", "content": prompt(row)},),
            min(high, max(low, row["output_length"] // SCALE)),
        )
        for i, row in enumerate(chosen)
    )
    about = {
        "trace": str(path),
        "sessions": len({tuple(r["hash_ids"][:2]) for r in chosen}),
        "time_compressed_at_1_rps": round(1 / per_second),
        "reuse_bound": round(reuse_bound(chosen), 3),
    }
    return Workload("trace", out, about)
