"""The one Redis gateway: every command of the store and of the cluster layer goes here.

One connection pool (redis-py's, with its Retry on dropped connections and
health checks of idle connections), at most ``max_connections`` commands in
flight (redis-py fails a command when its pool is exhausted; here it waits),
Lua scripts run by SHA1 and loaded again when Redis lost them (a restart, a
``SCRIPT FLUSH``), and one rule for failures: Redis being down or failing is
:class:`~indexer.errors.StoreUnavailable`, whoever asked (a connection redis-py
dropped under a command included, however redis-py lets it out).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from redis import exceptions as rex
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from indexer.errors import StoreUnavailable
from indexer.stores.redis.config import RedisConfig, redacted
from indexer.stores.redis.layout import Layout

#: What "Redis is down or failing" looks like from redis-py.
UNAVAILABLE = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)
#: redis-py's connection code (its connections and their parsers).
CONNECTION_CODE = ("redis.asyncio.connection", "redis._parsers")


def dropped_transport(error: BaseException) -> bool:
    """An AttributeError or TypeError raised in redis-py's connection code (or below
    it, in the asyncio transport it writes to): a connection disconnected under a
    command in flight, which redis-py lets out raw instead of as a ConnectionError
    (its ``_writer`` already None, or the transport torn down). A cluster client
    disconnects every connection, the other callers' too, whenever it resets
    itself (a ClusterDown, a pipeline's retry, every fifth MOVED); a closing client
    does too. The same errors raised anywhere else are bugs, not Redis."""
    if not isinstance(error, (AttributeError, TypeError)):
        return False
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_globals.get("__name__", "").startswith(CONNECTION_CODE):
            return True
        frame = frame.tb_next
    return False


@dataclass(frozen=True)
class Script:
    """A Lua script, sent as ``EVALSHA`` of its SHA1 (loaded when Redis misses it).

    Its first lines name its KEYS and ARGV, and what it returns.
    """

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


def connect(config: RedisConfig) -> Redis | RedisCluster:
    """The client: the asyncio flavour of redis-py's Retry (the synchronous one never
    awaits the command, so it retries nothing), on dropped connections only."""
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    options = {
        "max_connections": config.max_connections + 1,  # + the sweeper's SCAN
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "retry": Retry(backoff, config.retries, supported_errors=(rex.ConnectionError,)),
        "health_check_interval": config.health_check_interval,
    }
    if config.cluster:
        return RedisCluster.from_url(config.url, **options)
    return Redis.from_url(config.url, **options)


class RedisClient:
    """Commands to one Redis index (``config``), pipelined; ``layout`` names its keys.

    ``redis``: a redis-py client to use instead of one made from ``config``.
    """

    def __init__(self, config: RedisConfig, redis: Redis | RedisCluster | None = None) -> None:
        self.config = config
        self.layout = Layout(config.prefix)
        self.redis = redis if redis is not None else connect(config)
        self.where = redacted(config.url)
        self._scripts: dict[str, str] = {}  # sha -> source of every script run through here
        self._connections = asyncio.Semaphore(config.max_connections)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn "Redis is down or failing" into :class:`StoreUnavailable`."""
        try:
            yield
        except UNAVAILABLE as e:
            raise self._unavailable(e) from e
        except (AttributeError, TypeError) as e:
            if not dropped_transport(e):
                raise
            raise self._unavailable(e) from e

    def _unavailable(self, error: Exception) -> StoreUnavailable:
        return StoreUnavailable(
            f"Redis at {self.where} unavailable: {type(error).__name__}: {error}"
        )

    async def _ready(self) -> None:
        """A cluster client learns the slots before its first command (and again after
        it reset itself): redis-py sends a command it routes before then to any node,
        and every fifth MOVED answer makes it reset itself, disconnecting the other
        callers' connections under their commands."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.initialize()

    def script(self, script: Script, keys: Sequence[str], args: Sequence[object]) -> tuple:
        """The command that runs ``script`` (for :meth:`execute`)."""
        self._scripts.setdefault(script.sha, script.source)
        return ("EVALSHA", script.sha, len(keys), *keys, *args)

    async def execute(self, commands: Sequence[tuple]) -> list:
        """Send commands in one pipeline (one round trip per node); load scripts once."""
        for attempt in (1, 2):
            async with self._connections:  # loading scripts takes a connection too
                try:
                    return await self._send(commands)
                except rex.NoScriptError:
                    if attempt == 2:
                        raise
                    await self._load_scripts()
        raise AssertionError("unreachable")

    async def _send(self, commands: Sequence[tuple]) -> list:
        with self.guard():
            await self._ready()
            if len(commands) == 1:  # a pipeline costs more client time
                return [await self.redis.execute_command(*commands[0])]
            pipe = self.redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def _load_scripts(self) -> None:
        """Load every script again (each caller that found one missing: reloads are
        idempotent, and one skipped could be the one a restarted Redis needed)."""
        with self.guard():
            await self._ready()
            for source in list(self._scripts.values()):
                await self.redis.script_load(source)

    async def scan(self, match: str, count: int) -> AsyncIterator[bytes]:
        """Every key matching ``match`` (on every master of a cluster), ``count`` a step."""
        with self.guard():
            await self._ready()
            async for key in self.redis.scan_iter(match=match, count=count):
                yield key

    async def close(self) -> None:
        await self.redis.aclose()


async def cancel_task(task: asyncio.Task | None) -> None:
    """Cancel a task that sends through a client, until it sticks: Python 3.11's
    ``wait_for`` (in redis-py's sends) can drop a cancel."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.05)
