"""How every ``kvindex`` flag is declared: its environment variable, its secret
file, its value checks; and how a command says in one line that it cannot run.

Each flag ``--some-flag`` may also be set as ``KVINDEX_SOME_FLAG``, or as
``KVINDEX_SOME_FLAG_FILE`` naming a file that holds the value: a password in a
Redis URL or a token then appears neither in ``ps`` nor in the environment a
container runtime shows (Docker and Kubernetes mount secrets as files). A
flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from indexer.discovery.served import EngineUrl
    from indexer.engine_registry import EngineSpec

ENV_PREFIX = "KVINDEX_"
FILE_SUFFIX = "_FILE"


def env_name(flag: str) -> str:
    """``--redis-url`` -> ``KVINDEX_REDIS_URL``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def read_secret(path: str, what: str) -> str:
    """A file's content without the trailing newline an editor adds; refused
    if it cannot be read or is empty (an empty token would open the door)."""
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise click.UsageError(f"{what} {path}: {e.strerror}") from None
    if not value:
        raise click.UsageError(f"{what} {path} is empty")
    return value


class EnvOption(click.Option):
    """An option whose environment variable is named after its flag, shown in
    ``--help``, and which may name a file instead (``..._FILE``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, show_envvar=True, **kwargs)
        if self.envvar is None:
            self.envvar = env_name(max(self.opts, key=len))

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        value = super().resolve_envvar_value(ctx)
        if value is not None:
            return value
        names = [self.envvar] if isinstance(self.envvar, str) else self.envvar
        for name in names:
            path = os.environ.get(name + FILE_SUFFIX)
            if path:
                return read_secret(path, f"${name}{FILE_SUFFIX}")
        return None


#: ``@option("--port", ...)``: a click option with its ``KVINDEX_`` variable.
option = functools.partial(click.option, cls=EnvOption)


class Port(click.ParamType):
    """A TCP port (the socket module raises OverflowError, not a usage error)."""

    name = "PORT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            port = int(value)
        except (TypeError, ValueError):
            port = -1
        if not 0 <= port <= 65535:
            self.fail(f"expected a port number 0-65535, got {str(value)!r}", param, ctx)
        return port


class EngineFlag(click.ParamType):
    """``NAME=ENDPOINT[,FIELD=VALUE...]``: one engine to follow."""

    name = "NAME=ENDPOINT[,FIELD=VALUE...]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> EngineSpec:
        from indexer.engine_flags import parse_engine_flag  # on use: --help stays quick

        try:
            return parse_engine_flag(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class EngineUrlFlag(click.ParamType):
    """``URL[,FIELD=VALUE...]``: one engine its OpenAI server describes."""

    name = "URL[,FIELD=VALUE...]"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> EngineUrl:
        from indexer.discovery.served import parse_engine_url  # on use: --help stays quick

        try:
            return parse_engine_url(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def usage_line(error: click.UsageError) -> str:
    """A usage error in one line naming the flag and where help is (click prints
    the whole usage first, which buries the one line that says what is wrong)."""
    prog = error.ctx.command_path if error.ctx else "kvindex"
    message = error.format_message()
    missing = isinstance(error, click.MissingParameter)
    if isinstance(error, click.BadParameter) and error.param is not None and not missing:
        flag = max(error.param.opts, key=len) if error.param.opts else error.param.name
        message = f"argument {flag}: {error.message}"
    return f"{prog}: error: {message} (see {prog} --help)"


def apply(*decorators: Callable) -> Callable:
    """Several option decorators as one, so commands can share a set of flags."""

    def decorate(command: Callable) -> Callable:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return decorate


def cannot(args: argparse.Namespace, problem: str, code: int = 1) -> int:
    """Say in one line on stderr why the command cannot run; its exit code."""
    print(f"kvindex {args.command}: {problem}", file=sys.stderr)
    return code
