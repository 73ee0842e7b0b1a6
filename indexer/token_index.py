"""The learned token index: token ids to block hashes, taught by the events.

Some engines' hashes cannot be recomputed here: xxhash without
``PYTHONHASHSEED`` seeds every chain with per-process random bytes, an
engine may not declare its algorithm at all, and SGLang names a LoRA
adapter in its hashes by an internal id (only those stores are learned from
it). Their GPU ``BlockStored`` events still carry what defines each block —
the parent hash, the block's token ids and its extra keys — next to the hash
the engine computed.
Remembering ``(rank, parent, tokens, extra keys) -> hash`` lets a ``tokens``
query walk a prompt block by block, with no hash algorithm involved, and
stop at the first block no event described. An engine hashing with lookahead
defines a block by the tokens after it too (its events list them per hash):
they are part of its key, and a prompt's blocks they do not follow are not walked.

Only events that state every block's extra keys teach: a list with one entry
per block (``None`` for a block without extras), naming the LoRA adapter in
each block when the event has one. vLLM 0.33's GPU events do; its
self-describing CPU/STORAGE events do not: they carry ``extra_keys = None``
even for a request with a cache salt, a LoRA adapter or images (the adapter
shows only in ``lora_name``). Read as "no extras", such an event would let a
query without the salt match another tenant's blocks, so it teaches nothing;
an offloaded chunk stays reachable through the entries its blocks' GPU
events taught. (Releases whose events carry no extra keys at all teach
nothing either: their tokens queries match nothing, never the wrong tenant.)

Entries are kept per dp rank: each rank is its own process, with its own
random seed. The index is bounded by an LRU over entries (learning or
walking through an entry refreshes it) rather than tied to residency: an
entry outlives its GPU copy, so a chunk offloaded with a placeholder event
(no token ids) stays reachable by tokens while the index has room. Stale
entries are harmless — they map to hashes no tier holds any more, or that an
engine restart kept on STORAGE — and age out. Keys are 16-byte BLAKE2b
digests so that an entry costs about 200 bytes whatever the block size.

Extra keys are compared as an unordered set of untagged values (LoRA name,
cache salt, ``(mm identifier, offset)``, prompt-embeds digest), the form
events publish, so the order a connector lists them in does not matter.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from indexer.core.events import BlockHash, BlockRemoved, BlockStored, EventBatch, RankId
from indexer.engines import catalog
from indexer.engines.base import EngineAdapter, MMFeature, Prompt

_encode = msgspec.msgpack.Encoder().encode


def _normalised(values: Iterable[Any] | None) -> tuple[bytes, ...]:
    """Extra keys as an order-free, hashable value: their sorted encodings."""
    return tuple(sorted(_encode(v) for v in values)) if values else ()


class TokenIndex:
    """``(rank, parent hash, block tokens, extra keys) -> block hash``, LRU-bounded.

    ``learns(engine)`` says whose events to remember (engines whose hashes
    cannot be recomputed), ``learns_lora(engine)`` whose stores of a LoRA
    adapter's blocks (engines whose LoRA hashes cannot be); every engine still
    teaches whether it publishes hashes as ints or as bytes.
    """

    def __init__(
        self,
        capacity: int,
        learns: Callable[[str], bool] = lambda _: True,
        learns_lora: Callable[[str], bool] = lambda _: False,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self.learns, self.learns_lora = learns, learns_lora
        self._entries: OrderedDict[bytes, BlockHash] = OrderedDict()
        self._ranks: dict[str, set[int]] = {}
        self._bytes_hashes: dict[str, bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def reads_tokens(self, engine: str) -> bool:
        """Whether any of the engine's stores may teach (their token ids are wanted)."""
        return self.learns(engine) or self.learns_lora(engine)

    def observe(self, rank: RankId, batch: EventBatch) -> None:
        """Learn from one applied batch (a subscriber observer)."""
        learns = lora = None
        for event in batch.events:
            if type(event) is BlockRemoved or not event.block_hashes:
                continue  # only stores teach (clears carry no hashes)
            self._bytes_hashes[rank.engine] = type(event.block_hashes[0]) is bytes
            if learns is None:
                learns, lora = self.learns(rank.engine), self.learns_lora(rank.engine)
            if type(event) is not BlockStored:  # not decoded with its token ids
                continue
            if learns or (lora and event.lora_name is not None):
                self._learn(rank, event)

    def _learn(self, rank: RankId, event: BlockStored) -> None:
        size, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        if size <= 0 or len(tokens) != size * len(hashes):
            return  # a placeholder (chunk end only) or a malformed store: nothing to learn
        extras = _stated_extras(event)
        if extras is None:
            return  # whose blocks these are is unknown: see the module docstring
        ahead = event.lookahead_token_ids
        if ahead is not None and len(ahead) != len(hashes):
            return  # a malformed store
        parent = event.parent_block_hash
        entries = self._entries
        for i, (block_hash, extra) in enumerate(zip(hashes, extras, strict=True)):
            block = tokens[i * size : (i + 1) * size]
            key = _key(rank, parent, block, ahead[i] if ahead else (), _normalised(extra))
            entries[key] = block_hash
            entries.move_to_end(key)
            parent = block_hash
        self._ranks.setdefault(rank.engine, set()).add(rank.dp_rank)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def walk(
        self,
        rank: RankId,
        tokens: Sequence[int],
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MMFeature] = (),
        adapter: EngineAdapter | None = None,
        lookahead_tokens: int = 0,
    ) -> list[BlockHash]:
        """The hashes of the prompt's leading blocks this rank's events described.

        ``adapter`` (the engine's; the default one if None) says which extra keys
        the events stated for each block; ``lookahead_tokens``, the engine's, how
        many tokens after each block its key holds."""
        toks = tokens if type(tokens) is tuple else tuple(tokens)
        prompt = Prompt(toks, lora_name, None, cache_salt, mm_features)
        adapter = adapter or catalog.adapter(catalog.DEFAULT)
        extras = adapter.stated_extras(prompt, block_size, lookahead_tokens)
        chain: list[BlockHash] = []
        parent: BlockHash | None = None
        entries = self._entries
        starts = range(0, len(extras) * block_size, block_size)
        for start, extra in zip(starts, extras, strict=True):
            end = start + block_size
            ahead = toks[end : end + lookahead_tokens]
            key = _key(rank, parent, toks[start:end], ahead, _normalised(extra))
            parent = entries.get(key)
            if parent is None:
                break
            entries.move_to_end(key)
            chain.append(parent)
        return chain

    def ranks(self, engine: str) -> set[int]:
        """Dp ranks of an engine that taught the index something."""
        return set(self._ranks.get(engine, ()))

    def publishes_bytes(self, engine: str) -> bool:
        """Whether the engine's events carry raw digests (int form until seen)."""
        return self._bytes_hashes.get(engine, False)


def _stated_extras(event: BlockStored) -> list[list | None] | None:
    """Each block's extra keys if the event states them all, else None (unknown).

    ``None`` is not "no extras": vLLM's offload events leave the field out
    whatever the request mixed into its hashes. A LoRA adapter is in every
    block's extra keys, so an event naming one (or carrying only its id)
    whose blocks do not list the name is incomplete too.
    """
    extras, lora = event.extra_keys, event.lora_name
    if extras is None or len(extras) != len(event.block_hashes):
        return None
    if lora is None:
        return None if event.lora_id is not None else extras
    return extras if all(extra and lora in extra for extra in extras) else None


def _key(
    rank: RankId,
    parent: BlockHash | None,
    tokens: Sequence[int],
    ahead: Sequence[int],
    extras: tuple[bytes, ...],
) -> bytes:
    """A block's entry: ``ahead`` the tokens after it its hash covers (empty: none)."""
    material = _encode((rank.engine, rank.dp_rank, parent, tokens, ahead, extras))
    return hashlib.blake2b(material, digest_size=16).digest()
