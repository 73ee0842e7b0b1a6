"""Who may open doors: binds an engine asks for, the API's token, slow clients.

Binds are tried for real (a real subscriber binding real ZMQ sockets, files
on disk), the token and the exposure check through the real CLI, and the
HTTP limits over real sockets against the server ``kvindex serve`` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from api import ApiSettings, create_app
from indexer.engine_flags import parse_engine_flag
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.registry import BindPolicy, BindRefused, EngineRegistry, EngineSpec
from indexer.stores import MemoryStore
from kvindex.config import (
    AUTH_TOKEN_ENV,
    ConfigError,
    OpenDoor,
    ServeConfig,
    refuse_open_door,
    resolve_auth_token,
)
from kvindex.http import listen, serve_http
from producer.publisher import Publisher

from .apikit import Api
from .conftest import free_ports, wait_until

KVINDEX = (sys.executable, "-m", "kvindex.cli")


def spec(endpoint: str, **fields) -> EngineSpec:
    return EngineSpec(name="e", endpoint=endpoint, bind=True, **fields)


def refused(policy: BindPolicy, endpoint: str) -> str:
    with pytest.raises(BindRefused) as e:
        policy.check(spec(endpoint))
    return str(e.value)


# --- the bind policy -------------------------------------------------------------


def test_ipc_binds_are_refused_unless_a_directory_is_configured(tmp_path: Path) -> None:
    assert "subscriber.bind.ipc_dir" in refused(BindPolicy(), f"ipc://{tmp_path}/kv.sock")
    BindPolicy(ipc_dir=str(tmp_path)).check(spec(f"ipc://{tmp_path}/kv.sock"))


def test_ipc_binds_stay_inside_the_directory(tmp_path: Path) -> None:
    sockets, elsewhere = tmp_path / "sockets", tmp_path / "elsewhere"
    sockets.mkdir()
    elsewhere.mkdir()
    (sockets / "link").symlink_to(elsewhere)
    policy = BindPolicy(ipc_dir=str(sockets))
    for path in (elsewhere / "kv.sock", f"{sockets}/../elsewhere/kv.sock", sockets / "link/kv"):
        assert "not in subscriber.bind.ipc_dir" in refused(policy, f"ipc://{path}")
    for name in ("@abstract", "*"):
        assert "abstract and wildcard" in refused(policy, f"ipc://{name}")


def test_ipc_binds_never_replace_a_file_that_is_not_a_socket(tmp_path: Path) -> None:
    policy = BindPolicy(ipc_dir=str(tmp_path))
    (tmp_path / "data").write_text("precious")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    for name in ("data", "dir", "link"):
        assert "is not a socket" in refused(policy, f"ipc://{tmp_path}/{name}")
    with socket.socket(socket.AF_UNIX) as old:  # a socket left by an earlier run
        old.bind(str(tmp_path / "old.sock"))
    policy.check(spec(f"ipc://{tmp_path}/old.sock"))


def test_tcp_binds_are_loopback_unless_listed() -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557"):
        BindPolicy().check(spec(endpoint))
    for host in ("0.0.0.0", "*", "10.0.0.5", "[::]", "eth0"):
        assert "is not loopback" in refused(BindPolicy(), f"tcp://{host}:5557")
    BindPolicy(tcp_hosts=["10.0.0.5"]).check(spec("tcp://10.0.0.5:5557"))
    assert "10.0.0.6" in refused(BindPolicy(tcp_hosts=["10.0.0.5"]), "tcp://10.0.0.6:5557")
    BindPolicy(tcp_hosts=["*"]).check(spec("tcp://0.0.0.0:5557"))


def test_engines_kvindex_connects_to_need_no_permission(tmp_path: Path) -> None:
    BindPolicy().check(EngineSpec("e", f"ipc://{tmp_path}/x"))
    BindPolicy().check(EngineSpec("e", "tcp://0.0.0.0:5557"))
    BindPolicy().check(spec("inproc://kv"))


# --- POST /engines against a real subscriber -------------------------------------


@contextlib.asynccontextmanager
async def live_api(policy: BindPolicy | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The API over a real subscriber, both with ``policy`` (as ``kvindex serve`` sets them)."""
    policy = policy or BindPolicy()
    store, registry = MemoryStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, SubscriberSettings(bind=policy))
    config = ServeConfig(subscriber=SubscriberSettings(bind=policy))
    app = create_app(store, registry, subscriber, config.api_settings())
    await subscriber.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
            yield client
    finally:
        await subscriber.stop()


