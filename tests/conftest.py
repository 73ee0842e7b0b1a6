"""Shared test fixtures: the golden data from vLLM 0.33.0 (../shared/fixtures)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from indexer.core.events import CPU, GPU, EventBatch, RankId
from indexer.engines.vllm.wire import decode_batch
from indexer.ingest.trace import load_trace
from indexer.stores import MemoryStore, Store
from indexer.stores.redis import RedisConfig, RedisStore

if TYPE_CHECKING:
    from .servers import LocalCluster, RedisServer

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "vllm-0.33.0"
#: Every release's golden data: 0.33.0's in ../shared, later ones written by the vLLM tier
#: (tests/vllm_tier/golden.py) and checked in here.
RELEASES = {
    "0.33.0": FIXTURES,
    "0.34.0": Path(__file__).resolve().parent / "fixtures" / "vllm-0.34.0",
    #: 0.33.0's traces that ../shared lacks (its golden data is read-only there)
    "0.33.0-extra": Path(__file__).resolve().parent / "fixtures" / "vllm-0.33.0-extra",
}
CHAT_TRACES = ("chat-sha256", "chat-gpu-only", "chat-placeholders", "chat-clear")
#: A trace is named by its name alone in 0.33.0's data, by ``RELEASE/NAME`` in a later one's.
TRACE_NAMES = CHAT_TRACES + tuple(f"0.34.0/{name}" for name in CHAT_TRACES)
#: Hybrid models: full attention with a sliding-window group, and with a Mamba group (on
#: 0.34.0 also with the offloading connector: Mamba checkpoints on the CPU tier).
HYBRID_TRACE_NAMES = (
    "hybrid-sliding",
    "hybrid-mamba",
    "0.34.0/hybrid-sliding",
    "0.34.0/hybrid-mamba",
    "0.34.0/mamba-offload",
)
#: EAGLE drafting with the offloading connector: vLLM 0.34 hashes with lookahead, and
#: its CPU stores carry the lookahead tokens (``engine.lookahead_tokens`` says how many).
LOOKAHEAD_TRACE_NAMES = ("0.34.0/eagle-offload",)
#: A storage tier below the CPU tier (vLLM 0.34's file-system tier): its stores, as the
#: CPU tier's, built from the request context (``expected.storage_refcounts``: its chunks).
STORAGE_TRACE_NAMES = ("0.34.0/storage-context",)
#: blocks of 64 tokens hashed every 16 (partial tails), as each release records them
TAIL_TRACE_NAMES = ("0.34.0/mamba-partial-tail", "0.33.0-extra/mamba-partial-tail")


def probe_answers(expected: dict) -> list[dict[str, int]]:
    """vLLM's answers to a fixture's probes, as ``kvindex replay`` reports them.

    The full-attention hit is group 0's own hit in hybrid fixtures (group 0
    is full attention there), and the hit itself in the others.
    """
    return [
        {
            "gpu_tokens": p["gpu_tokens"],
            "cpu_prefix_tokens": p["cpu_prefix_tokens"],
            "gpu_full_attention_tokens": p.get("gpu_tokens_by_group", [p["gpu_tokens"]])[0],
        }
        for p in expected["probes"]
    ]


def _traces(name: str) -> tuple[Path, str]:
    """Where a trace lies (see TRACE_NAMES) and its file name's stem."""
    release, _, stem = name.rpartition("/")
    return RELEASES[release or "0.33.0"] / "traces", stem


def trace_path(name: str) -> Path:
    folder, stem = _traces(name)
    return folder / f"{stem}.frames.msgpack"


def expected_path(name: str) -> Path:
    folder, stem = _traces(name)
    return folder / f"{stem}.expected.json"


def load_expected_json(name: str) -> dict:
    return json.loads(expected_path(name).read_text())


def trace_batches(*names: str) -> list[EventBatch]:
    """The decoded batches of fixture traces, one after another.

    Each release's traces were recorded in TRACE_NAMES order, so batch ts keep rising
    when the names come in that order.
    """
    return [decode_batch(p) for name in names for _, p in load_trace(trace_path(name))]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"golden fixtures missing: {FIXTURES} (clone with ../shared beside it)")
    return FIXTURES


