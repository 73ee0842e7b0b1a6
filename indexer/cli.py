"""The ``kvindex`` command line: thin wrappers around the library."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from indexer.log import setup_logging

log = logging.getLogger("kvindex")


def _replay(args: argparse.Namespace) -> int:
    from indexer.replay import load_expected, load_trace, replay_report
    from indexer.stores import MemoryStore

    trace = load_trace(args.trace)
    expected = load_expected(args.probe) if args.probe else None
    report, stats = asyncio.run(replay_report(MemoryStore(), trace, expected))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    log.info(
        "replayed",
        extra={
            "batches": stats.batches,
            "block_ops": stats.block_ops,
            "seconds": round(stats.seconds, 4),
            "block_ops_per_s": round(stats.block_ops / max(stats.seconds, 1e-9)),
        },
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvindex", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default)")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="apply a recorded trace and print a JSON report")
    replay.add_argument("trace", help="TRACE.frames.msgpack: a msgpack array of [seq, payload]")
    replay.add_argument("--probe", metavar="EXPECTED.json", help="answer this file's probes")
    replay.set_defaults(run=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