def body(endpoint: str) -> dict:
    return {"name": "intruder", "endpoint": endpoint, "bind": True}


async def test_post_engines_cannot_destroy_a_file(tmp_path: Path) -> None:
    """libzmq unlinks an ipc path before binding it: this used to delete the file."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    async with live_api() as client:
        answer = await client.post("/engines", json=body(f"ipc://{victim}"))
        assert answer.status_code == 422, answer.text
        assert "ipc binds are off" in answer.json()["error"]
        assert (await client.get("/engines")).json() == []
    async with live_api(BindPolicy(ipc_dir=str(tmp_path))) as client:
        answer = await client.post("/engines", json=body(f"ipc://{victim}"))
        assert answer.status_code == 422, answer.text
        assert "is not a socket" in answer.json()["error"]
    assert victim.read_text() == "precious"


async def test_post_engines_cannot_open_a_public_listener() -> None:
    port = free_ports()
    async with live_api() as client:
        answer = await client.post("/engines", json=body(f"tcp://0.0.0.0:{port}"))
        assert answer.status_code == 422, answer.text
        assert "0.0.0.0 is not loopback" in answer.json()["error"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_an_allowed_ipc_bind_is_consumed(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    async with live_api(BindPolicy(ipc_dir=str(tmp_path))) as client:
        answer = await client.post("/engines", json=body(f"ipc://{path}"))
        assert answer.status_code == 201, answer.text
        with Publisher(f"ipc://{path}", bind=False):

            async def connected() -> bool:
                state = (await client.get("/engines/intruder")).json()
                return state["ranks"][0]["connected"]

            for _ in range(200):
                if await connected():
                    break
                await asyncio.sleep(0.05)
            assert await connected()
            assert path.is_socket()


async def test_the_subscriber_checks_again_right_before_binding(tmp_path: Path) -> None:
    """What an API replica allowed may have changed by the time a worker binds it."""
    store, registry = MemoryStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, SubscriberSettings(bind=BindPolicy(str(tmp_path))))
    await subscriber.start()
    try:
        BindPolicy(str(tmp_path)).check(spec(f"ipc://{tmp_path}/late"))  # allowed now
        (tmp_path / "late").write_text("appeared since")
        with pytest.raises(BindRefused, match="is not a socket"):
            await registry.add(spec(f"ipc://{tmp_path}/late"))
    finally:
        await subscriber.stop()
    assert (tmp_path / "late").read_text() == "appeared since"


async def test_an_api_replica_refuses_binds_its_workers_would_refuse() -> None:
    """A replica consumes nothing, so the API itself must check."""
    api = Api()  # default settings: the default policy, and a subscriber that never binds
    try:
        answer = await api.client.post("/engines", json=body("tcp://0.0.0.0:5557"))
        assert answer.status_code == 422, answer.text
        assert api.registry.all() == []
    finally:
        await api.close()


def test_the_api_section_cannot_set_its_own_bind_policy() -> None:
    with pytest.raises(ConfigError, match=r"subscriber\.bind"):
        ServeConfig(api={"engine_binds": {"tcp_hosts": ["*"]}}).api_settings()


def test_declared_engines_are_checked_at_start(tmp_path: Path) -> None:
    config = ServeConfig(engines=[spec("tcp://0.0.0.0:5557")])
    with pytest.raises(ConfigError, match="is not loopback"):
        config.check_binds()
    with pytest.raises(ConfigError, match="ipc binds are off"):
        ServeConfig().check_binds([parse_engine_flag(f"a=ipc://{tmp_path}/s,bind=true")])


# --- endpoints and the --engine flag ---------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"endpoint": "http://h:1"}, "endpoint: expected tcp://HOST:PORT or ipc://PATH, got 'http://h:1'"),
        ({"endpoint": "tcp://h"}, "expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:0"}, "port 0 of 'tcp://h:0' is not in 1-65535"),
        ({"endpoint": "tcp://h:65536"}, "port 65536"),
        ({"endpoint": "tcp://h:65535", "dp_ranks": 2}, "rank 1 of 'tcp://h:65535' would use port"),
        ({"replay_endpoint": "tcp://h:65534", "dp_ranks": 3}, "replay_endpoint: with dp_ranks=3"),
        ({"replay_endpoint": "udp://h:1"}, "replay_endpoint: expected"),
    ],
)  # fmt: skip
async def test_post_engines_says_what_is_wrong_with_an_endpoint(fields, message) -> None:
    api = Api()
    try:
        sent = {"name": "a", "endpoint": "tcp://h:1", **fields}
        answer = await api.client.post("/engines", json=sent)
        assert answer.status_code == 422
        assert message in answer.json()["error"]
    finally:
        await api.close()


def test_ports_at_the_top_of_the_range_are_fine() -> None:
    assert parse_engine_flag("a=tcp://h:65534,dp_ranks=2").rank_endpoint(1) == "tcp://h:65535"
    assert parse_engine_flag("a=tcp://[::1]:5557,dp_ranks=2").rank_endpoint(1) == "tcp://[::1]:5558"


def test_null_in_the_engine_flag_is_none_or_the_default() -> None:
    flag = "a=tcp://h:1,hash_seed=null,model=null,replay_endpoint=null,blocks_per_chunk=null"
    assert parse_engine_flag(flag + ",hash_algo=null,topic=null,dp_ranks=null") == EngineSpec(
        "a", "tcp://h:1", model="", hash_algo=None, hash_seed=None
    )
    with pytest.raises(ValueError, match="color"):
        parse_engine_flag("a=tcp://h:1,color=null")


# --- the token, and refusing to serve without one --------------------------------


def test_the_token_comes_from_the_first_source_that_has_one(tmp_path: Path) -> None:
    flag_file, config_file = tmp_path / "flag", tmp_path / "config"
    flag_file.write_text("from-flag-file\n")
    config_file.write_text("from-config-file\n")
    settings = ApiSettings(auth_token="from-yaml", auth_token_file=str(config_file))
    env = {AUTH_TOKEN_ENV: "from-env"}
    assert resolve_auth_token(settings, str(flag_file), env).auth_token == "from-flag-file"
    assert resolve_auth_token(settings, None, env).auth_token == "from-env"
    assert resolve_auth_token(settings, None, {}).auth_token == "from-config-file"
    assert resolve_auth_token(ApiSettings(auth_token="y"), None, {}).auth_token == "y"
    assert resolve_auth_token(ApiSettings(), None, {AUTH_TOKEN_ENV: " "}).auth_token is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_auth_token(ApiSettings(), str(tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="No such file"):
        resolve_auth_token(ApiSettings(), str(tmp_path / "missing"), {})


def test_only_a_loopback_listener_may_run_without_a_token() -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        refuse_open_door(host, ApiSettings())
    refuse_open_door("0.0.0.0", ApiSettings(auth_token="t"))
    for host in ("0.0.0.0", "", "10.0.0.5", "::"):
        with pytest.raises(OpenDoor, match="--insecure-no-auth"):
            refuse_open_door(host, ApiSettings())


@pytest.mark.parametrize("command", [["serve"], ["api", "--redis-url", "redis://127.0.0.1:1/0"]])
def test_a_public_listener_without_a_token_refuses_to_start(command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
    argv = [*KVINDEX, *command, "--host", "0.0.0.0", "--port", str(free_ports())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"kvindex {command[0]}: --host 0.0.0.0 is reachable from other")
    assert "--insecure-no-auth" in line


class Running:
    """``kvindex serve`` on every interface, reached through loopback."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_ports()
        argv = [*KVINDEX, "serve", "--host", "0.0.0.0", "--port", str(self.port), *args]
        environ = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
        self.proc = subprocess.Popen(argv, env={**environ, **(env or {})}, stderr=subprocess.PIPE)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5)
        deadline = time.monotonic() + 20
        while not self._up():
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.05)

    def _up(self) -> bool:
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def register(self, token: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        engine = {"name": f"e{time.monotonic_ns()}", "endpoint": "tcp://127.0.0.1:1"}
        return self.http.post("/engines", json=engine, headers=headers).status_code

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=15) == 0


