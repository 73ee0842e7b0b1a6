"""What an operator can tune about the HTTP API, in one immutable value.

``kvindex serve`` builds it from its flags and config file; tests build it
directly. Limits exist so that one oversized request cannot stall the event
loop that also answers every other router.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from indexer.announcements import LeaseRules
from indexer.core.load import LoadRules
from indexer.core.matching import TierWeights
from indexer.core.routed import RoutedRules
from indexer.engine_registry import BindPolicy
from indexer.prompts import ModelTokenizer


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Knobs of the API (:func:`api.app.create_app`): the ``api`` section of the config file
    (``engine_binds`` and ``models`` come from the ``subscriber.bind`` and ``models``
    sections). Memory for request heads is at most ``head_bytes`` plus one socket read
    (256 KiB) in hand, whatever the number of connections."""

    #: Score per prefix block by the tier it is served from.
    weights: TierWeights = field(default_factory=TierWeights)
    #: Routed entries (``POST /routed``, ``route: "best"``): TTL default and bounds,
    #: entries per rank.
    routed: RoutedRules = field(default_factory=RoutedRules)
    #: How ``route: "best"`` weighs each rank's load against its prefix, and how load
    #: is gathered (:mod:`indexer.core.load`).
    load: LoadRules = field(default_factory=LoadRules)
    #: When set, every call that changes what kvindex follows or answers needs
    #: ``Authorization: Bearer <token>``. Prefer ``auth_token_file`` or
    #: ``$KVINDEX_AUTH_TOKEN``, which keep it out of the file.
    auth_token: str | None = None
    #: Tokens a prefix-match query may carry (413 beyond): bounds a query's hashing work.
    max_prompt_tokens: int = 262_144
    #: Block hashes a prefix-match query may carry (413 beyond).
    max_prompt_blocks: int = 16_384
    #: Bytes of any request body, and of a request head (413, 431 beyond): raise it
    #: with ``max_prompt_tokens`` for longer prompts.
    max_body_bytes: int = 4 << 20
    #: Entries of the learned token index (LRU, about 200 bytes each): raise it when
    #: engines whose hash kvindex cannot compute hold more blocks than this.
    token_index_capacity: int = 1 << 20
    #: A file holding the token, read once at start, so it is in neither argv nor
    #: the config file.
    auth_token_file: str | None = None
    #: Seconds a client has to send a request's head, from connecting or from the
    #: previous response; slower clients are disconnected, so a slowloris cannot hold
    #: connections.
    header_timeout: float = 10.0
    #: Open connections (or requests in flight) beyond which a new connection is
    #: answered 503 at once, its head never read, until some close.
    max_connections: int = 1024
    #: Bytes of unfinished request heads held at once across all connections (each
    #: up to ``max_body_bytes``); a connection whose head would pass it is answered
    #: 503 and closed.
    head_bytes: int = 64 << 20
    #: Where ``POST /engines`` may ask for a bind: the subscriber's ``bind`` policy,
    #: checked here too so an API replica refuses what its workers would.
    engine_binds: BindPolicy = field(default_factory=BindPolicy)
    #: The tokenizer (and chat template, tool flags) of each model ``prompt``,
    #: ``messages`` and ``input`` queries name.
    models: Mapping[str, ModelTokenizer] = field(default_factory=dict)
    #: The leases of self-registered engines (``POST /engines/announce``): bounds, sweep.
    announce: LeaseRules = field(default_factory=LeaseRules)

    def __post_init__(self) -> None:
        if self.header_timeout <= 0 or self.max_connections < 1 or self.head_bytes < 1:
            raise ValueError(
                "header_timeout must be above 0, max_connections and head_bytes at least 1"
            )
