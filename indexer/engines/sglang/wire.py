"""SGLang's KV event batches, decoded into :mod:`indexer.core.events` and back.

SGLang 0.5.23 tags its events as msgpack maps like vLLM (``"type"``:
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) in a batch
``[ts, events, attn_dp_rank]``, but its fields are its own:

- hashes are signed int64 (the first 8 bytes of a SHA-256 digest, two's
  complement); kvindex keys every hash as its unsigned 64-bit value, the same
  bits, so a router's hash and an event's agree whichever form it sends;
- ``BlockStored`` ends at ``lora_id, medium, cache_salt, session_id,
  lora_name``: no extra keys, KV groups, locality or ownership. The request's
  namespace (``cache_salt``, ``lora_name``) covers every page of the event, and
  is stated here as each block's extra keys, so the learned token index keys
  namespaced blocks apart (:func:`stated_extras` says them for a prompt);
- media are ``GPU``, ``CPU_PINNED`` (host memory), ``DISK`` and ``EXTERNAL``
  (a shared remote pool): kvindex's GPU, CPU, STORAGE and STORAGE;
- with speculative decoding (EAGLE) the radix tree keys bigrams, and
  ``token_ids`` lists ``[t_j, t_j+1]`` pairs: a page's tokens then are the
  pairs' firsts, and its hash covers the token after it, as vLLM's lookahead
  hashing with one token (``lookahead_token_ids``).

A store's ``block_size`` is the page size: SGLang hashes and announces every
page, so a page is kvindex's block.
"""

from __future__ import annotations

from typing import Any

import msgspec

from indexer.core.events import (
    CPU,
    GPU,
    STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    WireError,
)
from indexer.engines.base import check_batch

_U64 = (1 << 64) - 1
_I64_TOP = 1 << 63
#: SGLang's media by kvindex's tiers; writing back, a tier's first name.
MEDIA = {"GPU": GPU, "CPU_PINNED": CPU, "DISK": STORAGE, "EXTERNAL": STORAGE}
_NAMES = {GPU: "GPU", CPU: "CPU_PINNED", STORAGE: "DISK"}
_OPTIONS = {"tag_field": "type", "gc": False, "omit_defaults": True}
Token = int | tuple[int, int]


class _Stored(msgspec.Struct, tag="BlockStored", **_OPTIONS):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Token]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", **_OPTIONS):
    block_hashes: list[int]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", **_OPTIONS):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    attn_dp_rank: int | None = None


_decode = msgspec.msgpack.Decoder(_Batch).decode
_encode = msgspec.msgpack.Encoder().encode


def unsigned(block_hash: int) -> int:
    """SGLang's signed int64 hash as the unsigned 64-bit value of the same bits."""
    if not -_I64_TOP <= block_hash < _I64_TOP:
        raise WireError("bad_hash", str(block_hash))
    return block_hash & _U64


def signed(block_hash: int) -> int:
    """kvindex's unsigned hash as SGLang publishes it."""
    return block_hash - (1 << 64) if block_hash >= _I64_TOP else block_hash


def namespace(lora_name: str | None, cache_salt: str | None) -> list[str] | None:
    """What a block's extra keys state of its request's namespace (None: no namespace)."""
    keys = [key for key in (lora_name, cache_salt) if key is not None]
    return keys or None


def _medium(name: str | None) -> str | None:
    if name is None:
        return None
    tier = MEDIA.get(name)
    if tier is None:
        raise WireError("unknown_medium", repr(name))
    return tier


def _tokens(stored: _Stored) -> tuple[list[int], list[list[int]] | None]:
    """A store's tokens, and for bigram pages the token after each page."""
    ids = stored.token_ids
    if not ids or type(ids[0]) is int:
        if any(type(t) is not int for t in ids):
            raise WireError("bad_event", "token_ids mix tokens and bigrams")
        return ids, None  # type: ignore[return-value]
    if any(type(t) is int for t in ids):
        raise WireError("bad_event", "token_ids mix tokens and bigrams")
    size = stored.block_size
    if size <= 0 or len(ids) != size * len(stored.block_hashes):
        raise WireError("bad_event", "bigram pages that are not whole")
    firsts = [pair[0] for pair in ids]
    after = [[ids[end - 1][1]] for end in range(size, len(ids) + 1, size)]
    return firsts, after


def _neutral(event: _Stored | _Removed | _Cleared) -> Event:
    if type(event) is _Removed:
        return BlockRemoved(list(map(unsigned, event.block_hashes)), _medium(event.medium))
    if type(event) is _Cleared:
        return AllBlocksCleared()
    tokens, after = _tokens(event)
    parent = event.parent_block_hash
    keys = namespace(event.lora_name, event.cache_salt)
    return BlockStored(
        list(map(unsigned, event.block_hashes)),
        None if parent is None else unsigned(parent),
        tokens,
        event.block_size,
        event.lora_id,
        _medium(event.medium),
        lora_name=event.lora_name,
        extra_keys=[keys] * len(event.block_hashes),
        session_id=event.session_id,
        lookahead_token_ids=after,
    )


def decode_batch(payload: bytes, *, tokens: bool = True) -> EventBatch:
    """One batch payload's events; ``tokens`` is ignored: SGLang's recorder already
    sends a run of alike pages as one event, so there is nothing to merge."""
    try:
        batch = _decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError("bad_payload", str(e)) from None
    events = [_neutral(e) for e in batch.events]
    return check_batch(EventBatch(batch.ts, events, batch.attn_dp_rank))


def batch_ts(payload: bytes) -> float:
    """A payload's batch ts (decoded in full: SGLang's batches are small)."""
    return decode_batch(payload).ts


def _salt(event: BlockStored) -> str | None:
    """The cache salt a store's extra keys state (after the LoRA name, if any)."""
    keys = event.extra_keys[0] if event.extra_keys else None
    return keys[-1] if keys and len(keys) > (event.lora_name is not None) else None


def _tokens_out(event: BlockStored) -> list[Any]:
    if not event.lookahead_token_ids:
        return list(event.token_ids)
    size, ids = event.block_size, event.token_ids
    nexts = [
        ids[i + 1] if (i + 1) % size else event.lookahead_token_ids[i // size][0]
        for i in range(len(ids))
    ]
    return [(t, n) for t, n in zip(ids, nexts, strict=True)]


def _sglang(event: Event) -> _Stored | _Removed | _Cleared:
    medium = None if event.medium is None else _NAMES[event.medium.upper()]
    if type(event) is BlockRemoved:
        return _Removed(list(map(signed, event.block_hashes)), medium)
    if type(event) is AllBlocksCleared:
        return _Cleared()
    parent = event.parent_block_hash
    return _Stored(
        list(map(signed, event.block_hashes)),
        None if parent is None else signed(parent),
        _tokens_out(event),
        event.block_size,
        event.lora_id,
        medium,
        _salt(event),
        event.session_id,
        event.lora_name,
    )


def encode_batch(batch: EventBatch) -> bytes:
    """A batch as SGLang publishes it (fields SGLang lacks, such as groups, dropped)."""
    events = [_sglang(e) for e in batch.events]
    return _encode(_Batch(batch.ts, events, batch.data_parallel_rank))
