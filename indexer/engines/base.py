"""What kvindex needs of an inference engine's event format: the :class:`EngineAdapter`.

Ingest, the API and the producer speak to engines only through an adapter,
so everything an engine type decides lives in its package under
:mod:`indexer.engines`: how a live message and a replay answer are framed,
how a payload becomes engine-neutral :mod:`indexer.core.events`, where each
data-parallel rank listens, and how a prompt's tokens become the block hashes
its events carry, and how an OpenAI request becomes the text its tokenizer reads
(:mod:`indexer.engines.rendering`). :mod:`indexer.engines.catalog` finds the adapters
by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

from indexer.compiled import Status
from indexer.core.events import EventBatch, WireError, normalise_medium
from indexer.core.load import EngineLoad
from indexer.engines.rendering import Renderer

#: Events larger than this many hashes are rejected rather than applied.
MAX_HASHES_PER_EVENT = 1 << 20

#: A replay answer's seq, or None for the marker that ends the answer.
ReplaySeq = int | None


@dataclass(frozen=True, slots=True)
class MMFeature:
    """A multimodal item's placeholder span in the prompt, keyed by its content hash.

    Engines require items sorted by ``offset``; the hashes depend on that order.
    """

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt given as token ids, with what engines mix into its block hashes."""

    tokens: tuple[int, ...]
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: Sequence[MMFeature] = ()


class BlockHasher(Protocol):
    """How one engine configuration (algorithm, seed, block size, lookahead tokens)
    hashes a prompt.

    Hashable and compared by value: a query hashes a prompt once per distinct hasher.
    """

    @property
    def reproducible(self) -> bool:
        """False when the engine's hashes cannot be computed here (tokens queries then
        go through the learned token index)."""

    def digests(self, prompt: Prompt) -> list[bytes]:
        """The raw digests of the prompt's full blocks, in order (ValueError: bad prompt)."""

    def published(self, digests: list[bytes]) -> list[int]:
        """The digests in the int form the engine publishes when it sends ints."""


class NotReproduced:
    """The hasher of a configuration whose hashes kvindex does not compute: its engines'
    ``tokens`` queries go through the learned token index."""

    reproducible = False

    def __init__(self, why: str) -> None:
        self.why = why

    def digests(self, prompt: Prompt) -> list[bytes]:
        raise ValueError(self.why)

    def published(self, digests: list[bytes]) -> list[int]:
        raise ValueError(self.why)


class CompiledPart(Protocol):
    """An adapter's compiled extension: correct without it, only many times slower,
    so every role says on start when it is missing and ``/stats`` reports it."""

    def status(self) -> Status:
        """``compiled_core``: whether it is in use; ``compiled_core_error``: why not."""

    def warn_if_unavailable(self, role: str) -> bool:
        """Log a WARNING when it is missing; True if it is in use."""


class EngineAdapter(Protocol):
    """One engine type's event format, as ingest, the API and the producer use it.

    Every decoding method raises :class:`~indexer.core.events.WireError` (with
    a short ``reason`` the consumer counts) for anything that is not a valid
    message of this format: a bad frame is counted, never a crash.
    """

    #: The name an :class:`~indexer.engine_registry.EngineSpec` gives in its ``adapter`` field.
    name: str
    #: The hash algorithms whose chains :meth:`hasher` reproduces (empty: none).
    hash_algos: tuple[str, ...]
    #: Whether a LoRA adapter's block hashes are learned from the events rather than
    #: computed: the engine's hashes name the adapter by something its events do not state.
    lora_learned: bool
    #: The release (major, minor) since which the engine's server serves a chat's
    #: ``tools: []`` as no tools; None: it refuses one, or takes no tools at all.
    empty_tools_since: tuple[int, int] | None
    #: The adapter's compiled extension, None when it has none.
    compiled: CompiledPart | None
    #: How the engine's server renders a request's prompt, None when kvindex does not
    #: restate it (then no model can be configured with this adapter).
    renderer: Renderer | None
    #: Where the engine's HTTP server states its load (:meth:`read_load`), None: nowhere.
    load_path: str | None

    #: Where the engine's HTTP server describes its KV event publishers (None: nowhere).
    sources_path: str | None

    def read_sources(self, answer: Any) -> Any:
        """The server's JSON answer at :attr:`sources_path` as each data-parallel rank's
        events config (``endpoint``, ``replay_endpoint``, ``topic``, and ``block_size``
        if the server states it): a map by rank, or a list of entries naming their
        ``data_parallel_rank``; ValueError for an answer that describes no publisher."""
        ...

    def read_load(self, text: str) -> dict[int, EngineLoad]:
        """Each data-parallel rank's load from the page at :attr:`load_path`; ValueError
        for a page that does not state it."""
        ...

    def split_live(self, frames: list[bytes]) -> tuple[int, bytes]:
        """A live message's seq and batch payload."""

    def batch_ts(self, payload: bytes) -> float:
        """A payload's batch timestamp, as cheaply as the format allows."""

    def decode(self, payload: bytes, *, tokens: bool = True) -> EventBatch:
        """A payload's events; ``tokens=False`` may skip what only the token index reads,
        and give events as the index counts them: a stretch of alike ones as one, in
        the order :func:`~indexer.core.residency.plan_batch` would apply them."""

    def encode(self, batch: EventBatch) -> bytes:
        """A batch as the engine would publish it (the producer side of :meth:`decode`)."""

    def live_frames(self, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
        """The frames of a live message (the producer side of :meth:`split_live`)."""

    def replay_request(self, start: int) -> list[bytes]:
        """The frames a replay client sends to ask for every buffered batch from ``start``."""

    def replay_start(self, frames: list[bytes]) -> int:
        """The start seq of a replay request as the engine's ROUTER receives it
        (after the peer's identity frame)."""

    def replay_answer(self, seq: ReplaySeq, payload: bytes) -> list[bytes]:
        """The frames the engine sends back for one buffered batch (None: the end marker)."""

    def split_replay(self, frames: list[bytes]) -> tuple[ReplaySeq, bytes]:
        """One replay answer as the client receives it: seq (None: the end) and payload."""

    def rank_endpoint(self, endpoint: str | None, dp_rank: int) -> str | None:
        """The address data-parallel rank ``dp_rank`` uses, given rank 0's."""

    def hasher(
        self, algo: str, seed: str | None, block_size: int, lookahead_tokens: int = 0
    ) -> BlockHasher:
        """The hasher of one engine configuration (ValueError: an algorithm it lacks);
        ``lookahead_tokens``: the tokens after each block its hash covers."""

    def stated_extras(
        self, prompt: Prompt, block_size: int, lookahead_tokens: int = 0
    ) -> list[tuple[Any, ...] | None]:
        """Each hashed block's extra keys as the engine's events state them (None: none),
        so the learned token index can key a prompt's blocks as the events taught it;
        with ``lookahead_tokens`` only the blocks that many tokens follow are hashed."""


_medium = attrgetter("medium")
_hashes = attrgetter("block_hashes")


def check_batch(batch: EventBatch) -> EventBatch:
    """Reject what decoding types cannot express: event sizes, then media.

    Both passes run in C (``map`` over attribute getters): this is on every
    batch's path, and a Python loop per event cost a third of decoding.
    """
    events = batch.events
    if events and max(map(len, map(_hashes, events))) > MAX_HASHES_PER_EVENT:
        size = next(n for n in map(len, map(_hashes, events)) if n > MAX_HASHES_PER_EVENT)
        raise WireError("too_many_hashes", str(size))
    for medium in set(map(_medium, events)):
        normalise_medium(medium)
    return batch
