"""Who may open kvindex's HTTP door, and for how long: the API's token and the
refusal to serve a public listener without one, through the real CLI, and the
limits on slow clients and connections over real sockets, since an exposed
index is only as safe as what it refuses before any request is read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from api import ApiSettings
from indexer.engine_registry import BindPolicy
from indexer.ingest.subscriber import SubscriberSettings
from kvindex.config import (
    AUTH_TOKEN_ENV,
    ConfigError,
    OpenDoor,
    ServeConfig,
    refuse_open_door,
    resolve_auth_token,
)
from kvindex.http import listen, serve_http

from .conftest import EXIT_WITHIN, free_ports, wait_until

KVINDEX = (sys.executable, "-m", "kvindex.cli")


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
        assert self.proc.wait(timeout=EXIT_WITHIN) == 0


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
