"""Real ``redis-server`` processes for tests: one standalone server, one 3-master cluster.

The Redis store is only trustworthy if it is tested against the real thing
(Lua semantics, slot routing, AOF recovery), so fixtures start servers as
child processes on free ports in a temporary directory — never the machine's
6379 — and stop them at the end of the session. Tests share the servers and
isolate themselves with unique key prefixes, which keeps the suite fast.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster listens on port + 10000 for its bus
START_TIMEOUT_S = 10.0


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A port nothing listens on (and, for cluster nodes, its bus port too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        bus = port + CLUSTER_BUS_OFFSET
        if not cluster_bus or (bus < 65536 and port_free(bus)):
            return port
    raise RuntimeError("no free port pair found")


def _cli(port: int, *args: str, auth: tuple[str, str] | None = None) -> str:
    login = ["--user", auth[0], "--pass", auth[1], "--no-auth-warning"] if auth else []
    out = subprocess.run(
        [REDIS_CLI, "-p", str(port), *login, *args], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


@dataclass
class RedisServer:
    """One redis-server child process; ``restart`` keeps its port and data dir.

    ``auth``: an ACL user and password the server requires (``extra`` must
    create the user and turn the default one off).
    """

    workdir: Path
    port: int
    extra: tuple[str, ...] = ()
    auth: tuple[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        login = f"{self.auth[0]}:{self.auth[1]}@" if self.auth else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait(lambda: _cli(self.port, "PING", auth=self.auth) == "PONG", "PING")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on {self.port} exited:\n{log}")
            if ready():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port}: no {what} within {START_TIMEOUT_S}s")


@dataclass
class LocalCluster:
    """Three masters, no replicas, joined with ``redis-cli --cluster create``."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @classmethod
    def start(cls, workdir: Path, masters: int = 3) -> LocalCluster:
        nodes = []
        for i in range(masters):
            port = free_port(cluster_bus=True)
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            nodes.append(RedisServer(workdir / f"node{i}", port, extra).start())
        cluster = cls(nodes)
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        _cli(nodes[0].port, "--cluster", "create", *addresses, "--cluster-replicas", "0",
             "--cluster-yes")  # fmt: skip
        for node in nodes:
            node._wait(lambda n=node: "cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO"), "ok")
        return cluster

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A standalone redis-server shared by the session (tests use unique prefixes)."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server not installed: run make setup (scripts/ensure-redis.sh)")
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local 3-master Redis Cluster shared by the session."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail(
            "redis-server/redis-cli not installed: run make setup (scripts/ensure-redis.sh)"
        )
    cluster = LocalCluster.start(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private server with AOF ``appendfsync always``, for tests that restart it."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server not installed: run make setup (scripts/ensure-redis.sh)")
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    server = RedisServer(tmp_path / "redis", free_port(), aof).start()
    yield server
    server.stop()


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private server without persistence: a restart comes back empty, or from the
    last RDB snapshot taken with SAVE."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server not installed: run make setup (scripts/ensure-redis.sh)")
    server = RedisServer(tmp_path / "redis", free_port()).start()
    yield server
    server.stop()
