"""The ``kvindex`` command line: thin wrappers around the library."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING

from indexer.log import setup_logging

if TYPE_CHECKING:
    from indexer.replay import Expected, ReplayStats, Trace

log = logging.getLogger("kvindex")


def _replay(args: argparse.Namespace) -> int:
    from indexer.replay import load_expected, load_trace
    from indexer.stores import StoreUnavailable

    trace = load_trace(args.trace)
    expected = load_expected(args.probe) if args.probe else None
    try:
        report, stats = asyncio.run(_replay_into_store(args, trace, expected))
    except StoreUnavailable as e:
        log.error("cannot replay", extra={"error": str(e)})
        return 1
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


REPLAY_ENGINE = "replay"


async def _replay_into_store(
    args: argparse.Namespace, trace: Trace, expected: Expected | None
) -> tuple[dict, ReplayStats]:
    """Replay into the embedded store, or into Redis after forgetting an earlier replay."""
    from indexer.model import RankId
    from indexer.replay import replay_report
    from indexer.stores import MemoryStore
    from indexer.stores.redis import RedisConfig, RedisStore

    if not args.redis_url:
        return await replay_report(MemoryStore(), trace, expected, REPLAY_ENGINE)
    config = RedisConfig(args.redis_url, args.redis_prefix, args.redis_cluster, sweep_interval=None)
    store = RedisStore(config)
    try:
        await store.forget(RankId(REPLAY_ENGINE, 0))
        return await replay_report(store, trace, expected, REPLAY_ENGINE)
    finally:
        await store.close()


def _serve(args: argparse.Namespace) -> int:
    import zmq

    from indexer.engines import EngineExists
    from indexer.serve import ConfigError, ServeConfig, load_config, serve

    try:
        config = load_config(args.config) if args.config else ServeConfig()
        asyncio.run(
            serve(config, args.engine, host=args.host, port=args.port, redis_url=args.redis_url)
        )
    except EngineExists as e:
        problem = f"engine {e.args[0]!r} is declared twice"
    except (ConfigError, OSError, zmq.ZMQError) as e:
        problem = str(e)
    else:
        return 0
    log.error("cannot serve", extra={"error": problem})
    return 1


def _engine_flag(text: str):
    from indexer.engines import parse_engine_flag

    try:
        return parse_engine_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvindex", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default)")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="apply a recorded trace and print a JSON report")
    replay.add_argument("trace", help="TRACE.frames.msgpack: a msgpack array of [seq, payload]")
    replay.add_argument("--probe", metavar="EXPECTED.json", help="answer this file's probes")
    replay.add_argument("--redis-url", help="replay into Redis (redis://, rediss://, unix://)")
    replay.add_argument(
        "--redis-prefix", default="kvindex-replay", help="key prefix (default kvindex-replay)"
    )
    replay.add_argument("--redis-cluster", action="store_true", help="the URL names a cluster node")
    replay.set_defaults(run=_replay)

    serve = commands.add_parser("serve", help="consume engines' KV events and serve the HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0: any)")
    serve.add_argument("--redis-url", help="use the Redis store at this URL (default: embedded)")
    serve.add_argument("--config", metavar="FILE", help="YAML or TOML (.toml) config file")
    serve.add_argument(
        "--engine",
        action="append",
        default=[],
        type=_engine_flag,
        metavar="NAME=ENDPOINT[,FIELD=VALUE...]",
        help="an engine to follow, e.g. a=tcp://host:5557,replay_endpoint=tcp://host:5558"
        " (repeatable; fields as in the config file)",
    )
    serve.set_defaults(run=_serve)

    from producer import simcli

    sim = commands.add_parser("sim", help="run simulated engines publishing KV events")
    simcli.add_arguments(sim)
    sim.set_defaults(run=simcli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
