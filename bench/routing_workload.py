"""Item 16's workload and its streaming client: the same requests, in the same order, for
every routing policy.

Chats over six Zipf-popular system prompts (a few hundred tokens each), three or four turns
each, whose history holds canned assistant replies, so a request never depends on what the
random-weight model said before: every policy is sent byte-identical requests. A few chats
are open at once and take turns, as users do. In the middle of the run a burst of agents
sharing one new long prefix (about 1,000 tokens, a short distinct suffix each) is released
at once, beside the chats: the case where a pick by prefix alone piles onto one engine.

The client measures what a user sees: the time from sending a request to its first streamed
content chunk (TTFT), whatever sits in between (a router, or the proxy asking kvindex).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from tests.real_server.tiny_model import WORDS

MODEL = "tiny"
SYSTEM_PROMPTS = 6
SYSTEM_WORDS = 130  # about 400 tokens of the tiny tokenizer (3 a word)
BURST_WORDS = 330  # about 1,000 tokens
OPEN_CHATS = 6
MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Request:
    key: str  # "chat7/2" (chat 7's third turn) or "burst/3"
    messages: tuple[dict, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    chats: tuple[Request, ...]
    burst: tuple[Request, ...]
    burst_at: int  # the burst is released when the chat request of this index is taken

    def __len__(self) -> int:
        return len(self.chats) + len(self.burst)


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it (``ttft`` None: no content chunk came)."""

    key: str
    ttft: float | None
    total: float
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def _zipf(rng: random.Random, n: int, s: float = 1.0) -> int:
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)])[0]


def _chat_turns(rng: random.Random, system: str, index: int) -> list[Request]:
    """One chat's requests: turn k sends the system prompt, the k earlier turns with their
    canned replies, and its own question."""
    history = [{"role": "system", "content": system}]
    turns = []
    for turn in range(rng.randint(3, 4)):
        history.append({"role": "user", "content": _text(rng, rng.randint(15, 30))})
        turns.append(Request(f"chat{index}/{turn}", tuple(history)))
        history.append({"role": "assistant", "content": _text(rng, rng.randint(8, 15))})
    return turns


def _interleaved(rng: random.Random, systems: list[str], count: int) -> list[Request]:
    """``count`` chat requests, ``OPEN_CHATS`` chats open at once taking turns at random; a
    finished chat's place goes to a new one (its system prompt drawn by popularity)."""
    started = 0

    def new_chat() -> list[Request]:
        nonlocal started
        started += 1
        return _chat_turns(rng, systems[_zipf(rng, len(systems))], started - 1)

    open_chats = [new_chat() for _ in range(OPEN_CHATS)]
    out: list[Request] = []
    while len(out) < count:
        slot = rng.randrange(len(open_chats))
        out.append(open_chats[slot].pop(0))
        if not open_chats[slot]:
            open_chats[slot] = new_chat()
    return out


def build(chats: int, burst: int, seed: int = 16) -> Workload:
    """The workload: ``chats`` chat requests, and ``burst`` agents released at the middle."""
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. " + _text(rng, SYSTEM_WORDS) for i in range(SYSTEM_PROMPTS)]
    shared = "Agent instructions. " + _text(rng, BURST_WORDS)
    agents = tuple(
        Request(
            f"burst/{i}",
            ({"role": "system", "content": shared}, {"role": "user", "content": _text(rng, 8)}),
        )
        for i in range(burst)
    )
    return Workload(tuple(_interleaved(rng, systems, chats)), agents, chats // 2)


def body(request: Request) -> dict:
    return {
        "model": MODEL,
        "messages": list(request.messages),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(client: httpx.AsyncClient, url: str, request: Request) -> Sample:
    """One streamed chat completion; never raises (a failure is a sample with its error)."""
    started = time.perf_counter()
    first, usage = None, {}
    try:
        async with client.stream("POST", url, json=body(request)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return Sample(request.key, None, time.perf_counter() - started, text)
            async for line in response.aiter_lines():
                chunk = _chunk(line)
                if chunk is None:
                    continue
                if first is None and any(
                    c.get("delta", {}).get("content") for c in chunk.get("choices", ())
                ):
                    first = time.perf_counter() - started
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return Sample(request.key, first, time.perf_counter() - started, repr(e))
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        request.key,
        first,
        time.perf_counter() - started,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
    )


def _chunk(line: str) -> dict | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


async def drive(url: str, workload: Workload, concurrency: int) -> list[Sample]:
    """The chats through ``concurrency`` workers pulling the next request in order; whoever
    takes request ``burst_at`` releases the whole burst at once beside them."""
    limits = httpx.Limits(max_connections=concurrency + len(workload.burst) + 4)
    samples: list[Sample] = []
    burst_done: list[asyncio.Task] = []
    queue = iter(enumerate(workload.chats))
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            for index, request in queue:
                if index == workload.burst_at:
                    burst = [send(client, url, r) for r in workload.burst]
                    burst_done.append(asyncio.ensure_future(asyncio.gather(*burst)))
                samples.append(await send(client, url, request))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        for task in burst_done:
            samples.extend(await task)
    return samples


def run(url: str, workload: Workload, concurrency: int) -> list[Sample]:
    return asyncio.run(drive(url, workload, concurrency))
