"""The ``kvindex`` command explains itself and takes its settings from flags, the
environment and files; ``kvindex status`` shows a running fleet.

Commands run as a user runs them: ``python -m kvindex.cli`` in a subprocess,
with a real server, real simulated engines publishing over ZMQ and a real
Redis where one is needed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import click
import httpx
import pytest
import redis

from kvindex.cli import cli, parse_args
from kvindex.config import load_config
from kvindex.options import EnvOption
from producer.sim import SimConfig
from producer.simcli import Layout, engine_spec

from .apikit import get_json
from .conftest import EXIT_WITHIN, WAIT_WITHIN, free_ports, trace_path

pytestmark = pytest.mark.slow  # most tests start kvindex processes

KVINDEX = (sys.executable, "-m", "kvindex.cli")
TRACE = "chat-sha256"


def kvindex(*argv: str, env: dict[str, str] | None = None, check: bool = True):
    """Run ``kvindex argv...`` with the environment's ``KVINDEX_*`` variables
    replaced by ``env`` (a developer's own must not leak in)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    done = subprocess.run(
        [*KVINDEX, *argv], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})}
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def log_events(stderr: str) -> list[str]:
    return [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]


# --- help --------------------------------------------------------------------


def test_version() -> None:
    assert kvindex("--version").stdout == f"kvindex {version('kvindex')}\n"


def test_top_level_help_lists_every_command_in_plain_text() -> None:
    text = kvindex("--help").stdout
    assert "`" not in text  # no reST markup
    for name, command in cli.commands.items():
        assert re.search(rf"^  {name} +\S", text, re.M), name  # with its one-line summary
        assert command.help


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_each_command_has_help_with_an_example(name: str) -> None:
    text = kvindex(name, "--help").stdout
    example = text.split("Example:\n", 1)[1]
    assert re.search(rf"^ +(\S+=\S+ +)*kvindex {name}\b", example, re.M), text
    for param in cli.commands[name].params:
        if isinstance(param, click.Option):
            assert param.help, f"kvindex {name} {param.opts[0]} has no help"
            assert isinstance(param, EnvOption) and param.envvar in text, param.opts


# --- where settings come from ------------------------------------------------


def test_log_level_is_accepted_after_the_command_and_before() -> None:
    trace = str(trace_path(TRACE))
    after = kvindex("replay", trace, "--log-level", "INFO")
    before = kvindex("--log-level", "INFO", "replay", trace)
    assert log_events(after.stderr) == log_events(before.stderr) == ["replayed"]
    assert log_events(kvindex("replay", trace).stderr) == []  # WARNING by default


def test_flags_come_from_kvindex_variables() -> None:
    assert log_events(kvindex("replay", str(trace_path(TRACE)), env={
        "KVINDEX_LOG_LEVEL": "INFO"}).stderr) == ["replayed"]  # fmt: skip
    specs = kvindex("sim", "--print-specs", env={"KVINDEX_ENGINES": "3"}).stdout.splitlines()
    assert [json.loads(s)["name"] for s in specs] == ["sim-0", "sim-1", "sim-2"]


def test_a_flag_beats_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVINDEX_PORT", "9001")
    assert parse_args(["serve"]).port == 9001
    assert parse_args(["serve", "--port", "9002"]).port == 9002
    monkeypatch.setenv("KVINDEX_PORT", "ninety")
    with pytest.raises(SystemExit):
        parse_args(["serve"])


def test_repeated_flags_come_space_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVINDEX_ENGINE", "a=tcp://h:5557 b=tcp://h:5559,dp_ranks=2")
    engines = parse_args(["serve"]).engine
    assert [(e.name, e.endpoint, e.dp_ranks) for e in engines] == [
        ("a", "tcp://h:5557", 1),
        ("b", "tcp://h:5559", 2),
    ]


def test_config_fields_come_from_section_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kvindex.yaml"
    config.write_text("subscriber:\n  replay_timeout: 0.5\n  probe_interval: 0.2\n")
    monkeypatch.setenv("KVINDEX_SUBSCRIBER__REPLAY_TIMEOUT", "2.5")
    monkeypatch.setenv("KVINDEX_API__MAX_CONNECTIONS", "7")
    monkeypatch.setenv("KVINDEX_INDEXER__LEASE_TTL", "3")
    loaded = load_config(config)
    assert (loaded.subscriber.replay_timeout, loaded.subscriber.probe_interval) == (2.5, 0.2)
    assert loaded.api_settings().max_connections == 7
    assert load_config().indexer.lease_ttl == 3.0  # no file: the variables over the defaults
    monkeypatch.setenv("KVINDEX_SUBSCRIBER", '{"bind": {"tcp_hosts": ["10.0.0.7"]}}')
    loaded = load_config(config)  # a whole section as JSON, merged with the file and fields
    assert loaded.subscriber.bind.tcp_hosts == ["10.0.0.7"]
    assert (loaded.subscriber.replay_timeout, loaded.subscriber.probe_interval) == (2.5, 0.2)


def test_a_bad_section_variable_is_one_line_naming_it() -> None:
    done = kvindex("serve", env={"KVINDEX_SUBSCRIBER__REPLAY_TIMOUT": "2"}, check=False)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "kvindex serve: KVINDEX_* variables: Object contains unknown field `replay_timout`"
        " - at `$.subscriber`"
    ]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    return tmp_path / "secret"


