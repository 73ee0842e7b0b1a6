"""Engines found rather than typed in: DNS names and Kubernetes pods.

Each ``--discover`` URL (or ``discover:`` entry of the config file) is one
source, run as a task beside the subscriber: ``dns://``
(:mod:`indexer.discovery.dns`) or ``k8s://`` (:mod:`indexer.discovery.watch`).
Sources register and deregister through the leased upsert engines announce
themselves by (:class:`~indexer.announcements.Leases`, :mod:`indexer.discovery.sync`),
so a discovered engine is consumed, shown and removed like any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from indexer.announcements import Leases
from indexer.discovery.dns import DnsSource
from indexer.discovery.watch import PodWatch

Source = DnsSource | PodWatch
SCHEMES = {"dns": DnsSource, "k8s": PodWatch}
log = logging.getLogger("kvindex.discovery")


def open_source(url: str) -> Source:
    """The source a URL names (raises ValueError saying what is wrong with it)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"--discover {url!r}: expected dns://NAME:PORT?... or k8s://NAMESPACE?...")
    return SCHEMES[scheme](url)


class Discovery:
    """The running sources; :meth:`stop` ends them (their engines stay registered
    until their leases lapse: a stopping kvindex stops consuming them anyway)."""

    def __init__(self, sources: Sequence[Source], leases: Leases) -> None:
        self._tasks = [
            asyncio.create_task(s.run(leases), name=f"discover {s.url.label}") for s in sources
        ]
        for task in self._tasks:
            task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        # a crashed source was logged when it ended: nothing to raise here
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _report_crash(task: asyncio.Task) -> None:
    """A source's loop ends only when cancelled: anything else is a bug worth a
    log line (its engines' leases then lapse, as a dead engine's would)."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "discovery stopped", extra={"source": task.get_name(), "error": repr(task.exception())}
        )
