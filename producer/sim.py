"""A simulated vLLM engine: the KV cache bookkeeping without the model.

Demos, tests and load runs need engines that publish what vLLM would
publish and whose caches can be inspected in process, so that what kvindex
answers can be checked against what the engine really holds. The simulation
keeps vLLM's cache mechanics and drops everything else:

- GPU: a fixed pool of blocks. A request takes a reference on its longest
  cached prefix and allocates the rest from the free queue, evicting the
  least recently freed cached block (``BlockRemoved``) when it must. Blocks
  are published (``BlockStored``) as they fill, and go back to the free
  queue, still cached, when the request finishes (last block first, as
  vLLM frees them). Two requests computing the same block at once both
  publish it, so the index sees two copies.
- CPU: an LRU of chunks of ``blocks_per_chunk`` blocks aligned to the start
  of the prompt. A request's full chunks are offloaded as they are computed,
  through the :class:`~producer.tracker.Tracker`, so CPU events are
  self-describing (or placeholders when ``self_describing`` is off), in the
  shape of the vLLM release ``offload_events`` names (0.33 or 0.34).
- STORAGE (optional): an owned, write-through tier behind the CPU one.

Lookups follow vLLM: the GPU prefix first, then whole chunks from the first
one not fully on GPU (if they add a chunk's worth of blocks), CPU before
STORAGE, never the prompt's last token;
:attr:`SimEngine.hit_blocks` counts what each tier served. Generation is
instant: a step prefills admitted prompts whole (loaded blocks are cached
on GPU like computed ones) and decodes ``decode_tokens_per_step`` tokens of
every running request.

With ``adapter`` ``"sglang"`` the engine publishes what an SGLang engine would
(its wire and its page hashes, a page being a block) over the same GPU pool,
so a demo or a test fleet holds both engine types. It keeps no lower tiers
(SGLang's host and storage tiers are not simulated), and its eviction is the
pool's least recently freed block, where SGLang's radix cache evicts its least
recently used leaf: its ground truth is its own pool, which its events state.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from indexer.core.events import BlockRemoved, BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import BlockHasher, EngineAdapter, Prompt
from producer.tracker import (
    Event,
    GroupSpec,
    OffloadEvent,
    OffloadKey,
    RequestView,
    Tracker,
    check_offload_events,
)

#: The single KV-cache group of the simulated model and its attention kind.
GROUP_IDX = 0
KIND = "full_attention"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Sizes and hashing of one simulated engine.

    ``cpu_chunks`` 0 disables offloading, ``storage_chunks`` 0 the STORAGE
    tier. With ``hash_algo`` xxhash and no ``hash_seed`` the engine seeds
    its chain with random bytes, as vLLM does without PYTHONHASHSEED: its
    hashes cannot be reproduced outside the process. ``adapter``: the engine
    type whose wire and hashes it speaks (``"vllm"`` or ``"sglang"``).
    ``offload_events``: the vLLM release whose offload events it publishes
    (:data:`~producer.tracker.OFFLOAD_EVENTS`; their shapes differ in
    recurrent groups, which the simulated model has none of).
    """

    block_size: int = 16
    gpu_blocks: int = 1024
    blocks_per_chunk: int = 4
    cpu_chunks: int = 512
    storage_chunks: int = 0
    storage_ownership: str = "kvcr"
    self_describing: bool = True
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    max_running: int = 8
    decode_tokens_per_step: int = 16
    recent: int = 8
    adapter: str = "vllm"
    offload_events: str = "0.33"

    def __post_init__(self) -> None:
        if self.storage_chunks and not self.cpu_chunks:
            raise ValueError("the STORAGE tier sits behind the CPU tier: set cpu_chunks too")
        if self.adapter not in ("vllm", "sglang"):
            raise ValueError(f"simulated engines are vllm or sglang, not {self.adapter!r}")
        check_offload_events(self.offload_events)
        if self.adapter == "sglang" and (self.cpu_chunks or self.hash_seed is not None):
            raise ValueError("a simulated SGLang engine keeps no lower tiers and has no seed")

    def engine_adapter(self) -> EngineAdapter:
        return catalog.adapter(self.adapter)

    def hash_spec(self) -> BlockHasher:
        adapter = self.engine_adapter()
        hasher = adapter.hasher(self.hash_algo, self.hash_seed, self.block_size)
        if hasher.reproducible:
            return hasher
        return adapter.hasher(self.hash_algo, os.urandom(16).hex(), self.block_size)


@dataclass(slots=True)
class _Request:
    tokens: tuple[int, ...]  # prompt then output
    prompt_len: int
    view: RequestView  # hash chain of every full block of ``tokens``
    blocks: list[int]  # physical GPU blocks, one per block of ``tokens``
    computed: int  # tokens whose KV exists on GPU
    published: int  # leading blocks that are cached on GPU (hit or stored)
    offloaded: int = 0  # leading chunks handed to the offload tiers

    @property
    def chain(self) -> Sequence[int]:
        return self.view.block_hashes


