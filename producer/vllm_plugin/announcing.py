"""The plugin's side of the lease: first announcement, renewals, deregistration.

:class:`producer.announce.Announcer` renews once its first announcement went
through; an engine often starts before kvindex does (or while it restarts), so
here the first announcement is retried until kvindex answers, and a refusal
(4xx: the spec is wrong, or the token) is logged once and not retried, since
the same request would be refused again.
"""

from __future__ import annotations

import logging
import threading

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential

from producer.announce import Announcer, AnnounceRefused
from producer.vllm_plugin.settings import PluginSettings
from producer.vllm_plugin.spec import Announcement

log = logging.getLogger("kvindex.vllm_plugin")


class Announcing:
    """One engine's registration while it runs: :meth:`run` on a thread, :meth:`stop`
    at shutdown."""

    def __init__(self, found: Announcement, settings: PluginSettings) -> None:
        self.announcer = Announcer(
            settings.announce_url,
            found.spec,
            token=settings.token(),
            lease_seconds=settings.announce_lease_seconds,
            seeded=found.seeded,
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.outcome: str | None = None  # kvindex's answer to the first announcement

    def run(self) -> None:
        retrying = Retrying(
            retry=retry_if_exception_type(httpx.HTTPError),
            wait=wait_exponential(multiplier=0.5, max=30),
            stop=stop_when_event_set(self._stopping),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt, self._lock:
                    if self._stopping.is_set():
                        return
                    self.outcome = self.announcer.start_sync()
        except AnnounceRefused as e:
            log.error("kvindex refused the announcement of %s: %s", self.announcer.name, e)
        except httpx.HTTPError as e:
            log.warning("kvindex: stopped before kvindex answered: %r", e)

    def stop(self) -> None:
        """Deregister now (kvindex drops the engine's residency at once)."""
        self._stopping.set()
        with self._lock:
            self.announcer.close()