@pytest.mark.slow
@pytest.mark.parametrize("source", ["env", "file"])
def test_a_token_from_the_environment_or_a_file_guards_the_registry(
    tmp_path: Path, source: str
) -> None:
    token = "s3cret-from-" + source
    (tmp_path / "token").write_text(token + "\n")
    if source == "env":
        serve = Running(env={AUTH_TOKEN_ENV: token})
    else:
        serve = Running("--auth-token-file", str(tmp_path / "token"))
    try:
        assert serve.register() == 401
        assert serve.register("wrong") == 401
        assert serve.register(token) == 201
    finally:
        serve.stop()


@pytest.mark.slow
def test_the_opt_out_runs_open() -> None:
    serve = Running("--insecure-no-auth")
    try:
        assert serve.register() == 201
    finally:
        serve.stop()


# --- slow clients and too many connections ---------------------------------------


@contextlib.asynccontextmanager
async def http_server(**settings) -> AsyncIterator[int]:
    """``serve_http`` (what ``kvindex serve`` runs) on a real port, with a trivial app."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    stop = asyncio.Event()
    with listen("127.0.0.1", 0) as sock:
        served = asyncio.create_task(serve_http(app, ApiSettings(**settings), sock, stop))
        try:
            yield sock.getsockname()[1]
        finally:
            stop.set()
            await asyncio.wait_for(served, 15)


async def partial_head(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /ping HTTP/1.1\r\nHost: kvindex\r\nX-Slow: ")  # never finished
    await writer.drain()
    return reader, writer


async def closed_at(reader: asyncio.StreamReader, timeout: float) -> float:
    """When (monotonic) the server closed the connection; fails after ``timeout``."""
    await asyncio.wait_for(reader.read(), timeout)  # all it sends, up to EOF
    return time.monotonic()


async def closed_after(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the server closes the connection within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(reader.read(), timeout)  # all it sends, up to EOF
    except TimeoutError:
        return False
    return True


async def ping(port: int) -> int:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        return (await client.get("/ping")).status_code


@pytest.mark.slow
async def test_slowloris_connections_are_closed_after_the_header_timeout() -> None:
    async with http_server(header_timeout=1.5) as port:
        opened, slow = [], []
        for _ in range(50):
            opened.append(time.monotonic())  # the server's clock starts after this
            slow.append(await partial_head(port))
        closed = await asyncio.gather(*(closed_at(reader, 15) for reader, _ in slow))
        held = [end - start for start, end in zip(opened, closed, strict=True)]
        assert min(held) >= 1.5  # not before the timeout
        assert await ping(port) == 200
        for _, writer in slow:
            writer.close()


@pytest.mark.slow
async def test_silent_and_keep_alive_connections_are_bounded_too() -> None:
    async with http_server(header_timeout=1.0) as port:
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: kvindex\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /ping HTTP/1.1\r\n")  # the next head, a byte at a time
        assert await closed_after(silent_reader, 15)
        assert await closed_after(reader, 15)
        silent.close()
        writer.close()


@pytest.mark.slow
async def test_connections_beyond_the_limit_are_answered_503() -> None:
    async with http_server(header_timeout=3.0, max_connections=10) as port:
        slow = [await partial_head(port) for _ in range(10)]
        await asyncio.sleep(0.1)
        assert await ping(port) == 503  # the 11th connection
        await wait_until(lambda: all(r.at_eof() for r, _ in slow), 15, "the timeout")
        for _, writer in slow:
            writer.close()
        assert await ping(port) == 200


def test_http_limits_are_settings() -> None:
    settings = ServeConfig(api={"header_timeout": 3, "max_connections": 50}).api_settings()
    assert (settings.header_timeout, settings.max_connections) == (3, 50)
    with pytest.raises(ConfigError, match="header_timeout"):
        ServeConfig(api={"header_timeout": 0}).api_settings()
    assert msgspec.convert({}, SubscriberSettings).bind == BindPolicy()
