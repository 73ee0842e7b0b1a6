"""``k8s://NAMESPACE?selector=...``: list and watch pods over the API server.

Thin on purpose (the decisions are in :mod:`indexer.discovery.kubernetes`
and :mod:`indexer.discovery.sync`): list the pods matching ``selector``,
then watch from the list's ``resourceVersion``, applying the whole set of
pods after every event. A watch that ends is resumed from the last version
seen; a ``410 Gone`` (the version is older than the server keeps) means
events were missed, so the pods are listed again. In a pod, the API server's
address, token and CA come from the service account Kubernetes mounts; the
token file is read for every request because Kubernetes rotates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from indexer.announcements import Leases
from indexer.discovery import source
from indexer.discovery.kubernetes import DEFAULT_PORT, Defaults, pod_engines
from indexer.discovery.sync import Sync

log = logging.getLogger("kvindex.discovery")

SETTINGS = ("selector", "port", "replay_port", "grace", "api", "token_file", "ca_file", "retry")
ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Expired(Exception):
    """The watch's resourceVersion is gone: list again."""


class PodWatch:
    """One ``k8s://`` URL: the pods it selects, kept registered as engines."""

    #: Seconds between renewals of the engines' leases (and checks of the grace):
    #: a watch may be quiet for minutes.
    RENEW = 1.0

    def __init__(self, url: str, environ: Mapping[str, str] = os.environ) -> None:
        self.url = parsed = source.parse(url, SETTINGS)
        self.namespace = parsed.host
        self.selector = parsed.settings.get("selector", "")
        self.grace = parsed.number("grace", 10.0)
        self.retry = parsed.number("retry", 2.0, least=0.01)
        self.defaults = Defaults(
            parsed.fields,
            parsed.port_setting("port") or DEFAULT_PORT,
            parsed.port_setting("replay_port"),
        )
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        in_cluster = f"https://{source.host_port(host, int(port or 443))}" if host else None
        api = parsed.settings.get("api") or in_cluster
        if api is None:
            raise ValueError(
                f"{parsed.label}: not in a pod (no KUBERNETES_SERVICE_HOST): give api="
            )
        self.api = api
        self.token_file = parsed.settings.get("token_file", str(ACCOUNT / "token"))
        self.ca_file = parsed.settings.get("ca_file", str(ACCOUNT / "ca.crt"))
        self.pods: dict[str, dict[str, Any]] = {}
        self._rejected: dict[str, str] = {}

    async def run(self, leases: Leases) -> None:
        """List and watch until cancelled; failures are logged, counted and retried."""
        sync = Sync(leases, self.url.label, self.grace, self.RENEW)
        verify: Any = self.ca_file if self.api.startswith("https:") else False
        timeout = httpx.Timeout(10.0, read=None)  # a watch is quiet between events
        async with httpx.AsyncClient(base_url=self.api, verify=verify, timeout=timeout) as client:
            expiry = asyncio.create_task(self._expire(sync))
            try:
                await self._follow(client, sync)
            finally:
                expiry.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await expiry

    async def _follow(self, client: httpx.AsyncClient, sync: Sync) -> None:
        version = None
        while True:
            try:
                if version is None:
                    version = await self._list(client, sync)
                version = await self._watch(client, sync, version)
            except Expired:
                sync.count("expired")
                version = None
            except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                sync.count("failed")
                log.warning(
                    "Kubernetes discovery: list/watch failed, retrying",
                    extra={"source": sync.source, "error": repr(e)[:200]},
                )
                version = None
                await asyncio.sleep(self.retry)

    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def _headers(self) -> dict[str, str]:
        token_file = Path(self.token_file)
        if not token_file.exists():
            return {}
        return {"Authorization": f"Bearer {token_file.read_text().strip()}"}

    async def _list(self, client: httpx.AsyncClient, sync: Sync) -> str:
        answer = await client.get(
            self._path(), params={"labelSelector": self.selector}, headers=self._headers()
        )
        answer.raise_for_status()
        body = answer.json()
        self.pods = {p["metadata"]["name"]: p for p in body.get("items") or []}
        sync.count("listed")
        await self._apply(sync)
        return body["metadata"]["resourceVersion"]

    async def _watch(self, client: httpx.AsyncClient, sync: Sync, version: str) -> str:
        """Apply events until the server ends the watch; the last version seen."""
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        headers = self._headers()
        async with client.stream("GET", self._path(), params=params, headers=headers) as answer:
            if answer.status_code == 410:
                raise Expired
            answer.raise_for_status()
            async for line in answer.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, pod = event["type"], event["object"]
                if kind == "ERROR":
                    if pod.get("code") == 410:
                        raise Expired
                    raise ValueError(f"watch error: {pod.get('message') or pod}")
                version = pod["metadata"]["resourceVersion"]
                if kind == "BOOKMARK":
                    continue
                name = pod["metadata"]["name"]
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:
                    self.pods[name] = pod
                sync.count("event")
                await self._apply(sync)
        return version

    async def _apply(self, sync: Sync) -> None:
        engines, rejected = pod_engines(self.pods.values(), self.defaults)
        for name, reason in rejected.items():
            if self._rejected.get(name) != reason:
                sync.count("rejected")
                log.warning(
                    "pod refused as an engine", extra={"source": sync.source, "error": reason}
                )
        self._rejected = rejected
        await sync.apply(engines)

    async def _expire(self, sync: Sync) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.RENEW, self.grace / 4)))
            await sync.expire()
