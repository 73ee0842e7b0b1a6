"""What the SGLang server tier's tests share: the processes (:mod:`.conftest` starts them),
requests to SGLang and to kvindex, and the check every test makes.

:func:`exact` is that check: once SGLang's earlier events are in kvindex (:func:`settle`),
kvindex's answer for a request equals the ``cached_tokens`` SGLang then reports for it,
and kvindex hashes as many whole pages as SGLang's ``prompt_tokens`` make. SGLang computes
at least one token of every prompt, so of a prompt whose pages are all held it reports one
page less (its last whole page ends the prompt).
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.real_server.tiny_model import WORDS

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "shim"
VENV = Path(
    os.environ.get(
        "KVINDEX_SGLANG_SERVER_VENV", Path.home() / ".cache/kvindex/sglang-0.5.23-server-venv"
    )
)
SGLANG = VENV / "bin" / "python"
PAGE = 16
MODEL = "tiny"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: Seconds a condition may take to come true: the server is slow on a loaded 2-core machine.
WITHIN = 60.0
#: Seconds one SGLang request may take.
REQUEST = 600.0
T = TypeVar("T")
_markers = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{url} exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            httpx.get(url, timeout=2).raise_for_status()
            return
        except httpx.HTTPError:
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


def eventually(probe: Callable[[], T], done: Callable[[T], bool], what: str) -> T:
    """``probe()`` again until ``done`` says yes of it, within :data:`WITHIN` seconds."""
    deadline = time.monotonic() + WITHIN
    while not done(seen := probe()):
        assert time.monotonic() < deadline, f"{what} not within {WITHIN} s: {seen}"
        time.sleep(0.2)
    return seen


def text(words: int, seed: int) -> str:
    """``words`` words of the tiny tokenizer's vocabulary, the same for the same seed."""
    return " ".join(random.Random(seed).choices(WORDS, k=words))


@dataclass(frozen=True)
class Sglang:
    """The SGLang server: its URL, its event ports and its log."""

    url: str
    events: int
    replay: int
    log: Path

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(f"{self.url}{path}", json={"model": MODEL, **body}, timeout=REQUEST)
        return answer.raise_for_status().json()

    def complete(self, prompt: str, **fields: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}
        return self.post("/v1/completions", body)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).raise_for_status().text

    def no_kernel_called(self) -> bool:
        return "[sgl_kernel shim] CALLED" not in self.log.read_text()


@dataclass(frozen=True)
class Kvindex:
    """The ``kvindex serve`` following the SGLang server."""

    url: str

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=30)

    def match(self, engine: str, **query: Any) -> dict[str, Any]:
        """The answer for one engine, with the query's ``num_blocks`` beside its entry."""
        body = {"model": MODEL, "engines": [engine], **query}
        answer = self.post("/prefix-match", body).raise_for_status().json()
        (entry,) = answer["engines"]
        return {**entry, "num_blocks": answer["num_blocks"]}

    def engine(self, name: str) -> dict[str, Any]:
        return httpx.get(f"{self.url}/engines/{name}", timeout=30).raise_for_status().json()


@contextmanager
def engine_by_url(kv: Kvindex, sglang: Sglang, name: str) -> Iterator[dict[str, Any]]:
    """An SGLang engine registered by its server's URL alone, as kvindex answered it;
    removed after, and its ranks connected before."""
    answer = kv.post("/engines", {"url": sglang.url, "adapter": "sglang", "name": name})
    assert answer.status_code == 201, answer.text
    try:
        eventually(
            lambda: kv.engine(name)["ranks"],
            lambda ranks: all(rank["connected"] for rank in ranks),
            f"{name}'s ranks connected",
        )
        yield answer.json()
    finally:
        httpx.delete(f"{kv.url}/engines/{name}", timeout=30).raise_for_status()


def settle(sglang: Sglang, kv: Kvindex, engines: list[str]) -> None:
    """Wait until kvindex holds every event SGLang published so far: a fresh prompt is
    served, and kvindex holds its first page (SGLang publishes in order)."""
    marker = f"marker {next(_markers)} {text(30, time.monotonic_ns())}"
    sglang.complete(marker, max_tokens=1)
    for engine in engines:
        eventually(
            lambda e=engine: kv.match(e, prompt=marker)["prefix_tokens"],
            lambda held: held >= PAGE,
            f"{engine} holding the first page of {marker!r}",
        )


def exact(
    sglang: Sglang, kv: Kvindex, engines: list[str], path: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Ask kvindex of each engine for the request's prompt (its ``messages`` or ``prompt``)
    once it holds SGLang's events, send the request to SGLang, and check kvindex said what
    SGLang reports; SGLang's answer."""
    settle(sglang, kv, engines)
    query = {key: body[key] for key in ("messages", "prompt") if key in body}
    answers = {engine: kv.match(engine, **query) for engine in engines}
    answer = sglang.post(path, {"max_tokens": 3, "temperature": 0, **body})
    usage = answer["usage"]
    prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    for engine, said in answers.items():
        assert said["num_blocks"] == prompt // PAGE, (engine, said, usage)
        held = said["prefix_tokens"]
        assert cached == min(held, (prompt - 1) // PAGE * PAGE), (engine, said, usage)
    assert sglang.no_kernel_called()
    return answer


def chat_exact(
    sglang: Sglang, kv: Kvindex, engines: list[str], messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """:func:`exact` for a chat completion."""
    return exact(sglang, kv, engines, "/v1/chat/completions", {"messages": messages})
