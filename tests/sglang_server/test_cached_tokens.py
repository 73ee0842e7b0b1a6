"""A whole SGLang 0.5.23 server (``--device cpu``) followed by a real ``kvindex serve``: what
kvindex answers for a ``messages`` query equals the ``cached_tokens`` SGLang then reports
for the same request. SGLang runs from its own venv ($KVINDEX_SGLANG_SERVER_VENV), kvindex
with the Python running this test; the tiny model is the real-server tier's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "shim"
VENV = Path(
    os.environ.get(
        "KVINDEX_SGLANG_SERVER_VENV", Path.home() / ".cache/kvindex/sglang-0.5.23-server-venv"
    )
)
SGLANG = VENV / "bin" / "python"
PAGE = 16
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.load(answer)


def wait_until_up(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"{url} not up in {timeout} s:\n{log.read_text()[-4000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    work = tmp_path_factory.mktemp("sglang-server")
    model = work / "model"
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(SHIM)}
    subprocess.run(
        [str(SGLANG), str(ROOT / "tests/real_server/tiny_model.py"), str(model)],
        env=env,
        check=True,
        capture_output=True,
    )
    port, events, replay, kv_port = free_port(), free_port(), free_port(), free_port()
    events_config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    sglang_log = work / "sglang.log"
    sglang = subprocess.Popen(
        [
            str(SGLANG),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--page-size",
            str(PAGE),
            "--enable-cache-report",
            "--max-total-tokens",
            "16384",
            "--kv-events-config",
            json.dumps(events_config),
        ],
        env={**env, "SGLANG_USE_CPU_ENGINE": "1"},
        stdout=sglang_log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (work / "kvindex.yaml").write_text(json.dumps({"models": {"tiny": {"tokenizer": str(model)}}}))
    engine = (
        f"sgl=tcp://127.0.0.1:{events},adapter=sglang,block_size={PAGE},model=tiny,"
        f"replay_endpoint=tcp://127.0.0.1:{replay},topic=kv"
    )
    kv_log = work / "kvindex.log"
    kvindex = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvindex.cli",
            "serve",
            "--port",
            str(kv_port),
            "--config",
            str(work / "kvindex.yaml"),
            "--engine",
            engine,
        ],
        cwd=work,
        env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)},
        stdout=kv_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{kv_port}/healthz", kvindex, kv_log, 60)
        wait_until_up(f"http://127.0.0.1:{port}/health", sglang, sglang_log, 600)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{kv_port}", sglang_log
    finally:
        stop(sglang)
        stop(kvindex)
        assert "[sgl_kernel shim] CALLED" not in sglang_log.read_text()


def prefix_tokens(kv: str, messages: list[dict]) -> int:
    answer = post(f"{kv}/prefix-match", {"model": "tiny", "messages": messages})
    (engine,) = answer["engines"]
    return engine["prefix_tokens"]


def test_kvindex_answers_what_sglang_reports_as_cached(servers) -> None:
    sglang, kv, log = servers
    words = [
        "fip",
        "zorbu",
        "quala",
        "mendo",
        "trask",
        "velin",
        "oputa",
        "grane",
        "sorvik",
        "lumbe",
    ]
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": " ".join(words * 9)},
    ]
    request = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0}
    assert prefix_tokens(kv, messages) == 0
    first = post(f"{sglang}/v1/chat/completions", request)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the prompt's pages arrive as events; wait until kvindex holds them all
    prompt = first["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 30
    while (held := prefix_tokens(kv, messages)) < prompt // PAGE * PAGE:
        assert time.monotonic() < deadline, f"kvindex holds {held} of {prompt} tokens"
        time.sleep(0.2)
    second = post(f"{sglang}/v1/chat/completions", request)
    assert held == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "[sgl_kernel shim] CALLED" not in log.read_text()
