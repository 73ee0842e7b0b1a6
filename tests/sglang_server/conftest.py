"""The SGLang server tier's processes, started once a session: a whole SGLang 0.5.23 server
(``--device cpu``, from its own venv, $KVINDEX_SGLANG_SERVER_VENV) serving the real-server
tier's tiny model with KV events and metrics on, and a real ``kvindex serve`` (the Python
running the tests) following it as engine ``sgl``, registered by its endpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.sglang_server.kit import (
    MODEL,
    OFFLINE,
    PAGE,
    ROOT,
    SGLANG,
    SHIM,
    Kvindex,
    Sglang,
    free_port,
    stop,
    wait_until_up,
)

#: The engine registered by its endpoints.
BY_ENDPOINTS = "sgl"


@pytest.fixture(scope="session")
def servers(tmp_path_factory) -> Iterator[tuple[Sglang, Kvindex]]:
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
    sglang = Sglang(f"http://127.0.0.1:{port}", events, replay, work / "sglang.log")
    server = subprocess.Popen(
        [
            str(SGLANG),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--served-model-name",
            MODEL,
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--page-size",
            str(PAGE),
            "--enable-cache-report",
            "--enable-metrics",
            "--max-total-tokens",
            "16384",
            "--kv-events-config",
            json.dumps(events_config),
        ],
        env={**env, "SGLANG_USE_CPU_ENGINE": "1"},
        stdout=sglang.log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (work / "kvindex.yaml").write_text(json.dumps({"models": {MODEL: {"tokenizer": str(model)}}}))
    engine = (
        f"{BY_ENDPOINTS}=tcp://127.0.0.1:{events},adapter=sglang,block_size={PAGE},"
        f"model={MODEL},replay_endpoint=tcp://127.0.0.1:{replay},topic=kv"
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
        wait_until_up(f"{sglang.url}/health", server, sglang.log, 600)
        yield sglang, Kvindex(f"http://127.0.0.1:{kv_port}")
    finally:
        stop(server)
        stop(kvindex)
        assert sglang.no_kernel_called()


@pytest.fixture
def sglang(servers) -> Sglang:
    return servers[0]


@pytest.fixture
def kv(servers) -> Kvindex:
    return servers[1]
