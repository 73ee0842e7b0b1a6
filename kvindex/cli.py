"""The kvindex command line: each command runs one part of the library.

Parsing (click) only records what was asked (:func:`parse_args`, which the
tests use to check the README's, docs/' and docker-compose's command lines); :func:`main`
then sets up logging and runs the command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click
import msgspec

from indexer.log import setup_logging
from kvindex.options import EngineFlag, EngineUrlFlag, Port, apply, cannot, option, usage_line
from kvindex.replay import replay as run_replay

if TYPE_CHECKING:
    from api.settings import ApiSettings
    from indexer.stores.redis import RedisConfig
    from kvindex.config import ServeConfig

log = logging.getLogger("kvindex")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _service(args: argparse.Namespace) -> int:
    """Run ``serve``, ``indexer`` or ``api``: 1 with the reason on stderr if it cannot
    run, 2 if it would run with the engine registry open to anyone."""
    import asyncio  # here: replay runs without it, and its import is a fifth of start-up

    import zmq

    from indexer.engine_registry import EngineExists
    from indexer.stores import StoreUnavailable
    from kvindex.config import ConfigError, OpenDoor, load_config

    try:
        config = load_config(args.config)
        redis = config.redis_config(
            args.redis_url, cluster=args.redis_cluster, prefix=args.redis_prefix
        )
        ok = asyncio.run(args.service(args, config, redis))
    except EngineExists as e:
        return cannot(args, f"engine {e.args[0]!r} is declared twice")
    except OpenDoor as e:
        return cannot(args, str(e), 2)
    except (ConfigError, OSError, zmq.ZMQError, StoreUnavailable) as e:
        return cannot(args, str(e))
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
    await serve(
        config,
        args.engine,
        host=args.host,
        port=args.port,
        redis=redis,
        settings=settings,
        discover=args.discover,
        engine_urls=args.engine_url,
    )


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
        list(args.engine),
        engine_urls=args.engine_url,
        worker_id=args.worker_id,
        metrics=metrics,
    )


async def _api(args: argparse.Namespace, config: ServeConfig, redis: RedisConfig | None) -> None:
    from kvindex.processes import run_api

    redis = _needs_redis(args, redis)
    settings = _http_settings(args, config)
    await run_api(
        config, redis, host=args.host, port=args.port, settings=settings, mirror=args.mirror
    )


def _status(args: argparse.Namespace) -> int:
    from kvindex.status import FleetUnreachable, fleet_table

    try:
        print(fleet_table(args.url, args.token))
    except FleetUnreachable as e:
        return cannot(args, str(e))
    return 0


def _log_level() -> Callable:
    return option(
        "--log-level",
        type=click.Choice(LEVELS, case_sensitive=False),
        help="log lines (JSON, on stderr) at this level and above  [default: WARNING]",
    )


def _redis_flags(url_help: str, prefix: str | None) -> Callable:
    return apply(
        option("--redis-url", metavar="URL", help=url_help),
        option("--redis-cluster", is_flag=True, help="the URL names a Redis Cluster node"),
        option(
            "--redis-prefix",
            default=prefix,
            help=f"key prefix, so indexes can share a Redis  [default: {prefix or 'kvindex'}]",
        ),
    )


def _config_flag() -> Callable:
    return option(
        "--config",
        metavar="FILE",
        help="YAML or TOML (.toml) config file; KVINDEX_<SECTION>__<FIELD> variables"
        " override its fields (e.g. KVINDEX_SUBSCRIBER__REPLAY_TIMEOUT=2)",
    )


def _engine_flag(what: str) -> Callable:
    return option(
        "--engine",
        multiple=True,
        type=EngineFlag(),
        help=f"{what}, e.g. a=tcp://host:5557,replay_endpoint=tcp://host:5558"
        " (repeatable, or space-separated in the variable; fields as in the config file)",
    )


def _engine_url_flag(what: str) -> Callable:
    return option(
        "--engine-url",
        multiple=True,
        type=EngineUrlFlag(),
        help=f"{what}, e.g. http://host:8100 or http://host:8100,name=a,hash_algo=sha256:"
        " endpoints, ranks and model from its /kv_event_sources and /v1/models, block size"
        " from its events (repeatable, or space-separated in the variable)",
    )


def _http_flags() -> Callable:
    return apply(
        option("--host", default="127.0.0.1", show_default=True, help="HTTP address"),
        option("--port", type=Port(), default=8000, show_default=True, help="HTTP port (0: any)"),
        option(
            "--auth-token-file",
            metavar="FILE",
            help="file holding the bearer token POST/DELETE /engines require"
            " (else $KVINDEX_AUTH_TOKEN, then api.auth_token_file or api.auth_token)",
        ),
        option(
            "--insecure-no-auth",
            is_flag=True,
            help="serve a non-loopback --host without a token: anyone who reaches it"
            " can register and remove engines (refused otherwise)",
        ),
    )


def _parsed(run: Callable[[argparse.Namespace], int], **more: object) -> argparse.Namespace:
    """What a command's flags asked for, with the flags given before the command."""
    ctx = click.get_current_context()
    level = ctx.params.pop("log_level") or ctx.parent.params["log_level"] or "WARNING"
    return argparse.Namespace(command=ctx.info_name, run=run, log_level=level, **ctx.params, **more)


