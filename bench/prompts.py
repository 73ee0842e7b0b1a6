"""Item 11: POST /prefix-match by chat ``messages`` (an 8k-token conversation) against
the same query by ``tokens``.

One app, in process (httpx's ASGI transport, a fixed number of concurrent
clients), a memory store holding each engine's share of the conversation's
blocks, the golden ``llama3ish`` tokenizer configured as the model's. Three
queries, interleaved round by round so a slow moment hits all of them:

- ``tokens``: the conversation's token ids (the baseline: kvindex only hashes);
- ``messages``: the same conversation as chat messages, asked again and again
  (rendered every time; its pieces come from the tokenizer's piece cache);
- ``messages, one new turn``: each request the conversation plus a turn never
  seen before (what a router sends as a chat goes on: only the new turn is
  tokenized).

Each gives requests/s (``CONCURRENCY`` clients at once: tokenizing in worker
threads overlaps other requests) and p50/p99 of single requests (one client,
so a latency is one request's, not a queue's). The goal is the messages query
at half the tokens query's rate or better.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from api import ApiSettings
from bench.measure import latency_ms
from bench.report import Figure, Goal, Report
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineRegistry, EngineSpec, RankStatus
from indexer.engines import catalog
from indexer.engines.base import Prompt
from indexer.engines.vllm.render import ChatMessage
from indexer.prompts import ModelTokenizer, Tokenizers
from indexer.stores import MemoryStore, apply_events
from kvindex.wiring import api_app

SECTION = "11"
TOKENIZER = Path(__file__).resolve().parents[2] / "shared/fixtures/vllm-0.33.0/tokenize/llama3ish"
MODEL = "llama3ish"
ENGINES = 8
CONCURRENCY = 8
#: The chat query must answer at least half as many requests per second as by tokens.
GOAL = Goal(0.5)
_TEXT = (
    "the kv cache of every engine rank is indexed by block hash so a router can send each"
    " request where most of its prompt is already computed , 2048 tokens ; résumé 日本語"
)
_WORDS = _TEXT.split()


class AllConnected:
    """A healthy fleet's consumer view: every rank connected."""

    def rank_status(self, engine: str) -> list[RankStatus]:
        return [RankStatus(dp_rank=0, connected=True)]

    def running(self) -> bool:
        return True


def conversation(tokens: int, seed: int = 11) -> list[dict[str, str]]:
    """Alternating turns of plausible text, about ``tokens`` tokens in all."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    while sum(len(m["content"]) for m in messages) < tokens * 4:  # ~4 characters a token
        role = "user" if len(messages) % 2 else "assistant"
        words = rng.randint(40, 200)
        messages.append({"role": role, "content": " ".join(rng.choices(_WORDS, k=words))})
    return messages


async def _fleet(messages: list[dict[str, str]], pool: Tokenizers) -> tuple[Any, list[int]]:
    tokens = await pool.tokens(MODEL, messages=[ChatMessage(**m) for m in messages])
    hasher = catalog.adapter("vllm").hasher("sha256", None, 16)
    chain = hasher.published(hasher.digests(Prompt(tuple(tokens))))
    store, registry = MemoryStore(), EngineRegistry()
    for e in range(ENGINES):
        name = f"engine-{e}"
        await registry.add(EngineSpec(name, "tcp://127.0.0.1:1", MODEL, hash_algo="sha256"))
        held = len(chain) * (e + 1) // ENGINES  # engine e holds the first (e+1)/ENGINES
        event = BlockStored(chain[:held], None, tokens[: held * 16], 16)
        await apply_events(store, RankId(name, 0), 1, EventBatch(1.0, [event], 0))
    settings = ApiSettings(models={MODEL: ModelTokenizer(str(TOKENIZER))})
    app = api_app(store, registry, AllConnected(), settings, tokenizers=pool)
    return app, tokens


async def _drive(
    client: httpx.AsyncClient, bodies: Callable[[], dict], requests: int, concurrency: int
) -> tuple[float, list[float]]:
    """Requests/s and per-request seconds of ``requests`` posts, ``concurrency`` at a time."""
    samples: list[float] = []
    left = itertools.count()

    async def one_client() -> None:
        while next(left) < requests:
            body = bodies()
            started = time.perf_counter()
            answer = await client.post("/prefix-match", json=body)
            samples.append(time.perf_counter() - started)
            if answer.status_code != 200:
                raise RuntimeError(f"prefix-match answered {answer.status_code}: {answer.text}")

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return requests / (time.perf_counter() - started), samples


async def _measure(tokens_target: int, requests: int, rounds: int) -> dict[str, Any]:
    pool = Tokenizers({MODEL: ModelTokenizer(str(TOKENIZER))})
    messages = conversation(tokens_target)
    app, tokens = await _fleet(messages, pool)
    fresh = (f"new turn {i}: " + " ".join(random.choices(_WORDS, k=30)) for i in itertools.count())
    queries: dict[str, Callable[[], dict]] = {
        "tokens": lambda: {"tokens": tokens},
        "messages": lambda: {"model": MODEL, "messages": messages},
        "messages, one new turn": lambda: {
            "model": MODEL,
            "messages": [*messages, {"role": "user", "content": next(fresh)}],
        },
    }
    rates: dict[str, list[float]] = {name: [] for name in queries}
    samples: dict[str, list[float]] = {name: [] for name in queries}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
        for body in queries.values():  # warm: the tokenizer loads, pieces are cached
            await client.post("/prefix-match", json=body())
        for _ in range(rounds):
            for name, body in queries.items():
                rates[name].append((await _drive(client, body, requests, CONCURRENCY))[0])
                samples[name].extend((await _drive(client, body, requests // 2, 1))[1])
    pool.close()
    return {
        "tokens": len(tokens),
        "turns": len(messages),
        "queries": {
            name: {"req_per_s": sorted(rates[name])[len(rates[name]) // 2], **latency_ms(s)}
            for name, s in samples.items()
        },
    }


def run(report: Report, quick: bool) -> dict[str, Any]:
    details = asyncio.run(_measure(8192, 100 if quick else 400, 3 if quick else 5))
    queries = details["queries"]
    base = queries["tokens"]
    note = f"{details['tokens']} tokens, {details['turns']} turns; req/s {CONCURRENCY} at once"
    report.add(
        Figure(SECTION, "prefix-match by tokens", base["req_per_s"], "req/s", note=note),
        Figure(SECTION, "prefix-match by tokens p50", base["p50_ms"], "ms"),
    )
    for name in ("messages", "messages, one new turn"):
        q = queries[name]
        report.add(
            Figure(
                SECTION,
                f"prefix-match by {name}",
                q["req_per_s"],
                "req/s",
                "by tokens",
                base["req_per_s"],
                GOAL if name == "messages" else None,
                note,
            ),
            Figure(
                SECTION,
                f"prefix-match by {name} p50",
                q["p50_ms"],
                "ms",
                "by tokens",
                base["p50_ms"],
            ),
        )
    return details
