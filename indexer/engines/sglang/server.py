"""What SGLang 0.5.23's HTTP server says about its KV event publishers.

``GET /server_info`` carries ``kv_events``: ``publisher``, ``endpoint_host`` (a
wildcard such as ``*`` when it binds all interfaces: the server's own host then),
``endpoint_port_base``, ``replay_endpoint_port_base`` (when it replays over
tcp), ``topic``, ``block_size`` (the page size its events hash at) and
``dp_size``: rank r publishes and replays at the bases + r. The key is absent
or null when the server publishes no events. ``GET /v1/models`` names the
served model first, then LoRA adapters with their ``parent``.
"""

from __future__ import annotations

from typing import Any

PATH = "/server_info"


def read_sources(answer: Any) -> list[dict[str, Any]]:
    """Each rank's events config from the server's ``/server_info``."""
    kv = answer.get("kv_events") if isinstance(answer, dict) else None
    if not isinstance(kv, dict):
        raise ValueError(
            "no kv_events: start SGLang with --kv-events-config"
            ' \'{"publisher": "zmq", "endpoint": "tcp://*:5557", ...}\''
        )
    try:
        host, base = str(kv["endpoint_host"]), int(kv["endpoint_port_base"])
        ranks, replay = int(kv["dp_size"]), kv.get("replay_endpoint_port_base")
        common = {"publisher": kv["publisher"], "topic": kv.get("topic") or ""}
        common["block_size"] = int(kv["block_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"kv_events does not say {e}") from None
    return [
        {
            "data_parallel_rank": r,
            "endpoint": f"tcp://{host}:{base + r}",
            "replay_endpoint": None if replay is None else f"tcp://{host}:{int(replay) + r}",
            **common,
        }
        for r in range(ranks)
    ]