#: Seconds a kvindex process may take to exit after SIGTERM or SIGINT: it winds down its
#: ranks and servers first, which a busy machine can stretch far past the usual second
#: (a process that hangs is caught by the test's own timeout, with every stack).
EXIT_WITHIN = 240
#: Seconds a test waits by default for a kvindex process to reach a state by itself
#: (serving, connected, applied): under a second on a quiet machine, and a busy one can
#: stretch that a hundredfold.
WAIT_WITHIN = 120.0


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive free TCP ports on 127.0.0.1.

    Data-parallel rank r of an engine uses port + r, so multi-rank tests need a run.
    """
    while True:
        with ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            try:
                for port in range(base + 1, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base


async def wait_until(
    condition: Callable[[], bool], timeout: float = WAIT_WITHIN, what: str = ""
) -> None:
    """Poll ``condition`` every 10 ms; fail the test if it is still false after ``timeout``
    (10 s failed under load: a publisher reconnecting alone can take ZeroMQ's 10 s backoff)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(0.01)


async def assert_matches_trace(store, rank: RankId, name: str) -> None:
    """The store's GPU and CPU refcounts are vLLM's own at the end of the trace."""
    want = load_expected_json(name)["expected"]
    for medium, key in ((GPU, "gpu_refcounts"), (CPU, "cpu_refcounts")):
        assert (await store.block_counts(rank))[medium] == len(want[key]), medium
        for h, n in want[key].items():
            rows = await store.block_residency(int(h))
            got = sum(r.count for r in rows if (r.engine, r.dp_rank, r.medium) == (*rank, medium))
            assert got == n, (medium, h)


# --- a compiled extension missing, as when it never built ---------------------------

REPO = Path(__file__).resolve().parents[1]


def run_without(module: str, script: str) -> object:
    """What ``script`` prints, ``[status, value]`` as JSON, when run in a fresh
    interpreter in which ``module`` cannot be imported; ``value`` is returned once the
    status says the compiled core is off and names ``module`` as why.

    The module is blocked before kvindex is imported, so kvindex meets the
    ImportError it would meet on a machine where the extension never built.
    """
    result = subprocess.run(
        [sys.executable, "-c", _blocking(module) + script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    status, value = json.loads(result.stdout)
    assert status["compiled_core"] is False
    assert module in status["compiled_core_error"]
    return value


def serve_warning_without(module: str) -> str:
    """The warning ``kvindex serve`` started without ``module`` logs first (before
    it serves), once it is checked to be a warning of serve's naming ``module``."""
    serve = f"main(['serve', '--port', '{free_ports()}'])"
    script = f"import sys\nfrom kvindex.cli import main\nsys.exit({serve})\n"
    process = subprocess.Popen(
        [sys.executable, "-c", _blocking(module) + script],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stderr.readline()
    finally:
        process.terminate()
        process.wait(10)
        process.stderr.close()
    entry = json.loads(line)
    assert entry["level"] == "warning"
    assert entry["role"] == "serve"
    assert module in entry["import_error"]
    return entry["event"]


def _blocking(module: str) -> str:
    return f"import sys; sys.modules[{module!r}] = None\n"


# --- tiers ---------------------------------------------------------------------------

#: Fixtures that start real servers, and the marker each gives a test that uses one.
_SERVER_MARKERS = {
    "redis_server": "redis",
    "durable_redis": "redis",
    "volatile_redis": "redis",
    "redis_cluster": "cluster",
}
#: Parameter values that pick a Redis backend (the ``store`` fixture and its kin).
_BACKEND_MARKERS = {"redis": "redis", "cluster": "cluster"}


def _server_markers(item: pytest.Item) -> set[str]:
    """``redis`` / ``cluster`` for a test that needs that server: by fixture or by backend."""
    names = {_SERVER_MARKERS[f] for f in getattr(item, "fixturenames", ()) if f in _SERVER_MARKERS}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        values = [v for v in callspec.params.values() if isinstance(v, str)]
        names |= {_BACKEND_MARKERS[v] for v in values if v in _BACKEND_MARKERS}
    if "cluster" in names:
        names.add("redis")
    return names


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what needs Redis, so ``-m "not redis"`` runs where no redis-server is installed."""
    for item in items:
        for name in sorted(_server_markers(item)):
            item.add_marker(name)


# --- every store: memory, a standalone redis-server, a 3-master Redis Cluster -------


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    server = server_for(request, request.param)
    redis = RedisStore(redis_config(server.url, cluster=request.param == "cluster"))
    yield redis
    await redis.close()


def server_for(request: pytest.FixtureRequest, kind: str) -> RedisServer | LocalCluster:
    """The session's standalone server ("redis") or cluster ("cluster")."""
    return request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")


def redis_config(url: str, cluster: bool = False) -> RedisConfig:
    """A config with a prefix of its own, so tests share servers without sharing state."""
    return RedisConfig(
        url, prefix=f"t-{uuid.uuid4().hex[:12]}", cluster=cluster, sweep_interval=None
    )


# Real redis-server / Redis Cluster processes, shared by the session (tests/servers.py).
from .servers import (  # noqa: E402, F401
    durable_redis,
    redis_cluster,
    redis_server,
    volatile_redis,
)
