"""``kvindex serve``: config file and flags, then the real process end to end.

The process tests run ``python -m kvindex.cli serve`` against kvindex's own
vLLM-wire publisher, read the engine state over HTTP, and stop it with a
signal: it must exit 0 after stopping its ranks, and a restarted serve on the
same Redis index must carry on from the persisted watermark.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from indexer.engine_flags import parse_engine_flag
from indexer.engine_registry import EngineSpec
from kvindex.config import ConfigError, ServeConfig, load_config
from kvindex.http import listen
from producer.publisher import Publisher

from .apikit import get_json
from .conftest import EXIT_WITHIN, WAIT_WITHIN, free_ports, load_expected_json, trace_batches

YAML = """
engines:
  - name: a
    endpoint: tcp://127.0.0.1:{pub}
    replay_endpoint: tcp://127.0.0.1:{replay}
    blocks_per_chunk: 4
subscriber:
  replay_timeout: 0.5
  probe_interval: 0.2
api:
  auth_token: s3cret
"""

TOML = """
[[engines]]
name = "a"
endpoint = "tcp://127.0.0.1:{pub}"
replay_endpoint = "tcp://127.0.0.1:{replay}"
blocks_per_chunk = 4

[subscriber]
replay_timeout = 0.5
probe_interval = 0.2

[api]
auth_token = "s3cret"
"""


KVINDEX = (sys.executable, "-m", "kvindex.cli")


def write(path: Path, text: str, **ports: int) -> Path:
    path.write_text(text.format(**ports))
    return path


@pytest.mark.parametrize("name, text", [("kvindex.yaml", YAML), ("kvindex.toml", TOML)])
def test_config_file(tmp_path: Path, name: str, text: str) -> None:
    config = load_config(write(tmp_path / name, text, pub=5557, replay=5558))
    assert config.engines == [
        EngineSpec(
            "a",
            "tcp://127.0.0.1:5557",
            replay_endpoint="tcp://127.0.0.1:5558",
            blocks_per_chunk=4,
        )
    ]
    assert (config.subscriber.replay_timeout, config.subscriber.probe_interval) == (0.5, 0.2)
    assert config.subscriber.replay_attempts == 3  # defaults for the rest
    assert config.api_settings().auth_token == "s3cret"
    assert config.redis_config(None) is None
    assert config.redis_config("redis://10.0.0.1:6379/2").url == "redis://10.0.0.1:6379/2"


@pytest.mark.parametrize(
    "text, where",
    [
        ("subscriber:\n  replay_timout: 1\n", "replay_timout"),
        ("engines:\n  - name: a\n    endpoint: udp://x:1\n", "endpoint"),
        ("engines: {}\n", "engines"),
        ("api: [1\n", "kvindex.yaml"),
    ],
)
def test_config_errors_say_what_is_wrong(tmp_path: Path, text: str, where: str) -> None:
    (tmp_path / "kvindex.yaml").write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_config(tmp_path / "kvindex.yaml")


def test_unknown_api_field_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"api: unknown field.*auth_tokn"):
        ServeConfig(api={"auth_tokn": "x"}).api_settings()


def test_engine_flag() -> None:
    spec = parse_engine_flag("a=tcp://h:5557,replay_endpoint=tcp://h:5567,dp_ranks=2,bind=true")
    assert spec == EngineSpec(
        "a", "tcp://h:5557", replay_endpoint="tcp://h:5567", dp_ranks=2, bind=True
    )
    assert parse_engine_flag("b=tcp://h:1,hash_algo=null").hash_algo is None
    for bad in ("a", "a=tcp://h:1,dp_ranks", "a=tcp://h:1,dp_ranks=x", "a=tcp://h:1,color=red"):
        with pytest.raises(ValueError, match="--engine"):
            parse_engine_flag(bad)


class Serve:
    """A ``kvindex serve`` child process and an HTTP client to it."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port, self.log = free_ports(), log
        with log.open("w") as stderr:  # not a pipe: nobody reads it until the end
            self.proc = subprocess.Popen(
                [*KVINDEX, "--log-level", "INFO", "serve", "--port", str(self.port), *args],
                stderr=stderr,
            )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5)
        self.until(lambda: self.get("/healthz") is not None, "the HTTP API")

    def get(self, path: str) -> dict | None:
        return get_json(self.http, path)

    def rank(self, engine: str, dp_rank: int = 0) -> dict:
        return (self.get(f"/engines/{engine}") or {"ranks": [{}] * (dp_rank + 1)})["ranks"][dp_rank]

    def until(self, condition, what: str, timeout: float = WAIT_WITHIN) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"serve exited: {self.logs()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def logs(self) -> str:
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM) -> list[dict]:
        """Signal it; returns its log lines once it has exited 0."""
        self.http.close()
        self.proc.send_signal(sig)
        assert self.proc.wait(timeout=EXIT_WITHIN) == 0, self.logs()
        lines = self.logs().splitlines()
        return [msgspec.json.decode(line) for line in lines if line.startswith("{")]


def publisher(pub: int, replay: int) -> Publisher:
    return Publisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", bind=True)


def publish(publisher: Publisher, items) -> None:
    for batch in items:
        assert publisher.publish(batch)
    assert publisher.flush()


