"""A router's client for kvindex's ``/prefix-match``: async and sync, typed answers.

A router asks, per request, which engine rank holds most of the prompt's KV
cache, then sends the request there::

    async with AsyncKvindex("http://kvindex:8000", token=TOKEN) as kv:
        match = await kv.prefix_match(model="llama-3-8b", messages=body["messages"],
                                      route="best")
        best = best_rank(match)            # kvindex's pick: prefix weighed against load

The prompt goes as the router has it (``tokens``, ``block_hashes``, a
completions ``prompt``, chat ``messages`` or a Responses ``input``, with their
``tools`` and flags); kvindex
tokenizes and hashes it as the engines do. One client keeps its connections
open across calls (make one per process, not per request). A 503 (the store
is unreachable, or kvindex is at its connection limit) and a failure to
connect are retried with jittered exponential backoff; anything else is
raised at once as :class:`KvindexError`, with kvindex's message.

The answers are kvindex's own types (:mod:`answers`, one declaration the server
encodes). Imports httpx, msgspec, tenacity and those types only, so a router need
not install the server's dependencies.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import httpx
import msgspec
import tenacity

from answers import EngineMatch, PrefixMatchResponse, RankRef

__all__ = [
    "AsyncKvindex",
    "EngineMatch",
    "Kvindex",
    "KvindexError",
    "KvindexUnavailable",
    "PrefixMatch",
    "RankRef",
    "best_rank",
]


#: kvindex's answer to ``/prefix-match``, under the name routers know it by.
PrefixMatch = PrefixMatchResponse


class KvindexError(Exception):
    """kvindex refused the query (4xx) or failed; ``message`` is its own sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"kvindex answered {status}: {message}")
        self.status = status
        self.message = message


class KvindexUnavailable(KvindexError):
    """Still unavailable (503, or unreachable: status 0) after every retry."""

    attempts: int = 1


def best_rank(match: PrefixMatch, *, allow_degraded: bool = False) -> EngineMatch | None:
    """The rank to send the request to. For an answer to ``route="best"``, kvindex's
    pick (``routed_to``: the prefix weighed against each rank's load, and recorded
    as routed there). Otherwise the best score above zero, skipping ranks whose
    view is degraded unless ``allow_degraded``; None when no rank holds any of the
    prompt (route by load instead). Ties go to kvindex's order."""
    if match.routed_to is not None:
        picked = match.routed_to
        return next(
            (e for e in match.engines if (e.engine, e.dp_rank) == (picked.engine, picked.dp_rank)),
            None,
        )
    for entry in match.engines:  # kvindex sorts best score first
        if entry.score <= 0:
            return None
        if allow_degraded or not entry.degraded:
            return entry
    return None


H = TypeVar("H", httpx.Client, httpx.AsyncClient)
R = TypeVar("R", PrefixMatch, Awaitable[PrefixMatch])
_decode_match = msgspec.json.Decoder(PrefixMatch).decode
_decode_error = msgspec.json.Decoder(dict[str, Any]).decode


def _body(fields: dict[str, Any]) -> bytes:
    """The JSON body of a query: the fields given (None: not sent)."""
    return msgspec.json.encode({k: v for k, v in fields.items() if v is not None})


def _answer(response: httpx.Response) -> PrefixMatch:
    if response.status_code == 200:
        return _decode_match(response.content)
    try:
        message = str(_decode_error(response.content).get("error", response.text))
    except msgspec.DecodeError:
        message = response.text
    kind = KvindexUnavailable if response.status_code == 503 else KvindexError
    raise kind(response.status_code, message)


@contextlib.contextmanager
def _unreachable() -> Iterator[None]:
    """A connection that failed is unavailability (retried), like a 503."""
    try:
        yield
    except httpx.TransportError as e:
        raise KvindexUnavailable(0, f"{type(e).__name__}: {e}") from e


