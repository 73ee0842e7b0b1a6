"""``--discover`` URLs: which source, its settings, and the engine fields it applies.

``dns://NAME[:PORT]?FIELD=VALUE&...`` and ``k8s://NAMESPACE?selector=...&...``
share one vocabulary: settings of the source (``interval``, ``grace``,
``replay_port``, ...) and :class:`~indexer.engine_registry.EngineSpec` fields
(``model``, ``block_size``, ``hash_algo``, ``hash_seed``, ``dp_ranks``,
``blocks_per_chunk``, ``topic``, ``adapter``) that every engine found gets.
The name and endpoints come from what is discovered, so they cannot be given.
"""

from __future__ import annotations

import ipaddress
import typing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import msgspec

from indexer.engine_registry import EngineSpec

#: EngineSpec fields a source derives itself, or that a discovered engine cannot have.
_DERIVED = frozenset({"name", "endpoint", "replay_endpoint", "bind", "events", "gpu_blocks"})
#: Fields that are lists or structs, which a URL query has no way to spell.
_STRUCTURED = frozenset({"kv_groups"})
SPEC_FIELDS = frozenset(f.name for f in msgspec.structs.fields(EngineSpec)) - _DERIVED - _STRUCTURED


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets."""
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:
        bracket = False
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"


def endpoint(host: str, port: int) -> str:
    """``tcp://HOST:PORT``, as ZMQ takes it."""
    return f"tcp://{host_port(host, port)}"


def engine(
    fields: dict[str, Any], name: str, host: str, port: int, replay_port: int | None
) -> EngineSpec:
    """One discovered engine: ``fields`` (text as in a URL, or typed) at ``host``.
    Raises ValueError saying which field is wrong (the caller says of what)."""
    where = {"name": name, "endpoint": endpoint(host, port)}
    if replay_port is not None:
        where["replay_endpoint"] = endpoint(host, replay_port)
    try:
        return msgspec.convert({**fields, **where}, EngineSpec, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None


@dataclass(frozen=True)
class SourceUrl:
    """A parsed ``--discover`` URL: scheme, host part, port, settings and engine fields."""

    url: str
    scheme: str
    host: str
    port: int | None
    settings: dict[str, str] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The URL without its query: what log lines and metrics name it by."""
        port = f":{self.port}" if self.port is not None else ""
        return f"{self.scheme}://{self.host}{port}"

    def number(self, key: str, default: float, *, least: float = 0.0) -> float:
        value = self.settings.get(key)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            number = least - 1
        if not number >= least:
            raise ValueError(f"{self.label}: {key} must be a number >= {least:g}, got {value!r}")
        return number

    def port_setting(self, key: str) -> int | None:
        value = self.settings.get(key)
        if value is None:
            return None
        if not value.isdigit() or not 1 <= int(value) <= 65535:
            raise ValueError(f"{self.label}: {key} must be a port 1-65535, got {value!r}")
        return int(value)


def parse(url: str, settings: typing.Collection[str]) -> SourceUrl:
    """Split ``url``; ``settings`` are the query keys the source takes besides
    engine fields. Raises ValueError naming the key that is wrong."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"--discover {url!r}: {e}") from None
    if not parts.hostname:
        raise ValueError(f"--discover {url!r}: expected SCHEME://NAME[:PORT]?FIELD=VALUE&...")
    known: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in known:
            raise ValueError(f"--discover {url!r}: {key} is given twice")
        if key not in SPEC_FIELDS and key not in settings:
            allowed = ", ".join(sorted({*SPEC_FIELDS, *settings}))
            raise ValueError(f"--discover {url!r}: unknown field {key!r} (allowed: {allowed})")
        known[key] = value
    source = SourceUrl(
        url=url,
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        settings={k: v for k, v in known.items() if k in settings},
        fields={k: v for k, v in known.items() if k in SPEC_FIELDS},
    )
    # Every engine found gets these fields: refuse a bad one now, not per engine.
    try:
        engine(source.fields, "check", "127.0.0.1", 1, None)
    except ValueError as e:
        raise ValueError(f"--discover {url!r}: {e}") from None
    return source