class _LazyGroup(click.Group):
    """Commands whose flags cost start-up are imported only when named (or listed
    in the help): ``sim``'s defaults come from the simulator, which every other
    command would otherwise load first."""

    lazy = {"sim": "kvindex.simflags"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module = importlib.import_module(self.lazy[cmd_name])
            self.add_command(getattr(module, cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings=SETTINGS)
@click.version_option(
    None, "-V", "--version", package_name="kvindex", message="kvindex %(version)s"
)
@_log_level()
def cli(log_level: str | None) -> None:
    """kvindex: which engine of a vLLM fleet holds the longest cached prefix of a
    prompt, learned from the engines' KV cache events.

    \b
    Start here:
      kvindex serve --engine a=tcp://10.0.0.5:5557   one process: follow engines, serve HTTP
      kvindex status                                 the fleet as a table
      kvindex COMMAND --help                         a command's flags and an example

    Every flag can also be set as KVINDEX_<FLAG> (--redis-url: KVINDEX_REDIS_URL),
    or as KVINDEX_<FLAG>_FILE naming a file that holds the value (for secrets).
    """


@cli.command(
    context_settings=SETTINGS,
    short_help="apply a recorded trace, print a JSON report, check vLLM's answers",
)
@click.argument("trace", metavar="TRACE")
@option("--probe", metavar="EXPECTED.json", help="answer this file's probes and check them")
@_redis_flags("replay into Redis (redis://, rediss://, unix://)", prefix="kvindex-replay")
@_log_level()
def replay(**_: object) -> argparse.Namespace:
    """Apply a recorded trace and print a JSON report (blocks per tier, anomalies,
    probe answers).

    TRACE is a TRACE.frames.msgpack file: a msgpack array of [seq, payload], every
    batch one engine rank published. With --probe, the report's probe answers are
    compared with the file's (vLLM's own): stderr ends with "N/N probes match",
    and the exit code is 1 if any differs.

    \b
    Example:
      kvindex replay chat.frames.msgpack --probe chat.expected.json
    """
    return _parsed(run_replay)


@cli.command(
    context_settings=SETTINGS,
    short_help="one process: follow engines' KV events and serve the HTTP API",
)
@_http_flags()
@_redis_flags("use the Redis store at this URL (default: embedded)", prefix=None)
@_config_flag()
@_engine_flag("an engine to follow")
@_engine_url_flag("an engine to follow, by its OpenAI server's URL")
@option(
    "--discover",
    multiple=True,
    metavar="URL",
    help="find engines: dns://NAME:PORT?replay_port=..&block_size=.. (A/AAAA/SRV) or"
    " k8s://NAMESPACE?selector=app%3Dvllm (pods); repeatable, fields as in the config file",
)
@_log_level()
def serve(**_: object) -> argparse.Namespace:
    """One process: consume engines' KV events and serve the HTTP API
    (/prefix-match, /engines, /stats, /metrics, /docs).

    \b
    Example:
      kvindex serve --port 8000 \\
        --engine vllm-a=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558 \\
        --engine-url http://10.0.0.6:8100
    """
    return _parsed(_service, service=_serve)


@cli.command(
    context_settings=SETTINGS, short_help="a scale-out worker: its share of the engines, into Redis"
)
@_redis_flags("the shared Redis (required, or a redis config section)", None)
@_config_flag()
@_engine_flag("an engine to register if it is not yet")
@_engine_url_flag("an engine to register if it is not yet, by its OpenAI server's URL")
@option("--worker-id", help="unique name  [default: host-pid-random]")
@option("--lease-ttl", type=float, help="seconds a dead worker's engines wait  [default: 6]")
@option("--metrics-port", type=Port(), help="serve Prometheus metrics on this port")
@option("--metrics-host", default="127.0.0.1", show_default=True, help="metrics address")
@_log_level()
def indexer(**_: object) -> argparse.Namespace:
    """A worker: consume its share of the engines into Redis (scale-out).

    Workers share the engines through leases in Redis: when one stops, the
    others take its engines over after --lease-ttl seconds.

    \b
    Example:
      kvindex indexer --redis-url redis://10.0.0.9:6379/0 --metrics-port 9100 \\
        --engine vllm-a=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558
    """
    return _parsed(_service, service=_indexer)


@cli.command(
    context_settings=SETTINGS, short_help="a scale-out HTTP API replica over Redis (stateless)"
)
@_http_flags()
@_redis_flags("the shared Redis (required, or a redis config section)", None)
@option(
    "--mirror",
    is_flag=True,
    help="answer from memory: this replica consumes every registered engine itself"
    " (as kvindex serve does) instead of reading residency from Redis on each query",
)
@_config_flag()
@_log_level()
def api(**_: object) -> argparse.Namespace:
    """An HTTP API replica over the shared Redis (scale-out; stateless).

    With --mirror, queries are answered from the replica's own consumption of
    the engines' events, at in-memory speed; the registry, routed entries and
    leases stay shared in Redis.

    \b
    Example:
      KVINDEX_AUTH_TOKEN_FILE=/run/secrets/kvindex-token \\
        kvindex api --host 0.0.0.0 --redis-url redis://10.0.0.9:6379/0 --mirror
    """
    return _parsed(_service, service=_api)


@cli.command(context_settings=SETTINGS, short_help="the fleet as a table, from a running server")
@option("--url", default="http://127.0.0.1:8000", show_default=True, help="a kvindex HTTP API")
@option(
    "--token",
    envvar="KVINDEX_AUTH_TOKEN",
    help="bearer token, if the server asks one for reads (better from the variable"
    " or KVINDEX_AUTH_TOKEN_FILE than in argv, which ps shows)",
)
@_log_level()
def status(**_: object) -> argparse.Namespace:
    """Print the fleet as a table: each engine's dp ranks, ok or degraded (and
    why), resident blocks per tier and how far each rank lags; the totals below.
    Read from a running server's /engines and /stats, as its /ui page is.

    \b
    Example:
      kvindex status --url http://127.0.0.1:8080
    """
    return _parsed(_status)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; exits (as argparse does) on a usage error, 2, with
    one line on stderr, and on --help or --version, 0, after printing them."""
    try:
        parsed = cli.main(argv, prog_name="kvindex", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # plain "kvindex": the help, as a usage error
        print(e.format_message(), file=sys.stderr)
        raise SystemExit(2) from None
    except click.UsageError as e:
        print(usage_line(e), file=sys.stderr)
        raise SystemExit(2) from None
    except click.ClickException as e:
        print(f"kvindex: {e.format_message()}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    if not isinstance(parsed, argparse.Namespace):  # --help or --version: printed
        raise SystemExit(parsed or 0)
    return parsed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
