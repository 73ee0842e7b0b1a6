"""What an operator can tune about the HTTP API, in one immutable value.

``kvindex serve`` builds it from its flags and config file; tests build it
directly. Limits exist so that one oversized request cannot stall the event
loop that also answers every other router.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from indexer.core.load import LoadRules
from indexer.core.matching import TierWeights
from indexer.core.routed import RoutedRules
from indexer.leases import LeaseRules
from indexer.prompts import ModelTokenizer
from indexer.registry import BindPolicy


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Knobs of :func:`api.app.create_app`.

    ``auth_token``: when set, mutating endpoints require
    ``Authorization: Bearer <token>``; ``auth_token_file``: a file holding
    it, so it is in neither argv nor the config file (``kvindex`` resolves
    it, and ``$KVINDEX_AUTH_TOKEN``, into ``auth_token``). ``max_prompt_tokens`` /
    ``max_prompt_blocks`` bound a prefix-match query (413 beyond);
    ``max_body_bytes`` bounds any request body (413 beyond).
    ``token_index_capacity`` bounds the learned token index (entries, LRU).
    ``header_timeout``: seconds a client has to send a request's head, from
    connecting or from the previous response (slower clients are
    disconnected, so a slowloris cannot hold connections); ``max_connections``:
    beyond that many open connections (or requests in flight) a new connection
    is answered 503 at once, its head never read, until some close.
    ``head_bytes``: the bytes of unfinished request heads held at once across
    all connections (each may be up to ``max_body_bytes``); a connection whose
    head would take them over is answered 503 and closed. Memory for heads is
    thus at most this plus one socket read (256 KiB) in hand, whatever the
    number of connections. ``engine_binds``: where ``POST /engines``
    may ask for a bind, the subscriber's ``bind`` policy (checked here too so
    an API replica refuses what its workers would). ``models``: the tokenizer
    (and optional chat template) of each model ``prompt``/``messages`` queries
    name, the config file's top-level ``models`` section.
    """

    weights: TierWeights = field(default_factory=TierWeights)
    #: routed entries (``POST /routed``, ``route: "best"``): TTL default and bounds,
    #: entries per rank
    routed: RoutedRules = field(default_factory=RoutedRules)
    #: how ``route: "best"`` weighs each rank's load against its prefix, and how load
    #: is gathered (:mod:`indexer.core.load`)
    load: LoadRules = field(default_factory=LoadRules)
    auth_token: str | None = None
    max_prompt_tokens: int = 262_144
    max_prompt_blocks: int = 16_384
    max_body_bytes: int = 4 << 20
    token_index_capacity: int = 1 << 20
    auth_token_file: str | None = None
    header_timeout: float = 10.0
    max_connections: int = 1024
    head_bytes: int = 64 << 20
    engine_binds: BindPolicy = field(default_factory=BindPolicy)
    models: Mapping[str, ModelTokenizer] = field(default_factory=dict)
    #: the leases of self-registered engines (``POST /engines/announce``): bounds, sweep
    announce: LeaseRules = field(default_factory=LeaseRules)

    def __post_init__(self) -> None:
        if self.header_timeout <= 0 or self.max_connections < 1 or self.head_bytes < 1:
            raise ValueError(
                "header_timeout must be above 0, max_connections and head_bytes at least 1"
            )
