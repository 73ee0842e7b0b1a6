"""``POST /routed``: a router says where it just sent a prompt.

The engine's events for that prompt come tens to hundreds of milliseconds
later; until then (or until the entry's TTL passes) the prompt's blocks count
as routed to that rank in every prefix-match answer (``routed_blocks``), so a
burst sharing a new prefix follows the first request instead of scattering.
Because an entry steers every router's answers for its TTL, recording one
needs the token when one is configured, as registering an engine does:
routers that record hold it.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response

from api.auth import require_token
from api.context import ApiContext
from api.errors import ApiError, ErrorBody
from api.openapi import answers, body
from api.operators import AUTH_REFUSAL
from api.parsing import StrictQueryRoute, decode_body
from api.prefix import routed_ttl, to_query
from api.schemas import PrefixMatchBody, PromptBody, RoutedAnswer, RoutedBody
from indexer.core.events import RankId
from indexer.engine_registry import EngineSpec, UnknownEngine

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(RoutedBody).decode
#: The prompt fields a routed entry shares with a prefix-match query.
_PROMPT = [f.name for f in msgspec.structs.fields(PromptBody)]

_CONTRACT = """\
Record that this prompt's blocks are about to be on that rank's GPU: the
prompt as in `POST /prefix-match` (exactly one of `block_hashes` or
`tokens`, hashed as the engine hashes them), `dp_rank` (default 0), `model`
(checked against the engine's), `ttl_ms` (within the configured bounds;
default the configured TTL). Until its TTL passes, or the rank's events store
the block on GPU (confirmed), or the rank's GPU is cleared, the engine
restarts or is removed, each block counts in that rank's `routed_blocks`.
Exact counts (`gpu_blocks`, `cpu_blocks`, `storage_blocks`) never change.
A rank keeps at most the configured `max_per_rank` entries (an engine with
`events: false`: its `gpu_blocks`), those whose TTL ends first going first.
With a token configured, the call needs `Authorization: Bearer <token>`.
"""


def router(ctx: ApiContext) -> APIRouter:
    matcher, settings, routed = ctx.read_path, ctx.settings, ctx.routed
    routes = APIRouter(tags=["routers"], route_class=StrictQueryRoute)

    def rank_of(q: RoutedBody) -> EngineSpec:
        try:
            spec = ctx.registry.get(q.engine)
        except UnknownEngine:
            raise ApiError(404, f"unknown engine {q.engine!r}") from None
        if q.dp_rank >= spec.dp_ranks:
            raise ApiError(422, f"dp_rank {q.dp_rank}: engine {q.engine!r} has {spec.dp_ranks}")
        if q.model is not None and q.model != spec.model:
            raise ApiError(422, f"model {q.model!r}: engine {q.engine!r} serves {spec.model!r}")
        return spec

    @routes.post(
        "/routed",
        dependencies=require_token(settings.auth_token),
        openapi_extra=body(RoutedBody),
        responses=answers(
            _200=(RoutedAnswer, "recorded"),
            _400=(ErrorBody, "not exactly one of block_hashes and tokens, or not JSON"),
            _401=AUTH_REFUSAL,
            _404=(ErrorBody, "the engine is not registered"),
            _413=(ErrorBody, "prompt or body over the configured maximum"),
            _422=(
                ErrorBody,
                "a malformed or unknown field, a dp_rank or model the engine does not have,"
                " ttl_ms outside the bounds, or tokens for an engine whose hashes cannot"
                " be computed",
            ),
            _503=(ErrorBody, "the store is unreachable"),
        ),
        summary="Record where a prompt was routed",
        description=_CONTRACT,
    )
    async def record(request: Request) -> Response:
        q = await decode_body(request, _decode, "body")
        spec = rank_of(q)
        ttl = routed_ttl(q.ttl_ms, settings)
        prompt = {name: getattr(q, name) for name in _PROMPT}
        # rendered as the engine's server renders it, whatever the model's adapter
        query = await to_query(PrefixMatchBody(**prompt), settings, ctx.tokenizers, lambda: (spec,))
        chain = matcher.chain_of(query, spec)
        bound = settings.routed.bound(None if spec.events else spec.gpu_blocks)
        new = await routed.record(RankId(spec.name, q.dp_rank), chain, ttl, bound)
        answer = RoutedAnswer(spec.name, q.dp_rank, len(chain), new, round(ttl * 1000))
        return Response(_encode(answer), media_type="application/json")

    return routes
