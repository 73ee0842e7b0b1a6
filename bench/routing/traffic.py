"""Item 16's workloads and their open-loop streaming client: the same requests at the same
times for every routing policy.

A :class:`Workload` is requests with arrival times for a mean rate of one request a
second; :func:`at_rate` rescales them to the rate of a rung of the load ladder. Every
request's text is fixed, and so is its output length (``ignore_eos``), so every policy is
sent byte-identical requests asking for the same work. Two shapes are here; Mooncake's
trace is :mod:`bench.routing.mooncake`:

- ``chats``: chats over six Zipf-popular system prompts (a few hundred tokens each), three
  or four turns each, whose history holds canned assistant replies; a few chats open at
  once take turns. In the middle a burst of agents sharing one new long prefix (about 1,000
  tokens, a short distinct suffix each) arrives at once: the case where a pick by prefix
  alone piles onto one engine.
- ``shared-prefix``: llm-d's shape (groups of users sharing a long system prefix, each
  user with questions of their own; their guide runs 150 groups x 5 users, 6,000-token
  prefixes and 1,200-token questions on 8 pods), scaled to the fleet: a tenth of the
  lengths, four groups per engine, so the prefixes fill the fleet's caches about twice.

The client measures what a user sees: from sending a request to its first streamed content
chunk (TTFT) and to its end, whatever sits in between (a router, or the proxy asking
kvindex).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field, replace

import httpx

from tests.real_server.tiny_model import WORDS

MODEL = "tiny"
SYSTEM_PROMPTS = 6
SYSTEM_WORDS = 130  # about 400 tokens of the tiny tokenizer (3 a word)
BURST_WORDS = 330  # about 1,000 tokens
OPEN_CHATS = 6
CHAT_TOKENS = 16
PREFIX_WORDS = 200  # llm-d's 6,000-token prefix, a tenth
QUESTION_WORDS = 40  # and its 1,200-token question
GROUP_USERS = 5
GROUPS_PER_ENGINE = 4
PREFIX_TOKENS = 24


@dataclass(frozen=True, slots=True)
class Request:
    key: str  # "chat7/2" (chat 7's third turn), "burst/3", "g4/u1/q0", "s12/3"
    at: float  # seconds from the start of the run
    messages: tuple[dict, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[Request, ...]  # by arrival, a mean of one a second
    about: dict = field(default_factory=dict)  # what the report says of it

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it (``ttft`` None: no content chunk came)."""

    key: str
    ttft: float | None
    total: float
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def at_rate(workload: Workload, rate: float) -> Workload:
    """``workload`` with its arrival times scaled to ``rate`` requests a second."""
    moved = tuple(replace(r, at=r.at / rate) for r in workload.requests)
    return replace(workload, requests=moved)


def arrivals(rng: random.Random, count: int) -> list[float]:
    """``count`` Poisson arrival times at one a second."""
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(1.0)
        times.append(now)
    return times


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def _zipf(rng: random.Random, n: int, s: float = 1.0) -> int:
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)])[0]


def _chat_turns(rng: random.Random, system: str, index: int) -> list[tuple[str, tuple]]:
    """One chat's requests: turn k sends the system prompt, the k earlier turns with their
    canned replies, and its own question."""
    history = [{"role": "system", "content": system}]
    turns = []
    for turn in range(rng.randint(3, 4)):
        history.append({"role": "user", "content": text(rng, rng.randint(15, 30))})
        turns.append((f"chat{index}/{turn}", tuple(history)))
        history.append({"role": "assistant", "content": text(rng, rng.randint(8, 15))})
    return turns


def chats(count: int, burst: int, seed: int = 16) -> Workload:
    """``count`` chat requests, ``OPEN_CHATS`` chats open at once taking turns at random (a
    finished chat's place goes to a new one, its system prompt drawn by popularity), and
    ``burst`` agents arriving together at the middle."""
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. " + text(rng, SYSTEM_WORDS) for i in range(SYSTEM_PROMPTS)]
    shared = "Agent instructions. " + text(rng, BURST_WORDS)
    started = 0

    def new_chat() -> list[tuple[str, tuple]]:
        nonlocal started
        started += 1
        return _chat_turns(rng, systems[_zipf(rng, len(systems))], started - 1)

    open_chats = [new_chat() for _ in range(OPEN_CHATS)]
    times = arrivals(rng, count)
    out: list[Request] = []
    while len(out) < count:
        slot = rng.randrange(len(open_chats))
        key, messages = open_chats[slot].pop(0)
        out.append(Request(key, times[len(out)], messages, CHAT_TOKENS))
        if not open_chats[slot]:
            open_chats[slot] = new_chat()
    middle = times[count // 2]
    agents = [
        Request(f"burst/{i}", middle, ({"role": "system", "content": shared},
                                       {"role": "user", "content": text(rng, 8)}), CHAT_TOKENS)
        for i in range(burst)
    ]  # fmt: skip
    about = {"chat_requests": count, "burst_agents": burst}
    return Workload("chats", tuple(sorted(out + agents, key=lambda r: r.at)), about)


def shared_prefix(engines: int, questions: int = 2, seed: int = 36) -> Workload:
    """llm-d's shared-prefix shape scaled to ``engines``: :data:`GROUPS_PER_ENGINE` groups an
    engine, :data:`GROUP_USERS` users a group, ``questions`` questions a user, in a random
    order at Poisson times."""
    rng = random.Random(seed)
    groups = GROUPS_PER_ENGINE * engines
    prefixes = [f"Group {g} system prompt. " + text(rng, PREFIX_WORDS) for g in range(groups)]
    keys = [(g, u, q) for g in range(groups) for u in range(GROUP_USERS) for q in range(questions)]
    rng.shuffle(keys)
    times = arrivals(rng, len(keys))
    requests = tuple(
        Request(f"g{g}/u{u}/q{q}", at, ({"role": "system", "content": prefixes[g]},
                                       {"role": "user", "content": text(rng, QUESTION_WORDS)}),
                PREFIX_TOKENS)
        for (g, u, q), at in zip(keys, times, strict=True)
    )  # fmt: skip
    about = {"groups": groups, "users_per_group": GROUP_USERS, "questions_per_user": questions}
    return Workload("shared-prefix", requests, about)


def body(request: Request) -> dict:
    return {
        "model": MODEL,
        "messages": list(request.messages),
        "max_tokens": request.max_tokens,
        "ignore_eos": True,  # the same output length whatever the random model says
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
        output_tokens=usage.get("completion_tokens", 0),
    )


def _chunk(line: str) -> dict | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


async def drive(url: str, workload: Workload) -> list[Sample]:
    """Every request sent at its time (open loop), whatever the earlier ones are doing."""
    limits = httpx.Limits(max_connections=len(workload) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def timed(request: Request) -> Sample:
            await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
            return await send(client, url, request)

        return list(await asyncio.gather(*(timed(r) for r in workload.requests)))


def run(url: str, workload: Workload) -> list[Sample]:
    return asyncio.run(drive(url, workload))
