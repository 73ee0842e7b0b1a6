"""The answers kvindex gives routers: declared once, encoded by the server (:mod:`api`)
and decoded by the client (:mod:`kvindex.client`).

msgspec structs and nothing else, so a router installing the client imports none of
the server's dependencies. An answer may gain fields: a client built before them
ignores them, so new fields come with defaults.
"""

from __future__ import annotations

import msgspec

__all__ = ["EngineMatch", "PrefixMatchResponse", "RankRef", "RouteCost"]


class EngineMatch(msgspec.Struct):
    """How much of the prompt one engine rank can serve, per tier.

    ``gpu_blocks``: leading blocks the engine reuses from GPU (for a hybrid
    model the blocks every KV group can serve, as vLLM's scheduler finds them).
    ``gpu_blocks_full_attention``: leading blocks on GPU in the full-attention
    groups alone (equal to ``gpu_blocks`` unless the model is hybrid).
    ``cpu_blocks``/``storage_blocks``:
    leading blocks loadable from that tier alone, in whole chunks.
    ``prefix_blocks``: leading blocks each on GPU or loadable from a lower
    tier (lower tiers in whole chunks). ``score``: the tier weight of each
    prefix block, summed. ``degraded``: the view has an unfilled gap or the
    rank is not connected.
    """

    engine: str
    dp_rank: int
    model: str
    block_size: int
    gpu_blocks: int
    cpu_blocks: int
    storage_blocks: int
    prefix_blocks: int
    prefix_tokens: int
    score: float
    degraded: bool
    #: defaults to 0 for servers older than the field, which do not send it
    gpu_blocks_full_attention: int = 0
    #: leading blocks each on GPU or routed to the rank (``POST /routed``) and not yet
    #: confirmed by its events
    routed_blocks: int = 0
    #: the engine publishes no events: every block it is said to hold is a routed one
    approximate: bool = False


class RankRef(msgspec.Struct):
    """One engine rank: the pick of ``route: "best"``."""

    engine: str
    dp_rank: int


class RouteCost(msgspec.Struct):
    """What ``route: "best"`` weighed for one candidate rank (the cost formula is in the
    prefix-match docs): its score, the requests ahead of the prompt there (``running``
    and ``waiting`` as the engine last reported them, ``pending`` routed since), the
    prefill blocks routed there and not yet begun, the prompt's own aside
    (``queued_blocks``; shown but not weighed for an engine that publishes no events,
    which never confirms them), ``fullness`` of its KV cache, and ``load_age_ms`` of the
    report (null: no fresh report, so only ``pending`` and the queue count)."""

    engine: str
    dp_rank: int
    cost: float
    score: float
    requests_ahead: float
    queued_blocks: int
    pending: int
    running: float | None
    waiting: float | None
    fullness: float
    load_age_ms: float | None


class PrefixMatchResponse(msgspec.Struct):
    """Every engine rank matching the filters, best score first.

    ``block_size``/``num_blocks`` are null when the selected engines use
    different block sizes; each entry carries its own ``block_size``.
    """

    block_size: int | None
    num_blocks: int | None
    engines: list[EngineMatch]
    #: with ``route: "best"``: the rank picked, for which the prompt was recorded
    routed_to: RankRef | None = None
    #: with ``route: "best"``: every candidate's cost, cheapest (the pick) first
    route_costs: list[RouteCost] | None = None
