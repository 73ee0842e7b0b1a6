"""``kvindex status``: the fleet as a terminal table, read from a running server.

One row per engine dp rank: ok or degraded and why (the server's judgement,
the one prefix-match flags ranks by: not connected, an unfilled gap, or
batches the store lost), resident blocks per tier, and how far its applied
batches trail what it has received. The totals line is ``/stats``. Standard
library HTTP only: the command needs nothing a bare server does not have.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from indexer.core.events import MEDIA

HEADERS = ("ENGINE", "DP", "STATE", *MEDIA, "LAG BATCHES", "LAG S", "GAPS", "REPLAYS", "RESTARTS")


class FleetUnreachable(Exception):
    """The server cannot be asked; the message says which URL and why."""


def _get(base: str, path: str, token: str | None, gone_ok: bool = False) -> Any:
    """The JSON at ``path``; None for a 404 when ``gone_ok`` (an engine removed
    between listing and asking)."""
    url = base.rstrip("/") + path
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as e:
        if gone_ok and e.code == 404:
            return None
        hint = ": give --token or $KVINDEX_AUTH_TOKEN" if e.code == 401 else ""
        raise FleetUnreachable(f"{url} answered {e.code} {e.reason}{hint}") from None
    except urllib.error.URLError as e:
        raise FleetUnreachable(f"cannot reach {url}: {e.reason}") from None
    except (OSError, ValueError) as e:  # a reset connection, or not JSON
        raise FleetUnreachable(f"{url}: {e}") from None


def rank_state(rank: dict[str, Any]) -> str:
    """ok, or degraded and the server's reasons (its one rule, as prefix-match's)."""
    if not rank.get("degraded"):
        return "ok"
    return "; ".join(["degraded", *rank.get("degraded_reasons", [])])


def rows(engines: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The table's rows from ``/engines/{name}`` answers, engines in name order."""
    table = []
    for engine in sorted(engines, key=lambda e: e["name"]):
        for rank in engine["ranks"]:
            blocks = rank.get("blocks", {})
            table.append(
                (
                    engine["name"],
                    str(rank["dp_rank"]),
                    rank_state(rank),
                    *(str(blocks.get(m, 0)) for m in MEDIA),
                    str(rank.get("lag_batches", 0)),
                    f"{rank.get('lag_seconds', 0.0):.1f}",
                    f"{rank.get('gaps_unfilled', 0)}/{rank.get('gaps', 0)}",
                    str(rank.get("replays", 0)),
                    str(rank.get("restarts", 0)),
                )
            )
    return table


def _cell(column: int, value: str, width: int) -> str:
    return value.ljust(width) if column < 3 else value.rjust(width)  # names left, numbers right


def render(table: list[tuple[str, ...]], stats: dict[str, Any]) -> str:
    """Aligned columns, then one totals line."""
    lines = [HEADERS, *table]
    widths = [max(len(row[i]) for row in lines) for i in range(len(HEADERS))]
    text = [
        "  ".join(_cell(i, v, w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        for row in lines
    ]
    blocks = "  ".join(f"{m} {stats['blocks'].get(m, 0)}" for m in MEDIA)
    text.append(
        f"{stats['engines']} engines, {stats['registered_ranks']} ranks:"
        f" {stats['connected_ranks']} connected, {stats['never_connected_ranks']} never connected,"
        f" {stats['degraded_ranks']} degraded; resident blocks {blocks}"
    )
    if stats.get("compiled_core") is False:
        text.append(f"warning: compiled core not loaded ({stats.get('compiled_core_error')})")
    return "\n".join(line.rstrip() for line in text)


def fleet_table(url: str, token: str | None = None) -> str:
    """Ask the server at ``url`` for every engine and the totals; the table."""
    names = [spec["name"] for spec in _get(url, "/engines", token)]
    engines = [
        _get(url, f"/engines/{urllib.parse.quote(n, safe='')}", token, gone_ok=True) for n in names
    ]
    return render(rows([e for e in engines if e is not None]), _get(url, "/stats", token))
