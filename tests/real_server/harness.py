"""The tier's helpers: a tap on an engine's events, waits, and the turn comparison.

A *turn* compares kvindex with vLLM on one prompt: once kvindex has applied every
batch the engine published, kvindex is asked how long a GPU prefix of the prompt the
engine holds; then the prompt goes to vLLM, whose ``cached_tokens`` is what its prefix
cache held for it when it was scheduled, i.e. before this request. vLLM's hit is
block-aligned and at most one token short of the prompt, so kvindex's answer in tokens,
capped the same way, must equal it; kvindex's chain (the prompt's full blocks) must be
vLLM's ``prompt_tokens // block_size``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

from tests.real_server.tiny_model import WORDS

BLOCK = 32
MODEL = "tiny"


class EventTap:
    """A SUB socket of its own on an engine's publisher: the newest seq it published
    and the events by type, read apart from kvindex."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(endpoint)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.reset()
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Forget the engine's seq (it restarted) but keep the counts."""
        with self._lock:
            self.seq: int | None = None
            self.first: int | None = None  # the first seq seen since
            self.at = time.monotonic()
            self.expected = (0, 0.0)  # see expect()
            if not hasattr(self, "counts"):
                self.counts: dict[str, int] = {}  # events by type
                self.hashes: dict[str, int] = {}  # block hashes by event type

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                _topic, seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            batch = msgspec.msgpack.decode(payload)
            with self._lock:
                self.seq = int.from_bytes(seq, "big")
                self.first = self.seq if self.first is None else self.first
                self.at = time.monotonic()
                for event in batch[1]:
                    kind = event["type"]
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                    hashes = len(event.get("block_hashes", ()))
                    self.hashes[kind] = self.hashes.get(kind, 0) + hashes

    def last(self) -> tuple[int | None, float]:
        """The newest seq, and when the newest batch or the last expect() came."""
        with self._lock:
            stored, since = self.expected
            if self.hashes.get("BlockStored", 0) < stored:
                return self.seq, time.monotonic()  # what the engine stored is still coming
            return self.seq, max(self.at, since)

    def stored(self) -> int:
        with self._lock:
            return self.hashes.get("BlockStored", 0)

    def expect(self, stored: int) -> None:
        """A request just answered: its stores make the engine's BlockStored hashes at
        least ``stored`` (the batch may come after the answer: vLLM publishes from a
        thread of its own)."""
        with self._lock:
            self.expected = (stored, time.monotonic())

    def close(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


class Kvindex:
    """kvindex's HTTP API, as a router and an operator use it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60)
        self.slowest = (0.0, "")  # the slowest /prefix-match, for the summary

    def engines(self) -> list[dict[str, Any]]:
        return self.http.get("/engines").raise_for_status().json()

    def engine(self, name: str) -> dict[str, Any] | None:
        answer = self.http.get(f"/engines/{name}")
        return None if answer.status_code == 404 else answer.raise_for_status().json()

    def rank(self, name: str) -> dict[str, Any] | None:
        engine = self.engine(name)
        return engine and engine["ranks"][0]

    def prefix(self, engine: str, body: dict[str, Any]) -> dict[str, Any]:
        """The engine's row of POST /prefix-match for ``body`` (``prompt`` or ``messages``),
        with the answer's ``num_blocks``."""
        query = {**body, "model": MODEL, "engines": [engine]}
        started = time.monotonic()
        answer = self.http.post("/prefix-match", json=query).raise_for_status().json()
        took = time.monotonic() - started
        if took > self.slowest[0]:
            self.slowest = (took, f"{len(str(body))} characters of {', '.join(body)}")
        (row,) = answer["engines"]
        return {**row, "num_blocks": answer["num_blocks"]}

    def gpu_blocks(self, body: dict[str, Any]) -> dict[str, int]:
        """Every engine's GPU prefix of ``body``, by name (no engine filter)."""
        query = {**body, "model": MODEL}
        answer = self.http.post("/prefix-match", json=query).raise_for_status().json()
        return {row["engine"]: row["gpu_blocks"] for row in answer["engines"]}

    def register(self, spec: dict[str, Any], token: str) -> None:
        """POST /engines: an engine registered by hand (no lease, no announcement)."""
        headers = {"Authorization": f"Bearer {token}"}
        self.http.post("/engines", json=spec, headers=headers).raise_for_status()

    def remove(self, name: str, token: str) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        self.http.delete(f"/engines/{name}", headers=headers).raise_for_status()

    def metric(self, name: str, engine: str) -> float:
        for line in self.http.get("/metrics").raise_for_status().text.splitlines():
            if line.startswith(name + "{") and f'engine="{engine}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"/metrics has no {name} for {engine}")

    def wait_registered(
        self, name: str, other_than: str | None = None, timeout=60.0, leased: bool = True
    ) -> dict:
        """The engine as announced (a lease instance other than ``other_than``; with
        ``leased`` false, registered by hand), connected."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                engine = self.engine(name)
            except httpx.HTTPError:
                engine = None
            if (
                engine is not None
                and (engine["lease"] is not None) == leased
                and (not leased or engine["lease"]["instance"] != other_than)
                and engine["ranks"][0]["connected"]
            ):
                return engine
            assert time.monotonic() < deadline, f"{name} not announced to kvindex: {engine}"
            time.sleep(0.2)


def settle(kv: Kvindex, name: str, tap: EventTap, quiet: float = 0.15, timeout=20.0) -> None:
    """Wait until the engine published what its last answered request stored, then
    nothing for ``quiet`` seconds, and kvindex has applied its newest batch."""
    deadline = time.monotonic() + timeout
    while True:
        seq, at = tap.last()
        rank = kv.rank(name)
        applied = rank and rank["applied_seq"]
        if time.monotonic() - at >= quiet and (seq is None or applied == seq):
            return
        assert time.monotonic() < deadline, f"kvindex applied {applied} of {name}'s seq {seq}"
        time.sleep(0.03)


class Vllm:
    """A vLLM OpenAI server's completions, chat and Responses, answered in the shape of
    the first two (a Responses answer's usage and text as ``usage`` and ``choices``)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)

    def send(self, body: dict[str, Any], max_tokens: int = 4) -> dict[str, Any]:
        if "input" in body:
            return self._responses(body, max_tokens)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        request = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, **body}
        return self.http.post(path, json=request).raise_for_status().json()

    def _responses(self, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        request = {"model": MODEL, "max_output_tokens": max_tokens, "temperature": 0, **body}
        answer = self.http.post("/v1/responses", json={**request, "store": False})
        answer = answer.raise_for_status().json()
        usage = answer["usage"]
        texts = [
            part.get("text", "")
            for item in answer["output"]
            if item.get("type") == "message"
            for part in item["content"]
        ]
        details = {"cached_tokens": usage["input_tokens_details"]["cached_tokens"]}
        return {
            "usage": {"prompt_tokens": usage["input_tokens"], "prompt_tokens_details": details},
            "choices": [{"text": "".join(texts)}],
        }


@dataclass
class Turn:
    label: str
    prompt_tokens: int
    cached_tokens: int
    kvindex_tokens: int  # kvindex's GPU prefix, capped as vLLM caps its hit
    kvindex_chain: int
    reply: str

    @property
    def exact(self) -> bool:
        return (
            self.kvindex_tokens == self.cached_tokens
            and self.kvindex_chain == self.prompt_tokens // BLOCK
        )

    def __str__(self) -> str:
        return (
            f"{self.label}: {self.prompt_tokens} tokens, vLLM cached {self.cached_tokens},"
            f" kvindex {self.kvindex_tokens} (chain {self.kvindex_chain} blocks,"
            f" vLLM {self.prompt_tokens // BLOCK})"
        )


@dataclass
class Tally:
    """Turns compared and matched, by test; printed at the end of the session."""

    turns: dict[str, list[Turn]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"{kind}: {sum(t.exact for t in turns)}/{len(turns)} turns exact"
            for kind, turns in self.turns.items()
        ]
        every = [t for turns in self.turns.values() for t in turns]
        out.append(f"all: {sum(t.exact for t in every)}/{len(every)} turns compared matched")
        return out + self.notes


TALLY = Tally()


class Turns:
    """Turns against one engine: its vLLM server and its tap, compared under its name in
    kvindex and ``also`` under other names that follow the same publisher."""

    def __init__(self, kv: Kvindex, server: Any, kind: str, also: tuple[str, ...] = ()) -> None:
        self.kv = kv
        self.server = server
        self.names = (server.name, *also)
        self.vllm = Vllm(server.url)
        self.done = TALLY.turns.setdefault(kind, [])

    def turn(self, label: str, body: dict[str, Any], max_tokens: int = 4, **to_vllm: Any) -> Turn:
        """One comparison (the turn under the engine's own name is returned; all are in
        ``done``); ``to_vllm``: request fields for vLLM only (``vllm_xargs``)."""
        for name in self.names:
            settle(self.kv, name, self.server.tap)
        rows = [self.kv.prefix(name, body) for name in self.names]
        assert not any(row["degraded"] for row in rows), rows
        stored = self.server.tap.stored()
        answer = self.vllm.send({**body, **to_vllm}, max_tokens)
        usage = answer["usage"]
        length = usage["prompt_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"] or 0
        # the prompt's full blocks past the hit were stored (the last one perhaps not, when
        # the prompt ends on a block boundary and vLLM recomputes a block it holds)
        self.server.tap.expect(stored + max(0, length // BLOCK - cached // BLOCK - 1))
        choice = answer["choices"][0]
        turns = [
            Turn(
                label=f"{name} {label}",
                prompt_tokens=length,
                cached_tokens=cached,
                kvindex_tokens=min(row["gpu_blocks"] * BLOCK, (length - 1) // BLOCK * BLOCK),
                kvindex_chain=row["num_blocks"],
                reply=choice["message"]["content"] if "message" in choice else choice["text"],
            )
            for name, row in zip(self.names, rows, strict=True)
        ]
        self.done.extend(turns)
        return turns[0]


def assert_exact(turns: list[Turn]) -> None:
    wrong = [str(t) for t in turns if not t.exact]
    hits = sum(t.cached_tokens > 0 for t in turns)
    assert hits > 0, "no turn reused a cached prefix: the comparison saw only misses"
    assert not wrong, f"{len(wrong)}/{len(turns)} turns differ:\n" + "\n".join(wrong)


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def completion_prompts(seed: int, count: int) -> list[str]:
    """Prompts over a few shared documents, some sent again: hits, partial hits and
    misses, and more distinct blocks than the 4 MB cache holds."""
    rng = random.Random(seed)
    documents = [text(rng, rng.randint(60, 160)) for _ in range(5)]
    prompts: list[str] = []
    for _ in range(count):
        if prompts and rng.random() < 0.25:
            prompts.append(rng.choice(prompts[-8:]))
        else:
            prompts.append(rng.choice(documents) + " " + text(rng, rng.randint(5, 120)))
    return prompts


class Conversations:
    """Multi-turn chats sharing one system prompt, each turn adding a user message to
    a conversation, round robin; the assistant's replies are kept in the history."""

    def __init__(self, seed: int, count: int) -> None:
        self.rng = random.Random(seed)
        system = {"role": "system", "content": text(self.rng, 60)}
        self.chats: list[list[dict[str, str]]] = [[system] for _ in range(count)]
        self.next = 0

    def ask(self) -> tuple[int, list[dict[str, str]]]:
        index = self.next
        self.next = (self.next + 1) % len(self.chats)
        chat = self.chats[index]
        chat.append({"role": "user", "content": text(self.rng, self.rng.randint(10, 45))})
        return index, list(chat)

    def answer(self, index: int, reply: str) -> None:
        self.chats[index].append({"role": "assistant", "content": reply})

    def turns(self, turns: Turns, count: int, first: int = 0) -> list[Turn]:
        """``count`` chat turns through ``turns`` (labelled from turn ``first`` on), each
        reply kept in its chat's history."""
        done = []
        for i in range(first, first + count):
            index, messages = self.ask()
            turn = turns.turn(f"chat {index} turn {i}", {"messages": messages}, max_tokens=8)
            self.answer(index, turn.reply)
            done.append(turn)
        return done


class Agents:
    """Agent sessions sharing a system prompt and six tools: each turn asks, then the
    session's history grows by that question, a tool call and its result (sent as a
    chat's ``messages`` or a Responses request's ``input`` items), round robin."""

    def __init__(self, seed: int, count: int) -> None:
        self.rng = random.Random(seed)
        self.system = text(self.rng, 50)
        self.functions = [
            {
                "name": f"tool_{i}_{WORDS[i]}",
                "description": text(self.rng, 5),
                "parameters": {
                    "type": "object",
                    "properties": {w: {"type": "string"} for w in self.rng.sample(WORDS, 3)},
                },
            }
            for i in range(6)
        ]
        #: per session: (question, tool name, JSON arguments, the tool's result) per step
        self.sessions: list[list[tuple[str, str, str, str]]] = [[] for _ in range(count)]

    def chat(self, history: list[tuple[str, str, str, str]], question: str) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for i, (asked, name, arguments, result) in enumerate(history):
            call = {"id": f"c{i}", "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            messages += [
                {"role": "user", "content": asked},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": result},
            ]
        messages.append({"role": "user", "content": question})
        tools = [{"type": "function", "function": f} for f in self.functions]
        return {"messages": messages, "tools": tools}

    def responses(self, history: list[tuple[str, str, str, str]], question: str) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for i, (asked, name, arguments, result) in enumerate(history):
            call = {"type": "function_call", "call_id": f"c{i}", "name": name}
            items += [
                {"role": "user", "content": asked},
                {**call, "arguments": arguments},
                {"type": "function_call_output", "call_id": f"c{i}", "output": result},
            ]
        items.append({"role": "user", "content": question})
        tools = [{"type": "function", **f} for f in self.functions]
        return {"instructions": self.system, "input": items, "tools": tools}

    def turns(self, turns: Turns, count: int, kind: str) -> list[Turn]:
        """``count`` turns through ``turns``, as chats (``kind`` ``chat``) or Responses
        requests."""
        done = []
        render = self.chat if kind == "chat" else self.responses
        for i in range(count):
            index = i % len(self.sessions)
            session = self.sessions[index]
            question = text(self.rng, self.rng.randint(6, 20))
            body = render(session, question)
            done.append(turns.turn(f"agent {index} turn {i}", body, max_tokens=4))
            name = self.rng.choice(self.functions)["name"]
            arguments = json.dumps({"q": text(self.rng, 4)})
            session.append((question, name, arguments, text(self.rng, 6)))
        return done
