"""What an operator can tune about the HTTP API, in one immutable value.

``kvindex serve`` builds it from its flags and config file; tests build it
directly. Limits exist so that one oversized request cannot stall the event
loop that also answers every other router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from indexer.model import TierWeights


@dataclass(frozen=True, slots=True)
class ApiSettings:
    """Knobs of :func:`api.app.create_app`.

    ``auth_token``: when set, mutating endpoints require
    ``Authorization: Bearer <token>``. ``max_prompt_tokens`` /
    ``max_prompt_blocks`` bound a prefix-match query (413 beyond);
    ``max_body_bytes`` bounds any request body (413 beyond).
    ``token_index_capacity`` bounds the learned token index (entries, LRU).
    """

    weights: TierWeights = field(default_factory=TierWeights)
    auth_token: str | None = None
    max_prompt_tokens: int = 262_144
    max_prompt_blocks: int = 16_384
    max_body_bytes: int = 4 << 20
    token_index_capacity: int = 1 << 20