def blocks_of(name: str) -> dict[str, int]:
    want = load_expected_json(name)["expected"]
    return {"GPU": len(want["gpu_refcounts"]), "CPU": len(want["cpu_refcounts"]), "STORAGE": 0}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_consumes_config_and_flag_engines(tmp_path: Path, sig: int) -> None:
    a, b = (free_ports(), free_ports()), (free_ports(), free_ports())
    config = write(tmp_path / "kvindex.yaml", YAML, pub=a[0], replay=a[1])
    flag = f"b=tcp://127.0.0.1:{b[0]},replay_endpoint=tcp://127.0.0.1:{b[1]}"
    with publisher(*a) as pub_a, publisher(*b) as pub_b:
        serve = Serve(tmp_path / "serve.log", "--config", str(config), "--engine", flag)
        publish(pub_a, trace_batches("chat-sha256"))
        publish(pub_b, trace_batches("chat-gpu-only"))
        serve.until(lambda: serve.rank("a").get("applied_seq") == 249, "a to catch up")
        serve.until(lambda: serve.rank("b").get("applied_seq") == 199, "b to catch up")
        assert serve.rank("a")["blocks"] == blocks_of("chat-sha256")
        assert serve.rank("b")["blocks"] == blocks_of("chat-gpu-only")
        assert serve.rank("a")["connected"] and not serve.rank("a")["degraded"]
        assert serve.get("/readyz") == {"status": "ok"}
        probe = max(load_expected_json("chat-sha256")["probes"], key=lambda p: p["gpu_tokens"])
        prompt = probe["tokens"] + [7] * (8192 - len(probe["tokens"]))  # an 8k-token GET
        answer = serve.http.get(
            "/prefix-match", params={"tokens": ",".join(map(str, prompt)), "engines": "a"}
        ).json()
        assert answer["engines"][0]["gpu_blocks"] * 16 == probe["gpu_tokens"]
        metrics = serve.http.get("/metrics").text
        assert 'kvindex_ingest_batches_total{dp_rank="0",engine="a"} 250.0' in metrics
        assert 'kvindex_ingest_lag_batches{dp_rank="0",engine="b"} 0.0' in metrics
        logs = serve.stop(sig)
    events = [(e["event"], e.get("engine")) for e in logs]
    assert ("rank connected", "a") in events and ("rank connected", "b") in events
    assert events[-1] == ("stopped", None)


@pytest.mark.slow
def test_serve_resumes_from_the_redis_watermark(tmp_path: Path, redis_server) -> None:
    """Stopped mid-stream and started again: no batch lost, none applied twice."""
    ports = (free_ports(), free_ports())
    config = write(
        tmp_path / "kvindex.yaml",
        YAML + f"redis:\n  url: {redis_server.url}\n  prefix: serve{ports[0]}\n",
        pub=ports[0],
        replay=ports[1],
    )
    items = trace_batches("chat-sha256")
    with publisher(*ports) as pub:
        serve = Serve(tmp_path / "first.log", "--config", str(config))
        publish(pub, items[:150])
        serve.until(lambda: serve.rank("a").get("applied_seq") == 149, "the first 150 batches")
        serve.stop()
        publish(pub, items[150:])
        serve = Serve(tmp_path / "second.log", "--config", str(config))
        serve.until(lambda: serve.rank("a").get("applied_seq") == 249, "the rest")
        rank = serve.rank("a")
        serve.stop()
    assert rank["blocks"] == blocks_of("chat-sha256")
    assert rank["restarts"] == 0 and rank["duplicates"] == 0
    assert not rank["degraded"]


async def test_listening_socket_gets_tcp_nodelay_on_accept() -> None:
    """Without it, keep-alive responses stall ~40 ms on Nagle + delayed ACK."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    with listen("127.0.0.1", 0) as sock:
        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        await asyncio.wait_for(server.start_serving(), 5)
        while not accepted:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
    assert accepted == [1]


def test_ipc_endpoint_takes_a_single_rank() -> None:
    assert parse_engine_flag("a=ipc:///tmp/kv").rank_endpoint(0) == "ipc:///tmp/kv"
    with pytest.raises(ValueError, match="dp_ranks > 1"):
        parse_engine_flag("a=ipc:///tmp/kv,dp_ranks=2")


async def test_request_heads_are_bounded_by_max_body_bytes() -> None:
    """A GET prompt may be as long as a POST body, and no longer, whatever HTTP parser
    is installed (h11 counts a head still arriving, so the refused one spans reads)."""
    from fastapi import FastAPI

    from api import ApiSettings
    from kvindex.http import serve_http

    app = FastAPI()

    @app.get("/echo")
    async def echo(q: str) -> int:
        return len(q)

    async def status(port: int, length: int) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /echo?q={'x' * length} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        line = await reader.readline()
        writer.close()
        return int(line.split()[1])

    stop = asyncio.Event()
    with listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        settings = ApiSettings(max_body_bytes=1 << 20)
        served = asyncio.create_task(serve_http(app, settings, sock, stop))
        codes = [await status(port, n) for n in (2048, 200_000, 2_000_000, 2048)]
        stop.set()
        await asyncio.wait_for(served, 10)
    assert codes == [200, 200, 431, 200]
