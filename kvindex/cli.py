"""The ``kvindex`` command line: thin wrappers around the library."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING, NoReturn

import msgspec

from indexer.log import setup_logging

if TYPE_CHECKING:
    from api.settings import ApiSettings
    from indexer.ingest.trace import Expected, ReplayStats, Trace
    from indexer.stores.redis import RedisConfig
    from kvindex.config import ServeConfig

log = logging.getLogger("kvindex")


def _replay(args: argparse.Namespace) -> int:
    from indexer.ingest.trace import load_expected, load_trace
    from indexer.stores import StoreUnavailable
    from indexer.stores.redis import RedisConfig

    redis = None
    if args.redis_url:
        try:
            redis = RedisConfig(
                args.redis_url, args.redis_prefix, args.redis_cluster, sweep_interval=None
            )
        except ValueError as e:
            return _cannot(args, str(e))
    trace = load_trace(args.trace)
    expected = load_expected(args.probe) if args.probe else None
    try:
        report, stats = asyncio.run(_replay_into_store(redis, trace, expected))
    except StoreUnavailable as e:
        return _cannot(args, str(e))
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
    redis: RedisConfig | None, trace: Trace, expected: Expected | None
) -> tuple[dict, ReplayStats]:
    """Replay into the embedded store, or into Redis after forgetting an earlier replay."""
    from indexer.core.events import RankId
    from indexer.ingest.trace import replay_report
    from indexer.stores import MemoryStore
    from indexer.stores.redis import RedisStore

    if redis is None:
        return await replay_report(MemoryStore(), trace, expected, REPLAY_ENGINE)
    store = RedisStore(redis)
    try:
        await store.forget(RankId(REPLAY_ENGINE, 0))
        return await replay_report(store, trace, expected, REPLAY_ENGINE)
    finally:
        await store.close()


def _cannot(args: argparse.Namespace, problem: str, code: int = 1) -> int:
    """Say in one line on stderr why the command cannot run; its exit code."""
    print(f"kvindex {args.command}: {problem}", file=sys.stderr)
    return code


def _service(args: argparse.Namespace) -> int:
    """Run ``serve``, ``indexer`` or ``api``: 1 with the reason on stderr if it cannot
    run, 2 if it would run with the engine registry open to anyone."""
    import zmq

    from indexer.registry import EngineExists
    from indexer.stores import StoreUnavailable
    from kvindex.config import ConfigError, OpenDoor, ServeConfig, load_config

    try:
        config = load_config(args.config) if args.config else ServeConfig()
        redis = config.redis_config(
            args.redis_url, cluster=args.redis_cluster, prefix=args.redis_prefix
        )
        ok = asyncio.run(args.service(args, config, redis))
    except EngineExists as e:
        return _cannot(args, f"engine {e.args[0]!r} is declared twice")
    except OpenDoor as e:
        return _cannot(args, str(e), 2)
    except (ConfigError, OSError, zmq.ZMQError, StoreUnavailable) as e:
        return _cannot(args, str(e))
    return 0 if ok is not False else 1


def _http_settings(args: argparse.Namespace, config: ServeConfig) -> ApiSettings:
    """The API's settings with the token resolved; refused (``OpenDoor``) if a
    non-loopback listener would have none, unless ``--insecure-no-auth``."""
    from kvindex.config import refuse_open_door, resolve_auth_token

    settings = resolve_auth_token(config.api_settings(), args.auth_token_file)
    if not args.insecure_no_auth:
        refuse_open_door(args.host, settings)
    elif settings.auth_token is None:
        log.warning("POST/DELETE /engines need no token", extra={"host": args.host})
    return settings


async def _serve(args: argparse.Namespace, config: ServeConfig, redis: RedisConfig | None) -> None:
    from kvindex.serve import serve

    settings = _http_settings(args, config)
    await serve(config, args.engine, host=args.host, port=args.port, redis=redis, settings=settings)


def _needs_redis(args: argparse.Namespace, redis: RedisConfig | None) -> RedisConfig:
    from kvindex.config import ConfigError

    if redis is None:
        raise ConfigError(f"kvindex {args.command} shares state through Redis: give --redis-url")
    return redis


async def _indexer(
    args: argparse.Namespace, config: ServeConfig, redis: RedisConfig | None
) -> bool:
    from kvindex.processes import run_indexer

    if args.lease_ttl is not None:
        config = msgspec.structs.replace(
            config, indexer=msgspec.structs.replace(config.indexer, lease_ttl=args.lease_ttl)
        )
    metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
    return await run_indexer(
        config,
        _needs_redis(args, redis),
        args.engine,
        worker_id=args.worker_id,
        metrics=metrics,
    )


async def _api(args: argparse.Namespace, config: ServeConfig, redis: RedisConfig | None) -> None:
    from kvindex.processes import run_api

    redis = _needs_redis(args, redis)
    settings = _http_settings(args, config)
    await run_api(config, redis, host=args.host, port=args.port, settings=settings)


def _engine_flag(text: str):
    from indexer.registry import parse_engine_flag

    try:
        return parse_engine_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port(text: str) -> int:
    """A TCP port for a flag (the socket module raises OverflowError, not a usage error)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def _add_redis_flags(parser: argparse.ArgumentParser, url_help: str, prefix: str | None) -> None:
    parser.add_argument("--redis-url", help=url_help)
    parser.add_argument(
        "--redis-cluster", action="store_true", help="the URL names a Redis Cluster node"
    )
    parser.add_argument(
        "--redis-prefix",
        default=prefix,
        help=f"key prefix, so indexes can share a Redis (default {prefix or 'kvindex'})",
    )