def test_a_secret_comes_from_the_file_its_variable_names(secret: Path, redis_server) -> None:
    """A Redis URL holds its password: KVINDEX_REDIS_URL_FILE keeps it out of ps
    and of the environment. The replay lands in the Redis the file names."""
    secret.write_text(redis_server.url + "\n")
    env = {"KVINDEX_REDIS_URL_FILE": str(secret), "KVINDEX_REDIS_PREFIX": "clisecret"}
    report = json.loads(kvindex("replay", str(trace_path(TRACE)), env=env).stdout)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert report["blocks"]["GPU"] > 0
        assert client.keys("clisecret*")
    finally:
        client.close()


def test_a_missing_or_empty_secret_file_is_one_line(secret: Path) -> None:
    env = {"KVINDEX_REDIS_URL_FILE": str(secret)}
    done = kvindex("replay", "trace.msgpack", env=env, check=False)
    assert (done.returncode, done.stderr) == (
        2,
        f"kvindex replay: error: $KVINDEX_REDIS_URL_FILE {secret}: No such file or directory"
        " (see kvindex replay --help)\n",
    )
    secret.write_text("\n")
    done = kvindex("replay", "trace.msgpack", env=env, check=False)
    assert f"$KVINDEX_REDIS_URL_FILE {secret} is empty" in done.stderr


# --- kvindex status -----------------------------------------------------------


class Fleet:
    """``kvindex serve`` following one simulated engine (publishing) and one
    declared engine nothing publishes for."""

    def __init__(self, tmp_path: Path) -> None:
        self.port, base, ghost = free_ports(), free_ports(2), free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.log = tmp_path / "fleet.log"
        with self.log.open("w") as log:
            self.procs.append(self.start(log, "serve", "--port", str(self.port),
                                         "--engine", f"ghost=tcp://127.0.0.1:{ghost}"))  # fmt: skip
            self.procs.append(self.start(log, "sim", "--engines", "1", "--base-port", str(base)))
        self.http = httpx.Client(base_url=self.url, timeout=5)
        self.until(lambda: self.get("/healthz"), "the HTTP API")
        spec = engine_spec(Layout(1, base), 0, SimConfig(), "sim")
        assert self.http.post("/engines", json=spec).status_code == 201

    @staticmethod
    def start(log, *argv: str) -> subprocess.Popen:
        return subprocess.Popen([*KVINDEX, *argv], stdout=log, stderr=log)

    def get(self, path: str) -> dict | None:
        return get_json(self.http, path)

    def until(self, condition, what: str, timeout: float = WAIT_WITHIN) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert all(p.poll() is None for p in self.procs), self.log.read_text()
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.http.close()
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(timeout=EXIT_WITHIN)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop()


def table(text: str) -> dict[str, dict[str, str]]:
    """``kvindex status`` rows by engine, cells by header; the totals line as ``""``."""
    header, *lines = text.splitlines()
    headers = re.split(r"  +", header)
    end = next(i for i, line in enumerate(lines) if re.match(r"\d+ engines, ", line))
    rows = {"": {"totals": lines[end]}}
    for line in lines[:end]:
        cells = re.split(r"  +", line.strip())
        rows[cells[0]] = dict(zip(headers, cells, strict=True))
    return rows


def test_status_prints_the_fleet_of_a_running_server(fleet: Fleet) -> None:
    def sim_holds_blocks() -> bool:
        rank = (fleet.get("/engines/sim-0") or {"ranks": [{}]})["ranks"][0]
        return rank.get("connected", False) and rank.get("blocks", {}).get("GPU", 0) > 0

    fleet.until(sim_holds_blocks, "the simulated engine's blocks")
    rows = table(kvindex("status", env={"KVINDEX_URL": fleet.url}).stdout)
    assert set(rows) == {"ghost", "sim-0", ""}
    sim = rows["sim-0"]
    assert (sim["DP"], sim["STATE"]) == ("0", "ok")
    assert int(sim["GPU"]) > 0 and int(sim["CPU"]) >= 0 and sim["STORAGE"] == "0"
    assert int(sim["LAG BATCHES"]) >= 0 and float(sim["LAG S"]) >= 0
    assert rows["ghost"]["STATE"] in (  # never connected once the subscriber has waited long
        "degraded; not connected",
        "degraded; never connected: no publisher at its endpoint",
    )
    assert rows["ghost"]["GPU"] == "0"
    totals = rows[""]["totals"]
    assert re.fullmatch(
        r"2 engines, 2 ranks: 1 connected, [01] never connected, 1 degraded;"
        r" resident blocks GPU (\d+)  CPU (\d+)  STORAGE 0",
        totals,
    ), totals


def test_status_of_a_server_that_is_not_there() -> None:
    url = f"http://127.0.0.1:{free_ports()}"
    done = kvindex("status", "--url", url, check=False)
    assert done.returncode == 1
    assert done.stderr.startswith(f"kvindex status: cannot reach {url}/engines: ")
    assert len(done.stderr.splitlines()) == 1
