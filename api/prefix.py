"""``GET``/``POST /prefix-match``: the router-facing query.

Both methods take the same fields (GET as comma-separated query strings,
POST as JSON lists, for prompts too long for a URL), are parsed into one
:class:`~indexer.query.Query` and answered by the same matcher, so they
cannot disagree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Annotated, Literal

import msgspec
from fastapi import APIRouter, Request, Response

from api.auth import demand_token, optional_security
from api.context import ApiContext
from api.errors import ApiError, ErrorBody
from api.metrics import QUERY_SECONDS, observe_answer
from api.openapi import answers, body
from api.parsing import (
    StrictQueryRoute,
    check_size,
    decode_body,
    hash_items,
    parse_hashes,
    parse_query,
    parse_tokens,
    query_parameters,
    split_list,
)
from api.schemas import (
    HASH_PATTERN,
    BlockSize,
    HashAlgo,
    PrefixMatchBody,
    PrefixMatchResponse,
    WeightsBody,
)
from api.settings import ApiSettings
from indexer.core.matching import TierWeights
from indexer.engine_registry import EngineSpec
from indexer.engines.base import MMFeature
from indexer.engines.rendering import (
    ChatOptions,
    ChatTool,
    PromptRefused,
    ResponsesRequest,
    ToolChoice,
)
from indexer.prompts import Tokenizers
from indexer.query import Overrides, Prompt
from indexer.query import Query as MatchQuery

_encode = msgspec.json.Encoder().encode
_decode_body = msgspec.json.Decoder(PrefixMatchBody).decode

_ANSWERS = answers(
    _200=(PrefixMatchResponse, "every matching engine rank, best score first"),
    _400=(
        ErrorBody,
        "not exactly one of block_hashes, tokens, prompt, messages and input; a prompt"
        " vLLM refuses (empty, a chat template error, incompatible flags, a tool_choice"
        " the model's server does not serve); a Responses history kept by the server"
        " (previous_response_id) or a tool kvindex does not render; no tokenizer"
        " configured for `model`, or the `tokenize` extra not installed",
    ),
    _401=(ErrorBody, "`route` without the bearer token (when one is configured)"),
    _404=(ErrorBody, "an engine in `engines` is not registered, or no engine serves `model`"),
    _413=(ErrorBody, "prompt or body over the configured maximum"),
    _422=(ErrorBody, "a malformed or unknown field: non-integer token, hash out of range..."),
    _503=(ErrorBody, "the store is unreachable"),
)
_CONTRACT = """\
Give exactly one of `block_hashes` (as the engines publish them), `tokens`
(kvindex hashes them exactly as each engine's vLLM does: sha256, sha256_cbor,
xxhash, xxhash_cbor, its seed, LoRA, cache salt and multimodal extra keys, in
the int or bytes form it publishes; engines whose hash cannot be reproduced
are matched through a token index learned from their events), `prompt` (a
completions prompt), `messages` (chat, text parts only) or `input` (a
Responses request). `prompt`, `messages` and `input` are tokenized for
`model` exactly as vLLM 0.33's OpenAI server does (`add_special_tokens`
defaults to true for `prompt`, false for `messages`; `add_generation_prompt`
true, `continue_final_message` false; `tools`, `tool_choice`, `documents`,
`reasoning_effort`, `instructions`, `reasoning` and `chat_template_kwargs`
as vLLM takes them, with the model's configured server tool flags), then
matched as `tokens` (POST only: the GET form takes no prompt text). `model` and
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

`routed_blocks`: leading blocks each on GPU or routed to the rank
(`POST /routed`) and not yet confirmed by its events; `approximate`: the
engine publishes no events (its blocks are all routed ones). The score is
`gpu * w.gpu + from_cpu * w.cpu + from_storage * w.storage +
max(0, routed_blocks - prefix_blocks) * w.routed`; `weights` overrides the
configured weights for this query.

