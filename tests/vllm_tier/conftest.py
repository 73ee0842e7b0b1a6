"""The vLLM tier: one vLLM release's real config objects on the CPU, kvindex's plugin
loaded by vLLM's own loader, and a real ``kvindex serve`` it announces to.

vLLM needs no GPU to build its config: ``VLLM_TARGET_DEVICE=cpu`` and a
"model" that is only a ``config.json`` (a tiny Llama) with a tokenizer folder
from the shared fixtures; no weights are loaded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM 0.34 refuses an x86 CPU without Triton. The venv holds the real Triton (in the
# pinned list; its backends are GPU ones, with no device here); with no device visible
# vLLM keeps it, as on a worker whose devices come up later. Nothing here runs a kernel.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

SHARED = Path(__file__).resolve().parents[3] / "shared"
TOKENIZER = SHARED / "fixtures" / "vllm-0.33.0" / "tokenize" / "llama3ish"
TOKEN = "tier-token"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 4008,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
    "bos_token_id": 4000,
    "eos_token_id": 4007,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


class Serve:
    """``kvindex serve`` (this venv's kvindex, run outside the checkout so that
    ``-m`` does not import the checkout's), with a bearer token or without, and
    any other options of ``kvindex serve`` (``args``)."""

    def __init__(self, workdir: Path, token: str | None, *args: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "kvindex.cli", "serve", "--port", str(port), *args]
        # as an operator reads it: a hash seed is answered only to the token's holder
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if token is not None:
            (workdir / "token").write_text(token)
            command += ["--auth-token-file", str(workdir / "token")]
        self.log = workdir / "serve.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"kvindex serve did not start: {self.log.read_text()}")

    def engine(self, name: str) -> httpx.Response:
        return httpx.get(f"{self.url}/engines/{name}", headers=self._headers)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def serve(tmp_path_factory) -> Iterator[Serve]:
    server = Serve(tmp_path_factory.mktemp("serve"), TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def open_serve(tmp_path_factory) -> Iterator[Serve]:
    """No token configured: an announcement may not carry a hash seed."""
    server = Serve(tmp_path_factory.mktemp("open-serve"), None)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plugins(serve) -> None:
    """vLLM's loader runs the entry points of ``vllm.general_plugins`` once per process,
    as the engine core does first thing: kvindex's is among them."""
    from vllm.plugins import load_general_plugins

    os.environ["KVINDEX_ANNOUNCE_URL"] = serve.url
    os.environ["KVINDEX_ENGINE_HOST"] = "127.0.0.1"
    load_general_plugins()