def _add_engine_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        type=_engine_flag,
        metavar="NAME=ENDPOINT[,FIELD=VALUE...]",
        help=f"{what}, e.g. a=tcp://host:5557,replay_endpoint=tcp://host:5558"
        " (repeatable; fields as in the config file)",
    )


def _add_http_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000; 0: any)")
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="file holding the bearer token POST/DELETE /engines require"
        " (else $KVINDEX_AUTH_TOKEN, then api.auth_token_file or api.auth_token)",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback --host without a token: anyone who reaches it"
        " can register and remove engines (refused otherwise)",
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (argparse prints the whole usage first, which
    buries the one line that says what is wrong)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvindex", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default)")
    commands = parser.add_subparsers(dest="command", required=True)

    replay = commands.add_parser("replay", help="apply a recorded trace and print a JSON report")
    replay.add_argument("trace", help="TRACE.frames.msgpack: a msgpack array of [seq, payload]")
    replay.add_argument("--probe", metavar="EXPECTED.json", help="answer this file's probes")
    _add_redis_flags(
        replay, "replay into Redis (redis://, rediss://, unix://)", prefix="kvindex-replay"
    )
    replay.set_defaults(run=_replay)

    serve = commands.add_parser(
        "serve", help="one process: consume engines' KV events and serve the HTTP API"
    )
    _add_http_flags(serve)
    _add_redis_flags(serve, "use the Redis store at this URL (default: embedded)", prefix=None)
    serve.add_argument("--config", metavar="FILE", help="YAML or TOML (.toml) config file")
    _add_engine_flag(serve, "an engine to follow")
    serve.set_defaults(run=_service, service=_serve)

    indexer = commands.add_parser(
        "indexer", help="a worker: consume its share of the engines into Redis (scale-out)"
    )
    _add_redis_flags(indexer, "the shared Redis (required, or a redis config section)", None)
    indexer.add_argument("--config", metavar="FILE", help="YAML or TOML (.toml) config file")
    _add_engine_flag(indexer, "an engine to register if it is not yet")
    indexer.add_argument("--worker-id", help="unique name (default: host-pid-random)")
    indexer.add_argument(
        "--lease-ttl", type=float, help="seconds a dead worker's engines wait (default 6)"
    )
    indexer.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on this port")
    indexer.add_argument(
        "--metrics-host", default="127.0.0.1", help="metrics address (default 127.0.0.1)"
    )
    indexer.set_defaults(run=_service, service=_indexer)

    api = commands.add_parser(
        "api", help="an HTTP API replica over the shared Redis (scale-out; stateless)"
    )
    _add_http_flags(api)
    _add_redis_flags(api, "the shared Redis (required, or a redis config section)", None)
    api.add_argument("--config", metavar="FILE", help="YAML or TOML (.toml) config file")
    api.set_defaults(run=_service, service=_api)

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
