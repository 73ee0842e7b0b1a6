"""``kvindex.client`` against a real kvindex: uvicorn on a free port, real 503s from a
Redis store whose server is not there yet."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import typing
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI

from api import ApiSettings
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry, RankStatus
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.vllm.render import ChatMessage
from indexer.prompts import ModelTokenizer, Tokenizers
from indexer.stores import MemoryStore
from indexer.stores.base import Store
from indexer.stores.redis import RedisConfig, RedisStore
from kvindex.client import (
    AsyncKvindex,
    EngineMatch,
    Kvindex,
    KvindexError,
    KvindexUnavailable,
    PrefixMatch,
    best_rank,
)
from kvindex.wiring import api_app

from .apikit import FakeConsumers, engine
from .servers import RedisServer, free_port

CHATML = Path(__file__).resolve().parents[2] / "shared/fixtures/vllm-0.33.0/tokenize/chatmlish"
MESSAGES = [
    {"role": "system", "content": "You are a router's test."},
    {"role": "user", "content": "Which engine holds this conversation? " * 12},
]
SHA = catalog.adapter("vllm").hasher("sha256", None, 16)


def _server(app: FastAPI) -> tuple[str, uvicorn.Server]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error")
    return f"http://127.0.0.1:{port}", uvicorn.Server(config)


@contextmanager
def served(app: FastAPI) -> Iterator[tuple[str, uvicorn.Server]]:
    """``app`` on a real uvicorn server in a thread of its own, for blocking clients."""
    url, server = _server(app)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(10)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[tuple[str, uvicorn.Server]]:
    """``app`` on a real uvicorn server in this event loop (the app's store lives here)."""
    url, server = _server(app)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield url, server
    finally:
        server.should_exit = True
        await task


class Fleet:
    """An app with two ranks of a chat model's engine, rank 1 holding the longer prefix."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or MemoryStore()
        self.registry = EngineRegistry()
        self.consumers = FakeConsumers(self.store)
        settings = ApiSettings(models={"chat": ModelTokenizer(str(CHATML))})
        self.app = api_app(self.store, self.registry, self.consumers, settings)
        self.tokens: list[int] = []

    async def fill(self, tokens: list[int]) -> None:
        await self.registry.add(engine("e", model="chat", hash_algo="sha256", dp_ranks=2))
        self.consumers.statuses["e"] = [RankStatus(dp_rank=r, connected=True) for r in (0, 1)]
        chain = SHA.published(SHA.digests(Prompt(tuple(tokens))))
        for rank, held in ((0, 1), (1, len(chain))):
            event = BlockStored(chain[:held], None, tokens[: held * 16], 16, extra_keys=None)
            await self.consumers.apply(RankId("e", rank), 1, EventBatch(1.0, [event], 0))


@pytest.fixture
async def fleet() -> Fleet:
    """A fleet holding the blocks of ``MESSAGES`` as the chat model's vLLM tokenizes them."""
    fleet = Fleet()
    pool = Tokenizers({"chat": ModelTokenizer(str(CHATML))})
    fleet.tokens = await pool.tokens("chat", messages=[ChatMessage(**m) for m in MESSAGES])
    await fleet.fill(fleet.tokens)
    return fleet


async def test_the_async_client_answers_typed_rows_over_one_connection(fleet: Fleet) -> None:
    async with serving(fleet.app) as (url, server), AsyncKvindex(url) as kv:
        by_chat = await kv.prefix_match(model="chat", messages=MESSAGES)
        by_tokens = await kv.prefix_match(tokens=fleet.tokens)
        again = await kv.prefix_match(model="chat", messages=MESSAGES, engines=["e"])
        assert len(server.server_state.connections) == 1  # kept open, reused
    assert isinstance(by_chat, PrefixMatch) and isinstance(by_chat.engines[0], EngineMatch)
    assert by_chat == by_tokens == again
    full = len(fleet.tokens) // 16
    assert [(e.dp_rank, e.prefix_blocks) for e in by_chat.engines] == [(1, full), (0, 1)]
    assert best_rank(by_chat) == by_chat.engines[0]


def test_the_blocking_client_answers_the_same(fleet: Fleet) -> None:
    with served(fleet.app) as (url, _), Kvindex(url) as kv:
        match = kv.prefix_match(model="chat", messages=MESSAGES, add_generation_prompt=True)
        no_prompt = kv.prefix_match(model="chat", messages=MESSAGES, add_generation_prompt=False)
    best = best_rank(match)
    assert best is not None and (best.engine, best.dp_rank) == ("e", 1)
    assert best.prefix_blocks == len(fleet.tokens) // 16
    # Without the generation prompt the last block differs: one block fewer at most.
    assert best_rank(no_prompt).prefix_blocks in (best.prefix_blocks, best.prefix_blocks - 1)


async def test_a_refusal_is_raised_at_once_with_kvindexs_message(fleet: Fleet) -> None:
    sent = []
    hooks = {"request": [lambda request: _count(sent, request)]}
    async with serving(fleet.app) as (url, _), httpx.AsyncClient(event_hooks=hooks) as http:
        kv = AsyncKvindex(url, client=http, retries=5)
        with pytest.raises(KvindexError) as refused:
            await kv.prefix_match(model="chat", messages=MESSAGES, tokens=[1, 2])
    assert refused.value.status == 400 and not isinstance(refused.value, KvindexUnavailable)
    assert "got tokens and messages" in refused.value.message
    assert len(sent) == 1


async def _count(sent: list, request: httpx.Request) -> None:
    sent.append(request)


@pytest.mark.redis
@pytest.mark.slow
async def test_503s_are_retried_with_backoff_until_the_store_is_back(tmp_path: Path) -> None:
    """The Redis store's server is not running: kvindex answers 503 (for real) until it
    starts, and the client retries through it."""
    port = free_port()
    store = RedisStore(RedisConfig(f"redis://127.0.0.1:{port}/0", retries=0))
    fleet = Fleet(store)
    await fleet.registry.add(engine("e", model="chat", hash_algo="sha256"))
    redis = RedisServer(tmp_path / "redis", port)
    starter = threading.Timer(0.6, redis.start)
    sent: list = []
    hooks = {"request": [lambda request: _count(sent, request)]}
    try:
        async with serving(fleet.app) as (url, _), httpx.AsyncClient(event_hooks=hooks) as http:
            kv = AsyncKvindex(url, client=http, retries=12, backoff=0.1)
            with pytest.raises(KvindexUnavailable) as down:
                await AsyncKvindex(url, client=http, retries=2, backoff=0.01).prefix_match(
                    tokens=list(range(64))
                )
            assert down.value.status == 503 and down.value.attempts == 3 and len(sent) == 3
            assert "store" in down.value.message
            sent.clear()
            starter.start()
            match = await kv.prefix_match(tokens=list(range(64)))
        assert len(sent) > 1  # some 503s, then the answer
        assert [e.prefix_blocks for e in match.engines] == [0]
    finally:
        starter.cancel()
        if starter.ident is not None:
            starter.join()
        redis.stop()
        await store.close()


def test_an_unreachable_kvindex_is_retried_then_raised() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with Kvindex(url, retries=2, backoff=0.05) as kv, pytest.raises(KvindexUnavailable) as down:
        kv.prefix_match(tokens=[1, 2, 3])
    assert down.value.status == 0 and down.value.attempts == 3
    assert "ConnectError" in down.value.message
    assert time.monotonic() - started >= 0.05 + 0.1 - 0.05  # two jittered waits happened


def _row(rank: int, score: float, degraded: bool = False) -> EngineMatch:
    return EngineMatch("e", rank, "m", 16, 0, 0, 0, int(score), 16 * int(score), score, degraded)


def test_best_rank_skips_degraded_ranks_and_answers_none_when_nothing_is_held() -> None:
    match = PrefixMatch(16, 8, [_row(0, 5, degraded=True), _row(1, 3), _row(2, 0)])
    assert best_rank(match) == _row(1, 3)
    assert best_rank(match, allow_degraded=True) == _row(0, 5, degraded=True)
    assert best_rank(PrefixMatch(16, 8, [_row(0, 4, degraded=True), _row(1, 0)])) is None
    assert best_rank(PrefixMatch(16, 8, [_row(0, 0), _row(1, 0)])) is None
    assert best_rank(PrefixMatch(None, None, [])) is None


@pytest.mark.slow
def test_the_client_imports_no_server_dependency() -> None:
    code = (
        "import sys, kvindex.client;"
        "heavy = {'fastapi', 'uvicorn', 'redis', 'zmq', 'api', 'indexer', 'transformers'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_unknown_answer_fields_are_ignored() -> None:
    """kvindex may add fields to its rows; a client built before them still decodes."""
    body = (
        b'{"block_size":16,"num_blocks":1,"routed_to":null,"engines":[{"engine":"e","dp_rank":0,'
        b'"model":"m","block_size":16,"gpu_blocks":1,"cpu_blocks":0,"storage_blocks":0,'
        b'"prefix_blocks":1,"prefix_tokens":16,"score":1.0,"degraded":false,'
        b'"gpu_blocks_full_attention":1,"routed_blocks":0,"approximate":false}]}'
    )
    assert msgspec.json.decode(body, type=PrefixMatch).engines[0].prefix_blocks == 1


async def test_the_ten_line_router_of_the_api_readme_routes(fleet: Fleet) -> None:
    """api/README.md's router, run as written against a real kvindex."""
    readme = (Path(__file__).resolve().parents[1] / "api/README.md").read_text()
    section = readme.split("### A router in ten lines", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    async with serving(fleet.app) as (url, _):
        names: dict = {}
        exec(code.replace("http://kvindex:8000", url), names)
        names["RANKS"] = {("e", 0): "rank-0", ("e", 1): "rank-1"}
        body = {"model": "chat", "messages": MESSAGES}
        assert await names["pick"](body, "least-loaded") == "rank-1"
        other = {"model": "chat", "messages": [{"role": "user", "content": "new"}]}
        assert await names["pick"](other, "least-loaded") == "least-loaded"
        await names["kv"].aclose()


SERVE_YAML = """
engines:
  - {{name: a, model: chat, hash_algo: sha256,
      endpoint: "tcp://127.0.0.1:{a_pub}", replay_endpoint: "tcp://127.0.0.1:{a_replay}"}}
  - {{name: b, model: chat, hash_algo: xxhash,
      endpoint: "tcp://127.0.0.1:{b_pub}", replay_endpoint: "tcp://127.0.0.1:{b_replay}"}}
models:
  chat:
    tokenizer: {tokenizer}
"""


@pytest.mark.slow
def test_kvindex_serve_with_models_routes_a_chat_end_to_end(tmp_path: Path) -> None:
    """The real program: ``kvindex serve`` with a ``models`` section, two engines
    publishing over ZMQ what vLLM would for the chat (one hashing with sha256, one
    with xxhash and a seed kvindex is never told), a router asking by messages."""
    from indexer.engines.vllm.render import ChatMessage as Message

    from .test_serve import Serve, publish, publisher

    ids = Tokenizers({"chat": ModelTokenizer(str(CHATML))}).tokens_now(
        "chat", messages=[Message(**m) for m in MESSAGES]
    )
    full = len(ids) // 16
    secret = catalog.adapter("vllm").hasher("xxhash", "engine b's own seed", 16)
    chains = {
        "a": SHA.published(SHA.digests(Prompt(tuple(ids)))),
        "b": secret.published(secret.digests(Prompt(tuple(ids)))),
    }
    ports = {f"{e}_{kind}": free_port() for e in "ab" for kind in ("pub", "replay")}
    config = tmp_path / "kvindex.yaml"
    config.write_text(SERVE_YAML.format(tokenizer=CHATML, **ports))
    with (
        publisher(ports["a_pub"], ports["a_replay"]) as pub_a,
        publisher(ports["b_pub"], ports["b_replay"]) as pub_b,
    ):
        serve = Serve(tmp_path / "serve.log", "--config", str(config))
        for name, pub in (("a", pub_a), ("b", pub_b)):
            held = chains[name][: full - 1 if name == "a" else full]
            keys = [None] * len(held)  # as vLLM's GPU events state them: no extra keys
            stored = BlockStored(held, None, ids[: len(held) * 16], 16, extra_keys=keys)
            publish(pub, [EventBatch(time.time(), [stored], None)])
        for name in "ab":
            serve.until(lambda n=name: serve.rank(n).get("applied_seq") == 0, f"{name} applied")
        # the first chat loads the model's tokenizer: seconds on a busy machine, past the
        # client's default per-attempt timeout, which a router sets for a warm server
        with Kvindex(f"http://127.0.0.1:{serve.port}", timeout=120) as kv:
            match = kv.prefix_match(model="chat", messages=MESSAGES)
        serve.stop()
    held = {(e.engine, e.prefix_blocks) for e in match.engines}
    assert held == {("a", full - 1), ("b", full)} and match.num_blocks == full
    assert best_rank(match).engine == "b"


def test_the_clients_rows_are_the_servers_fields() -> None:
    """The client decodes its own structs (it must not import the server); every field
    it reads is one the server's answer has, of the same type."""
    from api import schemas

    for ours, theirs in (
        (EngineMatch, schemas.EngineMatch),
        (PrefixMatch, schemas.PrefixMatchResponse),
    ):
        served_fields = {f.name: f.type for f in msgspec.structs.fields(theirs)}
        for field in msgspec.structs.fields(ours):
            assert field.name in served_fields, field.name
            if field.name != "engines":
                assert _same(field.type, served_fields[field.name]), field.name


def _same(ours: object, theirs: object) -> bool:
    """The same type, a struct of the client's standing for the server's one of the same
    fields (``RankRef | None``)."""
    if ours == theirs:
        return True
    a, b = typing.get_args(ours), typing.get_args(theirs)
    if len(a) != len(b) or not a:
        return False
    return all(
        x == y
        or (
            isinstance(x, type)
            and issubclass(x, msgspec.Struct)
            and {f.name: f.type for f in msgspec.structs.fields(x)}
            == {f.name: f.type for f in msgspec.structs.fields(y)}
        )
        for x, y in zip(a, b, strict=True)
    )