`route: "best"` also picks a rank, records the prompt beyond its GPU run as
routed to it (`ttl_ms`, else the configured TTL) in the same atomic step, and
names it in `routed_to`; like `POST /routed` it then needs the bearer token
when one is configured. The pick is the rank of least cost, weighing its
prefix against its load (configured in the `api.load` section:
`per_block`, `per_request`, `pressure`; `enabled: false` picks by score alone):

    cost = max(0, num_blocks - score) * (1 + pressure * fullness)
           + per_block * queued_blocks + per_request * (running + waiting + pending)

`running` and `waiting` are the requests the engine's server last reported
(vLLM's `/metrics`, scraped from the engine's `url` every `scrape_interval`
seconds; a report older than `stale_after` seconds counts for nothing),
`pending` the requests this process routed to the rank since that report (or
within `pending_seconds` when there is none), `queued_blocks` the blocks routed
to the rank that its events have not yet stored, less the prompt's own (the
prefill work queued there; none for an engine without events), and `fullness`
(0..1) the larger
of the engine's `kv_cache_usage_perc` and kvindex's resident GPU blocks over
the cache's capacity: a miss on a full cache evicts what others may want. An
engine without a fresh report thus counts its pending picks and queue, and with no
load known anywhere the pick is the best score. A `degraded` rank is weighed
as holding nothing (after an engine restart its numbers are the old process's).
Ties: the better score, then
the rank with the fewest live routed entries, then engine name, then dp rank.
`route_costs` lists what was weighed for every candidate, the pick first.
"""
_TOKENS_DOC = "comma-separated token ids; kvindex hashes them as each engine does"
_HASHES_DOC = "comma-separated block hashes: decimal uint64, or 0x-hex for raw-digest engines"
_WEIGHTS_DOC = "per-query tier weights: gpu:1,cpu:0.5,routed:0.8"
_CSV_TOKENS = r"^([0-9]{1,19}(,[0-9]{1,19})*)?$"
_CSV_HASHES = "^({0}(,{0})*)?$".format(HASH_PATTERN.strip("^$"))


def _listed(doc: str, pattern: str) -> msgspec.Meta:
    """A comma-separated list's documentation; the pattern is checked item by item later,
    to name the bad item (and not over the whole of an 8k-token prompt in a regex)."""
    return msgspec.Meta(description=doc, extra_json_schema={"pattern": pattern})


class GetQuery(msgspec.Struct, kw_only=True):
    """``GET /prefix-match``'s query parameters, lists comma-separated: parsed in one
    pass and documented from this one definition (:func:`api.parsing.parse_query`).
    ``tokens`` and ``block_hashes`` are checked item by item later, naming the item."""

    block_hashes: Annotated[str, _listed(_HASHES_DOC, _CSV_HASHES)] | None = None
    tokens: Annotated[str, _listed(_TOKENS_DOC, _CSV_TOKENS)] | None = None
    model: Annotated[str, msgspec.Meta(description="only engines serving this model")] | None = None
    engines: Annotated[str, msgspec.Meta(description="comma-separated engine names")] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    block_size: BlockSize | None = None
    hash_algo: HashAlgo | None = None
    hash_seed: str | None = None
    weights: Annotated[str, msgspec.Meta(description=_WEIGHTS_DOC)] | None = None
    route: Literal["best"] | None = None
    ttl_ms: Annotated[int, msgspec.Meta(ge=1)] | None = None


#: The fields that say which prompt a request is about: exactly one is given.
PROMPT_FIELDS = ("block_hashes", "tokens", "prompt", "messages", "input")
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "documents", "reasoning_effort")
#: The fields that only a text prompt (``prompt``/``messages``), a chat or a Responses
#: request (``input``) takes.
_TEXT_FLAGS = (
    {"add_special_tokens": ("prompt", "messages")}
    | dict.fromkeys(_CHAT_ONLY, ("messages",))
    | dict.fromkeys(("chat_template_kwargs", "tools", "tool_choice"), ("messages", "input"))
    | dict.fromkeys(("instructions", "reasoning", "previous_response_id"), ("input",))
)


async def to_query(
    q: PrefixMatchBody,
    settings: ApiSettings,
    tokenizers: Tokenizers,
    engines: Callable[[], Collection[EngineSpec]] = tuple,
) -> MatchQuery:
    """Which chain a request is about, as the matcher takes it: the one parse every
    route taking a prompt calls. ``prompt``/``messages`` become tokens as the model's
    server makes them (off the event loop), and as the server of each other engine
    adapter of ``engines()`` (those the query selects) does (engines of a mixed fleet
    each take their own), then go the way of ``tokens``."""
    given = [name for name in PROMPT_FIELDS if getattr(q, name) is not None]
    if len(given) != 1:
        got = " and ".join(given) or "none"
        raise ApiError(400, f"give exactly one of {', '.join(PROMPT_FIELDS)} (got {got})")
    for flag, takers in _TEXT_FLAGS.items():
        if getattr(q, flag) is not None and given[0] not in takers:
            raise ApiError(400, f"{flag} applies to {' or '.join(takers)} only, not {given[0]}")
    tokens = q.tokens
    others: dict[str, list[int]] = {}
    if given[0] in ("prompt", "messages", "input"):
        served = q.tools == [] and _empty_tools_served(engines())
        tokens = await _rendered(q, tokenizers, None, served)
        for adapter in sorted({s.adapter for s in engines()} - {tokenizers.adapter(q.model)}):
            others[adapter] = await _rendered(q, tokenizers, adapter, served)
    chain = prompt = None
    rendered: dict[str, Prompt] = {}
    if tokens is not None:
        features = tuple(MMFeature(f.identifier, f.offset, f.length) for f in q.mm_features)

        def prompt_of(ids: list[int]) -> Prompt:
            check_size(len(ids), "tokens", settings.max_prompt_tokens)
            return Prompt(tuple(ids), q.lora_name, q.lora_path, q.cache_salt, features)

        prompt = prompt_of(tokens)
        rendered = {a: prompt if ids == tokens else prompt_of(ids) for a, ids in others.items()}
    else:
        chain = parse_hashes(q.block_hashes, settings.max_prompt_blocks)
    return MatchQuery(
        chain=chain,
        prompt=prompt,
        rendered=rendered,
        model=q.model,
        engines=q.engines,
        overrides=Overrides(q.block_size, q.hash_algo, q.hash_seed),
        weights=weights_of(q.weights, settings),
        route=q.route is not None,
        ttl=routed_ttl(q.ttl_ms, settings) if q.route is not None else 0.0,
    )


async def _rendered(
    q: PrefixMatchBody, tokenizers: Tokenizers, adapter: str | None, empty_tools_served: bool
) -> list[int]:
    """The tokens the server of ``model`` (of engine adapter ``adapter``, if given) makes
    of the request's ``prompt``, ``messages`` or ``input``."""
    try:
        if q.input is not None:
            return await tokenizers.tokens(q.model, responses=responses_request(q), adapter=adapter)
        options = chat_options(q, empty_tools_served)
        return await tokenizers.tokens(
            q.model, prompt=q.prompt, messages=q.messages, options=options, adapter=adapter
        )
    except PromptRefused as e:
        raise ApiError(e.status, str(e)) from None


def _empty_tools_served(specs: Collection[EngineSpec]) -> bool:
    """Whether a chat's ``tools: []`` is served as no tools: when the query asks about
    engines and every one's server serves it so (else it is refused, as vLLM 0.33 does)."""
    return bool(specs) and all(spec.serves_empty_tools() for spec in specs)


def chat_options(q: PrefixMatchBody, empty_tools_served: bool = False) -> ChatOptions:
    """A chat's flags, its tools and tool choice read as a chat request's."""
    try:
        tools = msgspec.convert(q.tools, list[ChatTool] | None)
        choice = msgspec.convert(q.tool_choice, ToolChoice | None)
    except msgspec.ValidationError as e:
        raise ApiError(422, f"invalid tools or tool_choice: {e}") from None
    return ChatOptions(
        q.add_generation_prompt,
        q.continue_final_message,
        q.add_special_tokens,
        q.chat_template_kwargs,
        tools,
        choice,
        q.documents,
        q.reasoning_effort,
        empty_tools_served,
    )


def responses_request(q: PrefixMatchBody) -> ResponsesRequest:
    """A Responses request's prompt fields; 400 for a history kvindex cannot see."""
    if q.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id: the history it names is in the engine server's response"
            " store, which kvindex cannot read: send the previous items in input",
        )
    assert q.input is not None
    return ResponsesRequest(
        input=q.input,
        instructions=q.instructions,
        tools=q.tools,
        tool_choice=q.tool_choice,
        reasoning_effort=q.reasoning.effort if q.reasoning is not None else None,
        chat_template_kwargs=q.chat_template_kwargs,
    )


