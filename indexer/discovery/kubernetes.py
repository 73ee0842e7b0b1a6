"""Kubernetes pods as engines: the pure part (pod objects -> engine specs).

A pod is an engine while it is Running, Ready, not being deleted and has an
IP. Its settings are the ``--discover`` URL's fields, overridden by its own
``kvindex.io/*`` annotations (``kvindex.io/block-size: "32"``,
``kvindex.io/hash-algo``, ``kvindex.io/model``, ``kvindex.io/dp-ranks``,
``kvindex.io/port``, ``kvindex.io/replay-port``, ...: the field name with
dashes). The engine is named after the pod, its endpoints are the pod IP at
the event and replay ports. A pod whose annotations cannot make an engine
(an unknown ``kvindex.io/`` key, a bad value) is rejected with a reason, so
one misconfigured pod is reported, not registered wrong and not a crash.

A seed in an annotation is readable by anyone who may read the pod: give
``hash_seed`` only where that is acceptable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from indexer.discovery import source
from indexer.engine_registry import EngineSpec

PREFIX = "kvindex.io/"
#: Annotations that place the engine rather than describe it.
PORT, REPLAY_PORT = "port", "replay-port"
DEFAULT_PORT = 5557  # vLLM's default KV events endpoint port


@dataclass(frozen=True, slots=True)
class Defaults:
    """What every pod's engine gets unless its annotations say otherwise."""

    fields: Mapping[str, Any]
    port: int = DEFAULT_PORT
    replay_port: int | None = None


def is_serving(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, not terminating, and with an IP: an engine that can publish now."""
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return (
        status.get("phase") == "Running"
        and ready
        and not (pod.get("metadata") or {}).get("deletionTimestamp")
        and bool(status.get("podIP"))
    )


def pod_engine(pod: Mapping[str, Any], defaults: Defaults) -> EngineSpec:
    """The engine of one serving pod (raises ValueError saying which annotation is wrong)."""
    meta = pod.get("metadata") or {}
    name = meta.get("name") or ""
    fields = dict(defaults.fields)
    port, replay_port = defaults.port, defaults.replay_port
    for key, value in (meta.get("annotations") or {}).items():
        if not key.startswith(PREFIX):
            continue
        field = key.removeprefix(PREFIX)
        if field in (PORT, REPLAY_PORT):
            if not value.isdigit() or not 1 <= int(value) <= 65535:
                raise ValueError(f"pod {name!r}: {key} must be a port 1-65535, got {value!r}")
            port, replay_port = (int(value), replay_port) if field == PORT else (port, int(value))
        elif field.replace("-", "_") in source.SPEC_FIELDS:
            fields[field.replace("-", "_")] = value
        else:
            raise ValueError(f"pod {name!r}: unknown annotation {key!r}")
    try:
        return source.engine(fields, name, pod["status"]["podIP"], port, replay_port)
    except ValueError as e:
        raise ValueError(f"pod {name!r}: {e}") from None


def pod_engines(
    pods: Iterable[Mapping[str, Any]], defaults: Defaults
) -> tuple[dict[str, EngineSpec], dict[str, str]]:
    """The engines of the serving pods by name, and the pods rejected with why."""
    engines: dict[str, EngineSpec] = {}
    rejected: dict[str, str] = {}
    for pod in pods:
        if not is_serving(pod):
            continue
        try:
            spec = pod_engine(pod, defaults)
        except ValueError as e:
            rejected[(pod.get("metadata") or {}).get("name", "?")] = str(e)
            continue
        engines[spec.name] = spec
    return engines, rejected
