"""Request and response bodies of the HTTP API: the router contract.

msgspec structs, so that one definition validates a body, encodes an answer
and (through :mod:`api.openapi`) documents both in the OpenAPI schema.
Engine configuration and rank status reuse :mod:`indexer.engine_registry` so the
API cannot drift from what the registry and the subscriber hold.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# The answers are declared once, in the package the client decodes them with too; the
# contract re-exports them beside the bodies.
from answers import EngineMatch as EngineMatch
from answers import PrefixMatchResponse as PrefixMatchResponse
from answers import RankRef as RankRef
from answers import RouteCost as RouteCost
from indexer.announcements import Lease
from indexer.discovery.served import DESCRIBED
from indexer.engine_registry import HASH_ALGOS, EngineSpec, RankStatus
from indexer.engines.rendering import ChatMessage, ReasoningEffort
from indexer.stores.base import Residency

MAX_TOKEN = (1 << 63) - 1
MAX_UINT64 = (1 << 64) - 1

#: A hash in text: decimal uint64, or ``0x`` + hex for engines publishing raw digests.
HASH_PATTERN = r"^([0-9]{1,20}|0x([0-9a-fA-F]{2}){1,64})$"

Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN)]
# msgspec checks bounds only within int64: the uint64 ceiling is documented here
# and enforced by api.parsing.parse_hash.
HashInt = Annotated[int, msgspec.Meta(ge=0, extra_json_schema={"maximum": MAX_UINT64})]
HashText = Annotated[
    str,
    msgspec.Meta(
        pattern=HASH_PATTERN,
        description="decimal uint64 (for clients without 64-bit ints) or 0x-hex raw digest",
    ),
]
MAX_BLOCK_SIZE = 1 << 16
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
HashAlgo = Literal[HASH_ALGOS]


class MMFeatureBody(msgspec.Struct, forbid_unknown_fields=True):
    """A multimodal item's placeholder span, keyed by its content hash."""

    identifier: str
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(ge=1)]


class PromptBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A prompt as the engines hash it: its ``block_hashes``, or its ``tokens`` with
    what vLLM mixes into the hashes. ``POST /prefix-match`` and ``POST /routed`` take
    it alike (one definition, so the two cannot drift), and ``/routed`` hands it to
    ``/prefix-match``'s parse as it is."""

    block_hashes: list[HashInt | HashText] | None = None
    tokens: list[Token] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: list[MMFeatureBody] = []
    block_size: BlockSize | None = None
    hash_algo: HashAlgo | None = None
    hash_seed: str | None = None


class ReasoningBody(msgspec.Struct):
    """A Responses request's ``reasoning``: its ``effort`` reaches the template."""

    effort: ReasoningEffort | None = None
    summary: str | None = None


class PrefixMatchBody(PromptBody, kw_only=True):
    """``POST /prefix-match``: exactly one of ``block_hashes``, ``tokens``,
    ``prompt``, ``messages`` or ``input``.

    ``prompt`` (a completions prompt: text, or token ids taken as they are),
    ``messages`` (chat) and ``input`` (a Responses request) are tokenized as
    vLLM's OpenAI server does for ``model``; the other fields of those requests
    mean what they mean there: ``add_special_tokens`` (``prompt``,
    ``messages``), ``add_generation_prompt``, ``continue_final_message``,
    ``documents``, ``reasoning_effort`` (``messages``), ``instructions``,
    ``reasoning``, ``previous_response_id`` (``input``), ``tools``,
    ``tool_choice``, ``chat_template_kwargs`` (``messages``, ``input``).

    ``block_size``, ``hash_algo`` and ``hash_seed`` override the engines'
    declared values when kvindex hashes ``tokens``; ``block_size`` also
    converts a ``block_hashes`` answer to tokens. ``lora_name`` and
    ``lora_path`` go together: vLLM hashes both.
    """

    prompt: str | list[Token] | None = None
    messages: list[ChatMessage] | None = None
    #: a Responses request's input: a string (one user message) or its items
    input: str | list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: chat tools (``{"type": "function", "function": {...}}``) or Responses tools
    #: (``{"type": "function", "name": ...}``), as the request has them
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    instructions: str | None = None
    reasoning: ReasoningBody | None = None
    #: refused: the history it names is in the engine server's store, not in the body
    previous_response_id: str | None = None
    model: str | None = None
    engines: list[str] | None = None
    #: per-query tier weights (the configured ones for those left out)
    weights: WeightsBody | None = None
    #: ``"best"``: pick the best-scoring rank and record the prompt as routed to it
    route: Literal["best"] | None = None
    #: with ``route``: the routed entries' TTL
    ttl_ms: TtlMs | None = None


NonNegative = Annotated[float, msgspec.Meta(ge=0, le=1e6)]


class WeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    """A query's tier weights; a weight left out is the configured one."""

    gpu: NonNegative | None = None
    cpu: NonNegative | None = None
    storage: NonNegative | None = None
    routed: NonNegative | None = None


TtlMs = Annotated[int, msgspec.Meta(ge=1, description="within the configured routed TTL bounds")]


