"""``GET``/``POST /prefix-match``: the router-facing query.

Both methods take the same fields (GET as comma-separated query strings,
POST as JSON lists, for prompts too long for a URL), are parsed into one
:class:`~api.matching.Query` and answered by the same matcher, so they
cannot disagree.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from fastapi import APIRouter, Query, Request, Response

from api.chains import Overrides, Prompt
from api.context import ApiContext
from api.errors import ApiError, ErrorBody
from api.matching import PrefixMatcher
from api.matching import Query as MatchQuery
from api.metrics import QUERY_SECONDS, observe_answer
from api.openapi import answers, body
from api.parsing import (
    StrictQueryRoute,
    check_size,
    decode_body,
    parse_hashes,
    parse_tokens,
    split_list,
)
from api.schemas import (
    HASH_PATTERN,
    MAX_BLOCK_SIZE,
    HashAlgo,
    PrefixMatchBody,
    PrefixMatchResponse,
)
from api.settings import ApiSettings
from indexer.engines.base import MMFeature

_encode = msgspec.json.Encoder().encode
_decode_body = msgspec.json.Decoder(PrefixMatchBody).decode

_ANSWERS = answers(
    _200=(PrefixMatchResponse, "every matching engine rank, best score first"),
    _400=(ErrorBody, "not exactly one of block_hashes and tokens"),
    _404=(ErrorBody, "an engine in `engines` is not registered, or no engine serves `model`"),
    _413=(ErrorBody, "prompt or body over the configured maximum"),
    _422=(ErrorBody, "a malformed or unknown field: non-integer token, hash out of range..."),
    _503=(ErrorBody, "the store is unreachable"),
)
_CONTRACT = """\
Give exactly one of `block_hashes` (as the engines publish them) or `tokens`
(kvindex hashes them exactly as each engine's vLLM does: sha256, sha256_cbor,
xxhash, xxhash_cbor, its seed, LoRA, cache salt and multimodal extra keys, in
the int or bytes form it publishes; engines whose hash cannot be reproduced
are matched through a token index learned from their events). `model` and
`engines` filter (an engine that is not registered, or a model no registered
engine serves, is a 404); `block_size`, `hash_algo`, `hash_seed` override the
engines' declared values for `tokens`. A query parameter or body field the
endpoint does not take is a 422 that names it.

Every rank of every matching engine is answered, best `score` first (then
engine name, rank): `gpu_blocks` leading blocks the engine reuses from GPU
(for hybrid models, what every KV group serves; `gpu_blocks_full_attention`
what the full-attention groups alone hold); `cpu_blocks` /
`storage_blocks` leading blocks loadable from that tier in whole chunks;
`prefix_blocks` leading blocks each on GPU or loadable from a lower tier
(`prefix_tokens` = `prefix_blocks * block_size`); `score` the tier weight of
each prefix block, summed; `degraded` the rank's view has an unfilled gap or
is not connected.
"""
_TOKENS_DOC = "comma-separated token ids; kvindex hashes them as each engine does"
_HASHES_DOC = "comma-separated block hashes: decimal uint64, or 0x-hex for raw-digest engines"
_CSV_TOKENS = r"^([0-9]{1,19}(,[0-9]{1,19})*)?$"
_CSV_HASHES = "^({0}(,{0})*)?$".format(HASH_PATTERN.strip("^$"))


def to_query(q: PrefixMatchBody, settings: ApiSettings) -> MatchQuery:
    """Check a request's prompt and turn it into what the matcher takes."""
    if (q.block_hashes is None) == (q.tokens is None):
        given = "both" if q.tokens is not None else "neither"
        raise ApiError(400, f"give exactly one of block_hashes and tokens (got {given})")
    chain = prompt = None
    if q.tokens is not None:
        check_size(len(q.tokens), "tokens", settings.max_prompt_tokens)
        features = tuple(MMFeature(f.identifier, f.offset, f.length) for f in q.mm_features)
        prompt = Prompt(tuple(q.tokens), q.lora_name, q.lora_path, q.cache_salt, features)
    else:
        chain = parse_hashes(q.block_hashes, settings.max_prompt_blocks)
    return MatchQuery(
        chain=chain,
        prompt=prompt,
        model=q.model,
        engines=q.engines,
        overrides=Overrides(q.block_size, q.hash_algo, q.hash_seed),
    )


def router(ctx: ApiContext) -> APIRouter:
    matcher, settings = PrefixMatcher(ctx), ctx.settings
    routes = APIRouter(tags=["routers"], route_class=StrictQueryRoute)

    async def answer(q: PrefixMatchBody) -> Response:
        started = time.perf_counter()
        query = to_query(q, settings)
        result = await matcher.match(query)
        by = "tokens" if query.prompt is not None else "block_hashes"
        QUERY_SECONDS.labels(by).observe(time.perf_counter() - started)
        observe_answer(result)
        return Response(_encode(result), media_type="application/json")

    @routes.get(
        "/prefix-match",
        responses=_ANSWERS,
        summary="Prefix held by each engine",
        description=_CONTRACT,
    )
    async def prefix_match_get(
        block_hashes: Annotated[
            str | None, Query(description=_HASHES_DOC, json_schema_extra={"pattern": _CSV_HASHES})
        ] = None,
        tokens: Annotated[
            str | None, Query(description=_TOKENS_DOC, json_schema_extra={"pattern": _CSV_TOKENS})
        ] = None,
        model: Annotated[str | None, Query(description="only engines serving this model")] = None,
        engines: Annotated[str | None, Query(description="comma-separated engine names")] = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        block_size: Annotated[int | None, Query(ge=1, le=MAX_BLOCK_SIZE)] = None,
        hash_algo: HashAlgo | None = None,
        hash_seed: str | None = None,
    ) -> Response:
        q = PrefixMatchBody(
            block_hashes=split_list(block_hashes) if block_hashes is not None else None,
            tokens=parse_tokens(tokens, settings.max_prompt_tokens) if tokens is not None else None,
            model=model,
            engines=split_list(engines) if engines is not None else None,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            block_size=block_size,
            hash_algo=hash_algo,
            hash_seed=hash_seed,
        )
        return await answer(q)

    @routes.post(
        "/prefix-match",
        responses=_ANSWERS,
        openapi_extra=body(PrefixMatchBody),
        summary="Prefix held by each engine (JSON body, for long prompts)",
        description=_CONTRACT
        + "\nThe same fields as GET, with lists instead of comma-separated strings.",
    )
    async def prefix_match_post(request: Request) -> Response:
        return await answer(await decode_body(request, _decode_body, "body"))

    return routes