class _GpuPool:
    """vLLM's block pool: physical blocks, the hash -> blocks map, the free queue.

    The free queue is an LRU: blocks return to its tail and are taken from
    its head, and a cached block taken from it is evicted.
    """

    def __init__(self, num_blocks: int, block_size: int, events: list[Event]) -> None:
        self.block_size = block_size
        self._events = events
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        #: hash -> the blocks holding it, oldest copy first (a dict keeps that order).
        self.cached: dict[int, dict[int, None]] = {}

    def cached_run(self, chain: Sequence[int]) -> list[int]:
        """A block for each leading cached hash of ``chain``: its oldest copy, as vLLM picks."""
        blocks = []
        for h in chain:
            copies = self.cached.get(h)
            if copies is None:
                break
            blocks.append(next(iter(copies)))
        return blocks

    def can_take(self, hits: Sequence[int], new_blocks: int) -> bool:
        """Whether referencing the ``hits`` blocks and allocating ``new_blocks`` fits now."""
        idle_hits = sum(1 for block in hits if self._refs[block] == 0)
        return len(self._free) - idle_hits >= new_blocks

    def take(self, hits: Sequence[int]) -> None:
        """Reference cached blocks; idle ones leave the free queue."""
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their hashes."""
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._refs[block] = 1
            blocks.append(block)
            h = self._hash_of[block]
            if h is not None:
                self._hash_of[block] = None
                copies = self.cached[h]
                del copies[block]
                if not copies:
                    del self.cached[h]
                self._events.append(BlockRemoved([h], "GPU", GROUP_IDX))
        return blocks

    def store(self, req: _Request, end: int) -> None:
        """Cache and publish the request's blocks ``[req.published, end)``."""
        start = req.published
        if end <= start:
            return
        hashes = list(req.chain[start:end])
        for block, h in zip(req.blocks[start:end], hashes, strict=True):
            self._hash_of[block] = h
            self.cached.setdefault(h, {})[block] = None
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=req.chain[start - 1] if start else None,
                token_ids=list(req.tokens[start * size : end * size]),
                block_size=size,
                medium="GPU",
                extra_keys=[None] * len(hashes),
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KIND,
            )
        )
        req.published = end

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; idle ones rejoin the queue, last block first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None


@dataclass(frozen=True, slots=True)
class _Tier:
    """One offload tier: an LRU of chunk keys and how its events are labelled."""

    medium: str
    ownership: str | None
    locality: str
    capacity: int
    chunks: OrderedDict[OffloadKey, None]

    def event(self, keys: Sequence[OffloadKey], removed: bool) -> OffloadEvent:
        return OffloadEvent(keys, self.medium, removed, self.locality, self.ownership)


