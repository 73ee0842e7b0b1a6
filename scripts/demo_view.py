"""What ``scripts/demo.sh`` shows: prompts to ask about, answers as tables, live progress.

Standard library only, so the demo needs nothing but the venv's Python and curl.

- ``tokens SERVED_JSON ENGINE [--extend N]``: the last prompt ``ENGINE``
  served (from ``kvindex sim --samples``), optionally followed by ``N`` new
  tokens (the next turn of the conversation), comma-separated.
- ``random N``: ``N`` tokens no engine has seen.
- ``table``: a ``/prefix-match`` JSON answer on stdin, as a table.
- ``progress API``: one status line, refreshed every second, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.request


def unseen(n: int) -> list[int]:
    return [random.randrange(32000) for _ in range(n)]


def tokens(served: str, engine: str, extend: int) -> list[int]:
    with open(served) as f:
        return json.load(f)[engine][-1] + unseen(extend)


def table(answer: dict) -> str:
    rows = [("engine", "dp", "GPU", "CPU", "STORAGE", "routed", "prefix tokens", "score", "")]
    rows += [
        (
            e["engine"],
            e["dp_rank"],
            e["gpu_blocks"],
            e["cpu_blocks"],
            e["storage_blocks"],
            e["routed_blocks"],
            e["prefix_tokens"],
            e["score"],
            "approximate" if e["approximate"] else "degraded" if e["degraded"] else "",
        )
        for e in answer["engines"]
    ]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    blocks = f"prompt: {answer['num_blocks']} full blocks of {answer['block_size']} tokens"
    legend = "(blocks per tier; routed: GPU or routed there, not yet confirmed; best score first)"
    return "\n".join([blocks, *lines, legend])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def progress(api: str) -> None:
    applied = re.compile(rb"^kvindex_ingest_batches_total\{.*\} (\S+)$", re.M)
    while True:
        stats = json.loads(_get(f"{api}/stats"))
        batches = sum(float(n) for n in applied.findall(_get(f"{api}/metrics")))
        blocks = "  ".join(f"{m} {n}" for m, n in stats["blocks"].items())
        sys.stdout.write(
            f"\rbatches applied {batches:.0f}  engines {stats['engines']}"
            f" ({stats['connected_ranks']}/{stats['registered_ranks']} ranks connected)"
            f"  blocks: {blocks}   "
        )
        sys.stdout.flush()
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("tokens")
    cmd.add_argument("served")
    cmd.add_argument("engine")
    cmd.add_argument("--extend", type=int, default=0)
    commands.add_parser("random").add_argument("n", type=int)
    commands.add_parser("table")
    commands.add_parser("progress").add_argument("api")
    args = parser.parse_args()
    if args.command == "tokens":
        print(",".join(map(str, tokens(args.served, args.engine, args.extend))))
    elif args.command == "random":
        print(",".join(map(str, unseen(args.n))))
    elif args.command == "table":
        print(table(json.load(sys.stdin)))
    else:
        try:
            progress(args.api)
        except KeyboardInterrupt:
            print()


if __name__ == "__main__":
    main()