class RoutedBody(PromptBody, kw_only=True):
    """``POST /routed``: this prompt's blocks are about to be on that rank's GPU.

    The prompt is given as in ``POST /prefix-match``: exactly one of
    ``block_hashes`` or ``tokens`` (with the fields vLLM mixes into its hashes).
    """

    engine: str
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    model: str | None = None
    ttl_ms: TtlMs | None = None


class RoutedAnswer(msgspec.Struct):
    """What ``POST /routed`` recorded: ``blocks`` routed (``recorded`` of them new)
    for ``ttl_ms``."""

    engine: str
    dp_rank: int
    blocks: int
    recorded: int
    ttl_ms: int


class RankState(RankStatus):
    """A rank's consumer status with its residency: distinct hashes per medium.

    ``degraded`` is the rule prefix-match flags ranks by (not connected, an
    unfilled gap, or a store loss not applied again); ``degraded_reasons``
    says which, in words.
    """

    blocks: dict[str, int] = {}
    anomalies: dict[str, int] = {}
    degraded_reasons: list[str] = []


class RankCounts(msgspec.Struct):
    """How many ranks are in each state, by the rule of ``RankState.degraded``.

    ``registered_ranks``: the declared dp ranks of the registered engines,
    plus any other rank of theirs the store holds (a rank with no consumer
    is not connected, so degraded). The others count among those.
    """

    registered_ranks: int = 0
    connected_ranks: int = 0
    never_connected_ranks: int = 0
    degraded_ranks: int = 0


class EngineView(EngineSpec):
    """An engine's declaration as the API answers it. ``hash_seed`` is the engine's
    ``PYTHONHASHSEED``, which lets whoever has it predict what an engine holds: it is
    set only with the token, and shown only to a caller who presents it (null to
    others); ``hash_seed_set`` tells every caller whether one is declared."""

    hash_seed_set: bool = False


def engine_view(spec: EngineSpec, with_seed: bool) -> dict[str, Any]:
    """``spec``'s fields as :class:`EngineView` and its subclasses take them."""
    fields = msgspec.structs.asdict(spec) | {"hash_seed_set": spec.hash_seed is not None}
    return fields if with_seed else fields | {"hash_seed": None}


#: ``GET /engines``: an engine's declaration and its :class:`RankCounts` (msgspec has no
#: multiple inheritance: the counts' fields are added to the view's here).
EngineSummary = msgspec.defstruct(
    "EngineSummary",
    [(f.name, f.type, f.default) for f in msgspec.structs.fields(RankCounts)],
    bases=(EngineView,),
    module=__name__,
)


#: ``POST /engines`` by the engine's OpenAI server: its ``url`` and any field of an
#: engine but those the server's ``/kv_event_sources`` gives; ``name`` defaults to the
#: url's ``HOST:PORT``, ``model`` to the first served in ``/v1/models``, ``block_size``
#: to learning it from the events.
UrlRegistration = msgspec.defstruct(
    "UrlRegistration",
    [
        ("url", Annotated[str, msgspec.Meta(pattern="^https?://", examples=["http://host:8100"])]),
        *(
            (f.name, f.type | None, None)
            if f.name in ("name", "model", "block_size")
            else (f.name, f.type, f.default)
            for f in msgspec.structs.fields(EngineSpec)
            if f.name not in DESCRIBED
        ),
    ],
    kw_only=True,
    forbid_unknown_fields=True,
    module=__name__,
)


class EngineState(EngineView):
    """An engine's declaration and the state of each of its dp ranks."""

    ranks: list[RankState] = []
    #: a self-registered engine's lease (null: registered by hand, never expires)
    lease: Lease | None = None
    #: where its events contradict what it declared (then it is not matched by tokens)
    misdeclared: list[str] = []
    #: for an engine registered without a block size (``block_size`` null, as by its
    #: ``url``): the one its events showed (null until its first ``BlockStored``)
    learned_block_size: int | None = None
    #: why prefix-match answers it with zeros for now: its block size is not known yet,
    #: or (``tokens`` queries) its events contradict its declaration (null: it is matched)
    unmatched: str | None = None


class BlockResidencies(msgspec.Struct):
    hash: str
    residency: list[Residency]


class Stats(RankCounts, kw_only=True):
    """Totals. The rank counts are those of ``GET /engines`` summed; ``stored_ranks``:
    ranks the store holds state for (any engine's); ``blocks``: distinct resident
    hashes per medium, summed over those."""

    engines: int
    stored_ranks: int
    blocks: dict[str, int]
    anomalies: dict[str, int]
    token_index_entries: int
    #: routed entries: recorded, confirmed, expired, evicted, cleared (ended by a GPU
    #: clear, a restart or a removal), live (in scale-out: every process's)
    routed: dict[str, int]
    #: False when the compiled core did not build or load (kvindex then runs many
    #: times slower); ``compiled_core_error`` says why.
    compiled_core: bool
    compiled_core_error: str | None


class Status(msgspec.Struct):
    status: str


class Readiness(msgspec.Struct, omit_defaults=True):
    """``/readyz``'s answer. ``no_publisher``: the ranks (``engine/dp_rank
    endpoint``) that have never had a publisher connected, most likely a
    wrong endpoint or an engine that is not running (omitted when none)."""

    status: str
    no_publisher: list[str] = []