def weights_of(given: WeightsBody | None, settings: ApiSettings) -> TierWeights | None:
    """A query's weights over the configured ones (None: none given)."""
    if given is None:
        return None
    mine = {
        name: value for name, value in msgspec.structs.asdict(given).items() if value is not None
    }
    return dataclasses.replace(settings.weights, **mine)


def routed_ttl(ttl_ms: int | None, settings: ApiSettings) -> float:
    """Seconds routed entries live: 422 naming ``ttl_ms`` outside the configured bounds."""
    try:
        return settings.routed.ttl(ttl_ms)
    except ValueError as e:
        raise ApiError(422, str(e)) from None


def parse_weights(text: str) -> WeightsBody:
    """``gpu:1,routed:0.5`` (GET) as the body's ``weights``; 422 naming a bad item."""
    weights: dict[str, float | str] = {}
    for item in split_list(text):
        name, _, value = item.partition(":")
        try:
            weights[name] = float(value)
        except ValueError:
            weights[name] = value  # refused below, by name
    try:
        return msgspec.convert(weights, WeightsBody)
    except msgspec.ValidationError as e:
        raise ApiError(
            422, f"weights: expected TIER:WEIGHT,... of gpu, cpu, storage, routed: {e}"
        ) from None


def router(ctx: ApiContext) -> APIRouter:
    matcher, settings = ctx.read_path, ctx.settings
    routes = APIRouter(tags=["routers"], route_class=StrictQueryRoute)

    async def answer(q: PrefixMatchBody, request: Request) -> Response:
        if q.route is not None:  # records routed entries, as POST /routed does
            demand_token(settings.auth_token, request)
        started = time.perf_counter()
        query = await to_query(
            q, settings, ctx.tokenizers, lambda: matcher.selected(q.model, q.engines)
        )
        result = await matcher.match(query)
        by = next(name for name in PROMPT_FIELDS if getattr(q, name) is not None)
        QUERY_SECONDS.labels(by).observe(time.perf_counter() - started)
        observe_answer(result)
        return Response(_encode(result), media_type="application/json")

    @routes.get(
        "/prefix-match",
        responses=_ANSWERS,
        openapi_extra=query_parameters(GetQuery) | optional_security(settings.auth_token),
        summary="Prefix held by each engine",
        description=_CONTRACT,
    )
    async def prefix_match_get(request: Request) -> Response:
        q = parse_query(request, GetQuery)
        tokens, limit = q.tokens, settings.max_prompt_tokens
        body = PrefixMatchBody(
            block_hashes=hash_items(q.block_hashes) if q.block_hashes is not None else None,
            tokens=parse_tokens(tokens, limit) if tokens is not None else None,
            model=q.model,
            engines=split_list(q.engines) if q.engines is not None else None,
            lora_name=q.lora_name,
            lora_path=q.lora_path,
            cache_salt=q.cache_salt,
            block_size=q.block_size,
            hash_algo=q.hash_algo,
            hash_seed=q.hash_seed,
            weights=parse_weights(q.weights) if q.weights is not None else None,
            route=q.route,
            ttl_ms=q.ttl_ms,
        )
        return await answer(body, request)

    @routes.post(
        "/prefix-match",
        responses=_ANSWERS,
        openapi_extra=body(PrefixMatchBody) | optional_security(settings.auth_token),
        summary="Prefix held by each engine (JSON body, for long prompts)",
        description=_CONTRACT
        + "\nThe same fields as GET, with lists instead of comma-separated strings.",
    )
    async def prefix_match_post(request: Request) -> Response:
        return await answer(await decode_body(request, _decode_body, "body"), request)

    return routes
