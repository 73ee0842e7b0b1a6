"""What a new user sees when something is wrong: one line naming it and the fix.

Each case runs the real ``kvindex`` command in a subprocess, as a user would,
and reads its stderr: one line, no traceback, a non-zero exit code.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import free_ports

pytestmark = pytest.mark.slow  # every test starts a kvindex process

KVINDEX = (sys.executable, "-m", "kvindex.cli")


def fails_in_one_line(*argv: str) -> str:
    """The one line ``kvindex argv...`` writes to stderr when it refuses to run."""
    done = subprocess.run([*KVINDEX, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_an_endpoint_that_is_not_zmq(tmp_path: Path) -> None:
    line = fails_in_one_line("serve", "--engine", "a=http://10.0.0.5:5557")
    assert "expected tcp://HOST:PORT or ipc://PATH, got 'http://10.0.0.5:5557'" in line
    config = tmp_path / "kvindex.yaml"
    config.write_text("engines:\n  - name: a\n    endpoint: http://10.0.0.5:5557\n")
    line = fails_in_one_line("serve", "--config", str(config))
    assert line.startswith(f"kvindex serve: {config}: endpoint: expected tcp://HOST:PORT")


def test_a_declared_engine_that_would_bind_where_it_may_not(tmp_path: Path) -> None:
    line = fails_in_one_line("serve", "--engine", "a=tcp://0.0.0.0:5557,bind=true")
    assert line == (
        "kvindex serve: engine 'a' may not bind tcp://0.0.0.0:5557: 0.0.0.0 is not loopback"
        " (list it in subscriber.bind.tcp_hosts to allow it)"
    )
    config = tmp_path / "kvindex.yaml"
    config.write_text(f"engines:\n  - {{name: a, endpoint: 'ipc://{tmp_path}/s', bind: true}}\n")
    line = fails_in_one_line("serve", "--config", str(config))
    assert "ipc binds are off (set subscriber.bind.ipc_dir" in line


@pytest.mark.parametrize("command", ["serve", "api", "indexer", "replay"])
def test_a_redis_url_of_another_scheme(command: str) -> None:
    argv = [command, "--redis-url", "http://10.0.0.9:6379"]
    line = fails_in_one_line(*([*argv, "trace.msgpack"] if command == "replay" else argv))
    assert line == (
        f"kvindex {command}: {'' if command == 'replay' else 'redis: '}Redis URL: expected"
        " redis://HOST:PORT/DB, rediss://... (TLS) or unix:///PATH.sock, got scheme 'http'"
    )


@pytest.mark.parametrize("url", ["redis://10.0.0.9/abc", "unix:///run/redis.sock?db=one"])
def test_a_redis_db_that_is_not_a_number(url: str) -> None:
    """redis-py reads it as db 0: another index's data, silently."""
    line = fails_in_one_line("serve", "--redis-url", url)
    assert "is not a number (e.g. redis://HOST:6379/0)" in line


def test_a_redis_url_error_shows_no_password() -> None:
    line = fails_in_one_line("serve", "--redis-url", "redis://:hunter2@10.0.0.9/abc")
    assert "hunter2" not in line


@pytest.mark.parametrize("command", ["serve", "api"])
def test_the_http_port_is_taken(command: str, taken_port: int) -> None:
    redis = ["--redis-url", "redis://127.0.0.1:1/0"] if command == "api" else []
    line = fails_in_one_line(command, "--port", str(taken_port), *redis)
    assert line.startswith(f"kvindex {command}: port {taken_port} on 127.0.0.1 is in use")
    assert "choose another --port" in line


def test_the_metrics_port_is_taken(taken_port: int, redis_server) -> None:
    argv = ["--redis-url", redis_server.url, "--redis-prefix", f"metrics{taken_port}"]
    line = fails_in_one_line("indexer", *argv, "--metrics-port", str(taken_port))
    assert f"port {taken_port} on 127.0.0.1 is in use" in line
    assert "--metrics-port" in line


def test_a_sim_port_is_taken(taken_port: int) -> None:
    line = fails_in_one_line("sim", "--engines", "1", "--base-port", str(taken_port))
    assert line.startswith("kvindex sim: Address already in use")
    assert f"tcp://127.0.0.1:{taken_port}" in line and "--base-port" in line


def test_a_sim_that_cannot_bind_leaves_no_port_open() -> None:
    """Engine 0 binds, engine 1 cannot: engine 0's ports are closed again."""
    base = free_ports(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
        fails_in_one_line("sim", "--engines", "2", "--base-port", str(base))
    with socket.socket() as again:
        again.bind(("127.0.0.1", base))


@pytest.mark.parametrize(
    "text, where",
    [
        ("api: [1\n", "line 2, column 1: expected ',' or ']', but got '<stream end>'"),
        ("engines:\n  - name: a\n   x: 1\n", "line 3, column 4: expected <block end>"),
        ("a: b: c\n", "line 1, column 5: mapping values are not allowed here"),
    ],
)
def test_a_yaml_syntax_error(tmp_path: Path, text: str, where: str) -> None:
    config = tmp_path / "kvindex.yaml"
    config.write_text(text)
    line = fails_in_one_line("serve", "--config", str(config))
    assert line.startswith(f"kvindex serve: {config}: YAML syntax error at {where}")


def test_a_missing_config_file(tmp_path: Path) -> None:
    line = fails_in_one_line("serve", "--config", str(tmp_path / "none.yaml"))
    assert line == f"kvindex serve: {tmp_path / 'none.yaml'}: No such file or directory"


@pytest.mark.parametrize("port", ["eighty", "70000", "-1"])
def test_a_usage_error_is_one_line_too(port: str) -> None:
    line = fails_in_one_line("serve", "--port", port)
    assert line == (
        f"kvindex serve: error: argument --port: expected a port number 0-65535, got {port!r}"
        " (see kvindex serve --help)"
    )
