"""Older vLLM releases' event wire: positional arrays, the tag first.

Before vLLM tagged its events as maps it encoded each event as an array,
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` and
``["AllBlocksCleared"]`` (the first of these releases had no ``medium``: nil,
so GPU), in a batch ``[ts, events]`` that later gained ``data_parallel_rank``,
and in the same ZMQ framing as today's releases. Fields later positional
releases appended are ignored: those releases are the ``vllm`` adapter's,
which reads both shapes. Batches are encoded with every field these
releases had, as the last of them did.

These events state no extra keys, so the learned token index learns nothing
from them, and kvindex does not reproduce these releases' hashes: such an
engine is matched by block hashes only (a ``tokens`` query finds nothing on it).
"""

from __future__ import annotations

import msgspec

from indexer.core.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)
from indexer.engines import vllm_metrics, vllm_server
from indexer.engines.base import NotReproduced, Prompt, check_batch
from indexer.engines.zmq_framing import ZmqFraming

_POSITIONAL = {"array_like": True, "frozen": True, "gc": False}


class _Stored(msgspec.Struct, tag="BlockStored", **_POSITIONAL):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", **_POSITIONAL):
    block_hashes: list[BlockHash]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", **_POSITIONAL):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    """A batch with its events left undecoded: all that reading its ts needs."""

    ts: float
    events: msgspec.Raw


_decode_batch = msgspec.msgpack.Decoder(_Batch).decode
_decode_envelope = msgspec.msgpack.Decoder(_Envelope).decode
_encode = msgspec.msgpack.Encoder().encode


def _neutral(event: _Stored | _Removed | _Cleared) -> Event:
    if type(event) is _Stored:
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if type(event) is _Removed:
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


def _positional(event: Event) -> _Stored | _Removed | _Cleared:
    if type(event) is BlockStored:
        return _Stored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if type(event) is BlockRemoved:
        return _Removed(event.block_hashes, event.medium)
    return _Cleared()


_NOT_REPRODUCED = NotReproduced("the vllm_legacy adapter does not reproduce its engines' hashes")


class LegacyVllmAdapter(ZmqFraming):
    """Positional events in msgpack, in vLLM's seq-numbered ZMQ frames."""

    name = "vllm_legacy"
    hash_algos: tuple[str, ...] = ()
    lora_learned = False  # nothing is computed: every block is learned
    empty_tools_since = None  # these releases' front end is not restated (``renderer``)
    compiled = None
    #: These releases' OpenAI front end is not restated here.
    renderer = None
    load_path = vllm_metrics.PATH  # the same gauges, named alike
    read_load = staticmethod(vllm_metrics.read_load)
    sources_path = vllm_server.PATH
    read_sources = staticmethod(vllm_server.read_sources)

    def batch_ts(self, payload: bytes) -> float:
        try:
            return _decode_envelope(payload).ts
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError("bad_payload", str(e)) from None

    def decode(self, payload: bytes, *, tokens: bool = True) -> EventBatch:
        """``tokens`` is ignored: these events are small enough to decode whole."""
        try:
            batch = _decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError("bad_payload", str(e)) from None
        events = [_neutral(e) for e in batch.events]
        return check_batch(EventBatch(batch.ts, events, batch.data_parallel_rank))

    def encode(self, batch: EventBatch) -> bytes:
        """Fields these releases lacked (lora_name, extra_keys, group_idx...) are dropped."""
        events = [_positional(e) for e in batch.events]
        return _encode(_Batch(batch.ts, events, batch.data_parallel_rank))

    def hasher(
        self, algo: str, seed: str | None, block_size: int, lookahead_tokens: int = 0
    ) -> NotReproduced:
        return _NOT_REPRODUCED

    def stated_extras(
        self, prompt: Prompt, block_size: int, lookahead_tokens: int = 0
    ) -> list[None]:
        """These events state no extra keys (so they teach the token index nothing);
        these releases hash no lookahead."""
        return [None] * (len(prompt.tokens) // block_size)


ADAPTER = LegacyVllmAdapter()