def _policy(retries: int, backoff: float) -> dict[str, Any]:
    """tenacity's arguments: retry unavailability, then re-raise the last one."""

    def give_up(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception()
        error.attempts = state.attempt_number
        raise error

    return {
        "retry": tenacity.retry_if_exception_type(KvindexUnavailable),
        "stop": tenacity.stop_after_attempt(retries + 1),
        "wait": tenacity.wait_exponential(multiplier=backoff, max=backoff * 16)
        + tenacity.wait_random(0, backoff),
        "retry_error_callback": give_up,
    }


class _Client(abc.ABC, Generic[H, R]):
    """What both clients share: the settings, each query's request and the parse of
    its answer; a client adds only how a request is sent (:meth:`_send`), so the
    blocking client and the asyncio one cannot drift apart.
    """

    _transport: Callable[..., H]  # httpx.Client or httpx.AsyncClient

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        retries: int = 3,
        backoff: float = 0.05,
        token: str | None = None,
        client: H | None = None,
    ) -> None:
        self._headers = {"Content-Type": "application/json"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._url = url.rstrip("/") + "/prefix-match"
        self._policy = _policy(retries, backoff)
        self._own = client is None
        self._client = client or self._transport(timeout=timeout)

    def prefix_match(
        self,
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[int | str] | None = None,
        prompt: str | Sequence[int] | None = None,
        messages: Iterable[dict[str, Any]] | None = None,
        input: str | Iterable[dict[str, Any]] | None = None,
        tools: Iterable[dict[str, Any]] | None = None,
        model: str | None = None,
        engines: Sequence[str] | None = None,
        **more: Any,
    ) -> R:
        """``POST /prefix-match`` (awaited on :class:`AsyncKvindex`). A chat's
        ``messages`` or a Responses request's ``input`` go with that request's
        ``tools`` as it has them; ``more``: any other field (``tool_choice``,
        ``instructions``, ``add_generation_prompt``, ``lora_name`` ...), as the API
        documents them."""
        listed = {"tokens": tokens, "block_hashes": block_hashes, "engines": engines}
        fields = {k: list(v) if v is not None else None for k, v in listed.items()}
        texts = {"messages": messages, "tools": tools}
        fields |= {k: list(v) if v is not None else None for k, v in texts.items()}
        given = input if input is None or isinstance(input, str) else list(input)
        return self._send(
            _body({**fields, "prompt": prompt, "input": given, "model": model, **more})
        )

    @abc.abstractmethod
    def _send(self, body: bytes) -> R:
        """Post ``body`` under the retry policy; the parsed answer."""


class AsyncKvindex(_Client[httpx.AsyncClient, Awaitable[PrefixMatch]]):
    """The asyncio client (one per process: it pools connections).

    ``timeout``: seconds for each attempt (connect, read, write); ``retries``:
    further attempts after a 503 or a failed connection, waiting about
    ``backoff`` seconds, then twice that..., jittered; ``token``: the bearer
    token, if kvindex requires one. ``client``: an httpx client to use instead
    of a new one (then closing it is the caller's business).
    """

    _transport = httpx.AsyncClient

    async def _send(self, body: bytes) -> PrefixMatch:
        async for attempt in tenacity.AsyncRetrying(**self._policy):
            with attempt, _unreachable():
                return _answer(
                    await self._client.post(self._url, content=body, headers=self._headers)
                )
        raise AssertionError("tenacity either returns or raises")  # pragma: no cover

    async def aclose(self) -> None:
        if self._own:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncKvindex:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Kvindex(_Client[httpx.Client, PrefixMatch]):
    """The blocking client, for routers without an event loop; as :class:`AsyncKvindex`."""

    _transport = httpx.Client

    def _send(self, body: bytes) -> PrefixMatch:
        for attempt in tenacity.Retrying(**self._policy):
            with attempt, _unreachable():
                return _answer(self._client.post(self._url, content=body, headers=self._headers))
        raise AssertionError("tenacity either returns or raises")  # pragma: no cover

    def close(self) -> None:
        if self._own:
            self._client.close()

    def __enter__(self) -> Kvindex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
