"""DNS discovery: every address a name resolves to is an engine (a Kubernetes
headless service, or any name an operator keeps up to date).

``dns://NAME[:PORT]?model=...&block_size=...&replay_port=...`` is resolved
every ``interval`` seconds. SRV records at NAME, where there are any, give
the targets and their ports; otherwise NAME's A and AAAA records give the
addresses and PORT the port. Each address becomes the engine
``NAME-ADDRESS:PORT`` (an SRV name without its ``_service._proto.``), so
its name stays the same for as long as the address does. An answer that
cannot be had (timeout, SERVFAIL, no such name, no records) changes nothing:
the last good answer stands, the failure is logged and counted, so a DNS
outage never deregisters the fleet at once.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.resolver

from indexer.announcements import Leases
from indexer.discovery import source
from indexer.discovery.sync import Sync
from indexer.engine_registry import EngineSpec

log = logging.getLogger("kvindex.discovery")

SETTINGS = ("interval", "grace", "replay_port", "nameserver", "timeout")


class LookupFailed(Exception):
    """No usable answer this round (the reason is the message)."""


class DnsSource:
    """One ``dns://`` URL: its resolver, and the engines of its latest answer."""

    def __init__(self, url: str) -> None:
        self.url = parsed = source.parse(url, SETTINGS)
        self.name = parsed.host
        self.port = parsed.port
        # an SRV name's _service._proto labels cannot start an engine name
        self.engine_prefix = ".".join(_drop_underscored(self.name.split(".")))
        self.interval = parsed.number("interval", 5.0, least=0.01)
        self.grace = parsed.number("grace", 30.0)
        self.replay_port = parsed.port_setting("replay_port")
        self.resolver = _resolver(parsed, parsed.number("timeout", 2.0, least=0.01))

    async def engines(self) -> dict[str, EngineSpec]:
        """The engines the name resolves to now, by name (raises LookupFailed)."""
        targets = await self._srv_targets()
        if targets is None:
            if self.port is None:
                raise LookupFailed(f"no SRV records at {self.name} and the URL gives no port")
            targets = [(self.name, self.port)]
        found: dict[str, EngineSpec] = {}
        for host, port in targets:
            for address in await self._addresses(host):
                name = f"{self.engine_prefix}-{address}:{port}"
                try:
                    spec = source.engine(self.url.fields, name, address, port, self.replay_port)
                except ValueError as e:
                    raise ValueError(f"engine {name!r}: {e}") from None
                found[spec.name] = spec
        if not found:
            raise LookupFailed(f"{self.name} resolves to no address")
        return found

    async def run(self, leases: Leases) -> None:
        """Resolve and apply every ``interval`` seconds until cancelled."""
        sync = Sync(leases, self.url.label, self.grace, self.interval)
        failing: str | None = None  # logged when it starts or changes, not every round
        while True:
            try:
                found = await self.engines()
            except (LookupFailed, dns.exception.DNSException, ValueError) as e:
                # ValueError: an answer that makes an engine the registry cannot take
                outcome = "rejected" if type(e) is ValueError else "failed"
                sync.count(outcome)
                if str(e) != failing:
                    failing = str(e)
                    log.warning(
                        f"DNS discovery {outcome}: keeping the last good answer",
                        extra={"source": sync.source, "error": failing or type(e).__name__},
                    )
                await sync.expire()
            else:
                if failing is not None:
                    failing = None
                    log.info("DNS discovery answers again", extra={"source": sync.source})
                sync.count("ok")
                await sync.apply(found)
            await asyncio.sleep(self.interval)

    async def _srv_targets(self) -> list[tuple[str, int]] | None:
        records = await self._query(self.name, "SRV")
        if not records:
            return None
        return [(r.target.to_text(omit_final_dot=True), r.port) for r in records]

    async def _addresses(self, host: str) -> list[str]:
        addresses: list[str] = []
        for kind in ("A", "AAAA"):
            addresses += [r.address for r in await self._query(host, kind)]
        return sorted(set(addresses))

    async def _query(self, host: str, kind: str) -> list:
        """The records of one kind; none for "no such records" (timeouts and
        server failures raise)."""
        try:
            return list(await self.resolver.resolve(host, kind, search=False))
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            return []


def _drop_underscored(labels: list[str]) -> list[str]:
    while len(labels) > 1 and labels[0].startswith("_"):
        labels = labels[1:]
    return labels


def _resolver(url: source.SourceUrl, timeout: float) -> dns.asyncresolver.Resolver:
    """The system's resolver, or ``nameserver=IP[:PORT]``'s alone (a test's
    server, a cluster DNS named explicitly)."""
    nameserver = url.settings.get("nameserver")
    if nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        try:
            where = urlsplit(f"//{nameserver}")
            resolver.nameservers = [where.hostname or ""]
            resolver.port = where.port or 53
        except ValueError:
            raise ValueError(
                f"{url.label}: nameserver must be IP[:PORT] ([IPv6]:PORT), got {nameserver!r}"
            ) from None
    resolver.lifetime = timeout
    return resolver
