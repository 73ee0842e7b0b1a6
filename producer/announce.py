"""An engine announcing itself to kvindex, and keeping its registration alive.

kvindex keeps a self-registered engine only as long as it hears from it: the
engine announces at start, renews within every lease (a third of it, so two
renewals may fail before the lease passes), and deregisters when it shuts down
cleanly. A renewal is the same request as the first announcement, so when
kvindex restarted or dropped the engine meanwhile, the next renewal registers
it again without any special case here.

Each :class:`Announcer` draws a new ``instance`` id: that is how kvindex tells
a restarted engine (whose cache is empty again) from a renewal. A hash seed is
sent only with a token (kvindex refuses it over an unauthenticated request);
without one the announcer says ``seeded: true`` and keeps the seed.

Usable from async code (``async with``, or :meth:`start`/:meth:`aclose`) and
from plain code (``with``, or :meth:`start_sync`/:meth:`close`: the renewals
then run on a thread of their own). Needs httpx and tenacity, unlike the rest of
the producer package, which imports neither.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import httpx
import msgspec
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

log = logging.getLogger("kvindex.announce")


class AnnounceRefused(Exception):
    """kvindex answered the announcement with a 4xx: retrying cannot help."""


def _retryable(error: BaseException) -> bool:
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, httpx.TransportError)


class Announcer:
    """Announces ``spec`` (a ``POST /engines`` body, or an EngineSpec) to kvindex at
    ``url`` and renews it until closed.

    ``seeded``: a hash seed is in force (default: the spec carries one).
    ``attempts``: tries per announcement before waiting for the next renewal.
    The lease kvindex grants (it clamps what is asked) sets the renewal period.
    """

    def __init__(
        self,
        url: str,
        spec: Mapping[str, Any] | msgspec.Struct,
        token: str | None = None,
        lease_seconds: float = 30.0,
        *,
        seeded: bool | None = None,
        timeout: float = 5.0,
        attempts: int = 3,
    ) -> None:
        body = dict(msgspec.to_builtins(spec))
        seeded = body.get("hash_seed") is not None if seeded is None else seeded
        if token is None:
            body["hash_seed"] = None  # the seed travels only with a token
        self.name: str = body["name"]
        self.instance = uuid.uuid4().hex
        self.lease_seconds = lease_seconds
        self.outcome: str | None = None
        self._url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._body = {
            "spec": body,
            "instance": self.instance,
            "lease_seconds": lease_seconds,
            "seeded": seeded,
        }
        self._timeout = timeout
        self._attempts = attempts
        self._client: httpx.AsyncClient | None = None
        self._renewing: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None

    # -- async use --------------------------------------------------------------

    async def start(self) -> str:
        """Announce (raises :class:`AnnounceRefused`, or the last connection error),
        then keep renewing in the background. Returns the outcome."""
        self._client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout)
        try:
            outcome = await self._announce()
        except BaseException:
            await self._client.aclose()
            raise
        self._renewing = asyncio.create_task(self._renew_forever())
        return outcome

    async def aclose(self) -> None:
        """Stop renewing and deregister (a failure to is logged: the lease ends it)."""
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        if self._client is None:
            return
        try:
            answer = await self._client.delete(
                f"{self._url}/engines/announce/{self.name}", params={"instance": self.instance}
            )
            answer.raise_for_status()
            log.info("deregistered", extra={"engine": self.name, "instance": self.instance})
        except httpx.HTTPError as e:
            log.warning(
                "could not deregister: kvindex drops the engine when its lease passes",
                extra={"engine": self.name, "error": repr(e)},
            )
        finally:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Announcer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # -- sync use: the same coroutines on a loop of their own ------------------

    def start_sync(self) -> str:
        """:meth:`start` from code without an event loop (renewals on a thread)."""
        ready = threading.Event()
        result: list[Any] = []

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = self._loop.create_future()
            try:
                result.append(await self.start())
            except BaseException as e:
                result.append(e)
                ready.set()
                return
            ready.set()
            await self._stop  # resolved by close()
            await self.aclose()

        self._thread = threading.Thread(
            target=asyncio.run, args=(main(),), name=f"announce-{self.name}", daemon=True
        )
        self._thread.start()
        ready.wait()
        if isinstance(result[0], BaseException):
            self._thread.join()
            raise result[0]
        return result[0]

    def close(self) -> None:
        """:meth:`aclose` for :meth:`start_sync`: deregister, stop the thread."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> Announcer:
        self.start_sync()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the requests -----------------------------------------------------------

    async def _announce(self) -> str:
        retrying = AsyncRetrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self._attempts),
            wait=wait_random_exponential(multiplier=0.2, max=max(0.2, self.lease_seconds / 6)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                answer = await self._client.post(f"{self._url}/engines/announce", json=self._body)
                if 400 <= answer.status_code < 500:
                    raise AnnounceRefused(f"{answer.status_code}: {answer.text}")
                answer.raise_for_status()
        granted = answer.json()
        self.lease_seconds = granted["lease_seconds"]
        self.outcome = granted["outcome"]
        if self.outcome != "renewed":
            log.info(
                f"announced: {self.outcome}",
                extra={"engine": self.name, "instance": self.instance, "lease": self.lease_seconds},
            )
        return self.outcome

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self._announce()
            except (AnnounceRefused, httpx.HTTPError) as e:
                log.warning(
                    "renewal failed; trying again next period",
                    extra={"engine": self.name, "error": repr(e)[:300]},
                )
