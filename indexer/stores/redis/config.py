"""Where a Redis index lives and how to reach it, checked before anything connects."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the index lives and how to talk to it: the ``redis`` section.

    A pooled connection that Redis closed (a restart) is replaced on first use, so
    one restart costs no failed command; timeouts are not retried, as a hung Redis
    would only make every caller wait longer. The server must not evict keys
    (``maxmemory-policy noeviction``) and should persist (AOF) for the index to
    survive a Redis restart; without it, a restart is recovered only as far as the
    engines' replay buffers reach.
    """

    #: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
    #: ``unix:///path.sock?db=0&password=...``.
    url: str = "redis://127.0.0.1:6379/0"
    #: Of every key, so several indexes can share a Redis.
    prefix: str = "kvindex"
    #: The URL names one node of a Redis Cluster.
    cluster: bool = False
    #: Commands in flight at once (per node on a cluster); more wait.
    max_connections: int = 32
    #: Seconds a command may take before the store counts as unreachable (503).
    socket_timeout: float = 5.0
    #: Seconds a connection may take to open.
    connect_timeout: float = 2.0
    #: Reconnect attempts per command, with exponential backoff, before
    #: :class:`~indexer.errors.StoreUnavailable` is raised (callers retry further).
    retries: int = 2
    #: Seconds a pooled connection may sit idle before it is PINGed ahead of its next
    #: command.
    health_check_interval: float = 10.0
    #: Seconds between garbage sweeps run by a store that applies batches (null: never).
    sweep_interval: float | None = 300.0
    #: Seconds between a store's looks for lost data, from its first watermark read or
    #: write (null: only when a write, a prefix match or a ping finds it): how soon a
    #: Redis restart without persistence is noticed.
    identity_check: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}*?[]\\"):
            raise ValueError(f"Redis key prefix: non-empty, none of {{}}*?[]\\ ({self.prefix!r})")
        check_redis_url(self.url)


def check_redis_url(url: str) -> None:
    """Raise ValueError for a URL redis-py would fail on late (another scheme) or
    read silently wrong (a db that is not a number is db 0 to it). The message
    shows no part of the URL that may hold a password."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        got = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(
            "Redis URL: expected redis://HOST:PORT/DB, rediss://... (TLS) or"
            f" unix:///PATH.sock, got {got}"
        )
    dbs = parse_qs(parts.query).get("db", [])
    if parts.scheme != "unix" and parts.path.strip("/"):
        dbs.append(unquote(parts.path.strip("/")))
    for db in dbs:
        if not db.isdigit():
            raise ValueError(f"Redis URL: db {db!r} is not a number (e.g. redis://HOST:6379/0)")


def redacted(url: str) -> str:
    """The URL without credentials, for messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