class SimEngine:
    """One simulated engine rank: submit requests, call :meth:`step`, publish its batch.

    The ``*_prefix_blocks`` methods are the ground truth: how many leading
    blocks of a prompt this engine holds on each tier right now, GPU block
    by block, lower tiers in whole chunks.
    """

    def __init__(
        self,
        config: SimConfig = SimConfig(),
        dp_rank: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.hash_spec = config.hash_spec()
        self.requests_done = 0
        #: Prompt blocks looked up, and how many each tier served (``"GPU"``, ``"CPU"``, ...).
        self.prompt_blocks = 0
        self.hit_blocks: Counter[str] = Counter()
        #: Token sequences (prompt + output) of the last finished requests, newest last.
        self.recently_served: deque[tuple[int, ...]] = deque(maxlen=config.recent)
        self._clock = clock
        self._events: list[Event] = []
        self._gpu = _GpuPool(config.gpu_blocks, config.block_size, self._events)
        self._tiers = [
            _Tier(medium, ownership, locality, capacity, OrderedDict())
            for medium, ownership, locality, capacity in (
                ("CPU", None, "LOCAL", config.cpu_chunks),
                ("STORAGE", config.storage_ownership, "REMOTE", config.storage_chunks),
            )
            if capacity > 0
        ]
        group = GroupSpec(GROUP_IDX, KIND, None, config.block_size, config.blocks_per_chunk)
        self._tracker = Tracker(config.self_describing, [group], config.offload_events)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def submit(self, prompt: Sequence[int], output: Sequence[int] = ()) -> None:
        """Queue a request; it is admitted by a later :meth:`step` once blocks are free."""
        tokens = (*prompt, *output)
        blocks = math.ceil(len(tokens) / self.config.block_size)
        if not prompt or blocks > self.config.gpu_blocks:
            raise ValueError(
                f"a request of {len(prompt)} prompt tokens and {len(tokens)} in all does not "
                f"fit an engine of {self.config.gpu_blocks} blocks"
            )
        chain = self.chain(tokens)
        self._waiting.append(_Request(tokens, len(prompt), RequestView(chain, tokens), [], 0, 0))

    def step(self) -> EventBatch | None:
        """Admit, compute and offload one scheduler step; its events, if any, as one batch."""
        self._admit()
        raw: list[OffloadEvent] = []
        for req in self._running:
            self._compute(req)
        for req in self._running:
            self._offload(req, raw)
        self._finish()
        self._events.extend(self._tracker.take_events(raw))
        if not self._events:
            return None
        batch = EventBatch(self._clock(), list(self._events), self.dp_rank)
        self._events.clear()
        return batch

    def resident(self) -> dict[str, int]:
        """Distinct GPU block hashes, and chunks per offload tier."""
        counts = {"GPU": len(self._gpu.cached), "CPU": 0, "STORAGE": 0}
        counts.update((t.medium, len(t.chunks)) for t in self._tiers)
        return counts

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """The hashes this engine publishes for the full blocks of ``tokens``."""
        hasher = self.hash_spec
        return hasher.published(hasher.digests(Prompt(tuple(tokens))))

    def gpu_prefix_blocks(self, tokens: Sequence[int]) -> int:
        return len(self._gpu.cached_run(self.chain(tokens)))

    def cpu_prefix_blocks(self, tokens: Sequence[int]) -> int:
        return self._tier_prefix_blocks("CPU", tokens)

    def storage_prefix_blocks(self, tokens: Sequence[int]) -> int:
        return self._tier_prefix_blocks("STORAGE", tokens)

    def _tier_prefix_blocks(self, medium: str, tokens: Sequence[int]) -> int:
        tier = next((t for t in self._tiers if t.medium == medium), None)
        if tier is None:
            return 0
        chain = self.chain(tokens)
        per_chunk = self.config.blocks_per_chunk
        chunks = 0
        while (chunks + 1) * per_chunk <= len(chain) and self._key(chain, chunks) in tier.chunks:
            chunks += 1
        return chunks * per_chunk

    def _key(self, chain: Sequence[int], chunk: int) -> OffloadKey:
        return OffloadKey(GROUP_IDX, chain[(chunk + 1) * self.config.blocks_per_chunk - 1])

    def _admit(self) -> None:
        """Start waiting requests in order while they fit, taking their cache hits."""
        size = self.config.block_size
        while self._waiting and len(self._running) < self.config.max_running:
            req = self._waiting[0]
            limit = (req.prompt_len - 1) // size  # vLLM always computes the last token
            hits = self._gpu.cached_run(req.chain[:limit])
            total = math.ceil(len(req.tokens) / size)
            if not self._gpu.can_take(hits, total - len(hits)):
                return
            self._waiting.popleft()
            self._gpu.take(hits)
            req.blocks = hits + self._gpu.allocate(total - len(hits))
            req.published = len(hits)
            self.prompt_blocks += req.prompt_len // size
            self.hit_blocks["GPU"] += len(hits)
            self._lower_tier_hits(req, len(hits), limit)
            self._running.append(req)

    def _lower_tier_hits(self, req: _Request, gpu_hit: int, limit: int) -> None:
        """Count the whole chunks the offload tiers serve after the GPU hit: none when
        they add fewer blocks than a chunk holds (vLLM then loads nothing).

        The offload pass of this same step refreshes them in their LRUs.
        """
        per_chunk = self.config.blocks_per_chunk
        chunk, loaded_from = gpu_hit // per_chunk, gpu_hit
        served: Counter[str] = Counter()
        while (chunk + 1) * per_chunk <= limit:
            key = self._key(req.chain, chunk)
            tier = next((t for t in self._tiers if key in t.chunks), None)
            if tier is None:
                break
            if tier.medium == "CPU":
                # A no-op while every CPU chunk was stored through the tracker,
                # but how an engine keeps a hit chunk's payload alive.
                self._tracker.record_lookup(req.view, chunk, key)
            chunk += 1
            served[tier.medium] += chunk * per_chunk - loaded_from
            loaded_from = chunk * per_chunk
        if loaded_from - gpu_hit >= per_chunk:
            self.hit_blocks.update(served)

    def _compute(self, req: _Request) -> None:
        """Prefill the rest of the prompt, or decode; publish the blocks that filled."""
        if req.computed < req.prompt_len:
            req.computed = req.prompt_len
        else:
            req.computed = min(len(req.tokens), req.computed + self.config.decode_tokens_per_step)
        self._gpu.store(req, req.computed // self.config.block_size)

    def _offload(self, req: _Request, raw: list[OffloadEvent]) -> None:
        """Hand the request's newly full chunks to every tier that lacks them."""
        if not self._tiers:
            return
        full = req.published // self.config.blocks_per_chunk
        for chunk in range(req.offloaded, full):
            key = self._key(req.chain, chunk)
            missing = []
            for tier in self._tiers:
                if key in tier.chunks:
                    tier.chunks.move_to_end(key)
                else:
                    missing.append(tier)
            if missing:
                self._tracker.record_store(req.view, chunk, key)
            for tier in missing:
                if len(tier.chunks) >= tier.capacity:
                    evicted, _ = tier.chunks.popitem(last=False)
                    raw.append(tier.event([evicted], removed=True))
                tier.chunks[key] = None
                raw.append(tier.event([key], removed=False))
        req.offloaded = full

    def _finish(self) -> None:
        running = []
        for req in self._running:
            if req.computed < len(req.tokens):
                running.append(req)
                continue
            self._gpu.free(req.blocks)
            self.requests_done += 1
            self.recently_served.append(req.tokens)
        self._running = running
