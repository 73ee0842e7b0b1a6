"""Answering a prefix-match query: pick engines, look chains up, rank ranks.

A query costs one store round trip per distinct chain: all engines that
share a hash spec (the common case: every engine of a fleet) are looked up
together, and only engines matched through the learned token index need a
chain, and a lookup, per rank. Routed entries (:mod:`indexer.routed`) are
looked up after the store, from each rank's exact GPU run: one more call per
chain, which ``route: "best"`` turns into the atomic pick-and-record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec

from answers import EngineMatch, PrefixMatchResponse, RankRef, RouteCost
from indexer.core.events import BlockHash, RankId
from indexer.core.large_blocks import LargeBlocks
from indexer.core.matching import PrefixMatch, TierWeights
from indexer.core.routed import Candidate
from indexer.engine_registry import (
    ConsumerView,
    EngineSpec,
    RankStatus,
    Registry,
    UnknownEngine,
    is_degraded,
)
from indexer.engines.base import BlockHasher
from indexer.misdeclared import MisdeclaredView
from indexer.query.chains import ChainComputer, Overrides, Prompt, Query
from indexer.query.errors import QueryRefused
from indexer.query.rows import ENGINES, ZeroRows, degraded_flags, entries, rank_order
from indexer.routed import RoutedEntries
from indexer.stores.base import Store, match_chain
from indexer.token_index import TokenIndex

_name = attrgetter("name")
_score = attrgetter("score")
#: Hashing overrides the engines' hashers are kept for: past it, all go.
_OVERRIDES = 256


#: An engine's hasher under a query's overrides, with the spec and block size it is of.
_Hasher = tuple[EngineSpec, int, BlockHasher | None]


#: What a pick answers: the rank (None: no candidate), the candidates' routed_blocks
#: (the pick's after its record), and the costs weighed, the pick's first.
Picked = tuple[Candidate | None, dict[RankId, int], list[RouteCost]]


#: What picks the rank of ``route: "best"`` and records the prompt there: given the
#: chain, the candidates (spec, dp rank, degraded) in the order ties go by, what the
#: store found, the weights and the entries' TTL.
Picker = Callable[
    [list[BlockHash], Sequence[tuple[EngineSpec, int, bool]], dict[RankId, PrefixMatch],
     TierWeights, float],
    Awaitable[Picked],
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Lookup:
    """One chain looked up for some engines: each by its blocks per chunk, or by its
    shape where its blocks span several hash blocks (``shapes``)."""

    chain: list[BlockHash]
    chunk_blocks: dict[str, int | None]
    rank: RankId | None = None  # keep only this rank's answer: its chain is its own
    shapes: dict[str, LargeBlocks] = field(default_factory=dict)

    def add(self, spec: EngineSpec) -> _Lookup:
        shape = spec.large_blocks
        if shape is None:
            self.chunk_blocks[spec.name] = spec.blocks_per_chunk
        else:
            self.shapes[spec.name] = shape
        return self

    @property
    def engines(self) -> set[str]:
        """The engines whose answers the lookup gives."""
        return self.chunk_blocks.keys() | self.shapes.keys()


class ReadPath:
    """Answers prefix-match queries from its parts: the store's residency, the registry
    and the consumers' statuses, the learned token index, the routed entries and the
    picker of ``route: "best"``. Given its parts, not an app, so every process wires
    its own (an API replica over Redis, ``kvindex serve``, a benchmark)."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        consumers: ConsumerView,
        token_index: TokenIndex,
        routed: RoutedEntries,
        picker: Picker,
        weights: TierWeights,
        misdeclared: MisdeclaredView | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._misdeclared = misdeclared
        self._consumers = consumers
        self._token_index = token_index
        self._weights = weights
        self._routed = routed
        self._pick = picker
        self._zero_rows = ZeroRows()
        self._hashers: dict[Overrides, dict[str, _Hasher]] = {}

    async def match(self, query: Query) -> PrefixMatchResponse:
        specs = self._select(query.model, query.engines)
        if query.prompt is None:
            assert query.chain is not None
            lookup = _Lookup(query.chain, {})
            for spec in specs:
                if self.block_size(spec, query.overrides.block_size) is not None:
                    lookup.add(spec)
            lookups = [lookup]
        else:
            lookups = self._token_lookups(query, specs)
        # Statuses before the store call: an engine removed meanwhile has none after.
        statuses = {s.name: self._consumers.rank_status(s.name) for s in specs}
        loss = self._store.last_loss()
        found = await self._run(lookups)
        if self._store.last_loss() is not loss:
            statuses = self._flagged_since(statuses)
        weights = query.weights or self._weights
        flags = {s.name: degraded_flags(s, statuses[s.name]) for s in specs}
        pick, costs = None, None
        if query.route:
            pick, routed, costs = await self._route(query, lookups, specs, flags, found, weights)
        else:
            routed = await self._routed_runs(lookups, found)
        answer = self._answer(query, specs, statuses, flags, found, routed, weights)
        if pick is not None:
            answer.routed_to = RankRef(pick.engine, pick.dp_rank)
            answer.route_costs = costs
        return answer

    def _flagged_since(self, before: dict[str, list[RankStatus]]) -> dict[str, list[RankStatus]]:
        """The statuses once more, after a store call during which the store noticed a
        loss: the call may have read what was lost, which the ranks are flagged for
        now. A rank flagged before the call stays so (it may have been rebuilt
        since, after the read)."""
        statuses = {}
        for name, earlier in before.items():
            try:
                now = self._consumers.rank_status(name)
            except UnknownEngine:
                now = earlier
            statuses[name] = [
                old if is_degraded(old) else new for old, new in zip(earlier, now, strict=False)
            ]
        return statuses

    def chain_of(self, query: Query, spec: EngineSpec) -> list[BlockHash]:
        """The chain a query stands for on one engine (``POST /routed``); 422 when only
        the learned token index could say, as it says nothing of blocks not yet stored."""
        if query.prompt is None:
            assert query.chain is not None
            return query.chain
        lookups = self._token_lookups(query, [spec])
        if not lookups:
            raise QueryRefused(
                f"engine {spec.name!r}: tokens are not hashed for it now (its block size is"
                " not known yet, or its events contradict its declaration): see"
                f" /engines/{spec.name}",
            )
        if any(lookup.rank is not None for lookup in lookups):
            raise QueryRefused(
                f"engine {spec.name!r}: its block hashes cannot be computed from these tokens"
                " (no reproducible hash_algo and hash_seed, or a LoRA adapter its hashes name"
                " by an id its events do not state): give block_hashes",
            )
        return lookups[0].chain

    async def _routed_runs(
        self, lookups: list[_Lookup], found: dict[RankId, PrefixMatch]
    ) -> dict[RankId, int]:
        """``routed_blocks`` of the ranks whose routed entries extend their GPU run."""
        runs: dict[RankId, int] = {}
        starts = {rank: m.gpu_blocks for rank, m in found.items() if m.gpu_blocks}
        for lookup in lookups:
            if not lookup.chain or not lookup.engines:
                continue
            got = await self._routed.lookup(lookup.chain, starts, lookup.engines)
            if lookup.rank is None:
                runs.update(got)
            elif lookup.rank in got:
                runs[lookup.rank] = got[lookup.rank]
        return runs

    async def _route(
        self,
        query: Query,
        lookups: list[_Lookup],
        specs: list[EngineSpec],
        flags: dict[str, tuple[bool, ...]],
        found: dict[RankId, PrefixMatch],
        weights: TierWeights,
    ) -> Picked:
        """Every rank of the selected engines is a candidate, in (engine, rank) order,
        with whether its view is degraded."""
        chains = [lookup for lookup in lookups if lookup.chain and lookup.engines]
        if not chains:
            return None, {}, []
        if len(chains) > 1 or chains[0].rank is not None:
            raise QueryRefused(
                'route: "best" needs one block-hash chain for every selected engine (engines'
                " that hash alike, reproducibly): narrow `engines` or `model`",
            )
        (lookup,) = chains
        ranks = [
            (spec, dp_rank, degraded)
            for spec in sorted(specs, key=_name)
            if spec.name in lookup.engines
            for dp_rank, degraded in enumerate(flags[spec.name])
        ]
        return await self._pick(lookup.chain, ranks, found, weights, query.ttl)

    def _select(self, model: str | None, names: Sequence[str] | None) -> list[EngineSpec]:
        if names is None:
            specs = self._registry.all()
        else:
            try:
                specs = [self._registry.get(name) for name in dict.fromkeys(names)]
            except UnknownEngine as e:
                raise QueryRefused(f"unknown engine {e.args[0]!r}", unknown=True) from None
        if model is None:
            return specs
        serving = [s for s in specs if s.model == model]
        # A model no engine serves is a typo or a stale router config, like an unknown engine;
        # a known model that the named engines do not serve is an empty answer.
        if not serving and all(s.model != model for s in self._registry.all()):
            raise QueryRefused(
                f"unknown model {model!r}: no registered engine serves it", unknown=True
            )
        return serving

    def block_size(self, spec: EngineSpec, override: int | None) -> int | None:
        """The block size a query counts the engine's blocks in: the query's, the declared
        one, or the one learned from its events; None until that is known (an engine
        registered by its URL before its first store), which leaves it out: zeros."""
        if override or spec.block_size or self._misdeclared is None:
            return override or spec.block_size
        return self._misdeclared.block_size(spec.name)

    def selected(self, model: str | None, engines: Sequence[str] | None) -> list[EngineSpec]:
        """The engines a query with this model and engines is about."""
        return self._select(model, engines)

    def _token_lookups(self, query: Query, specs: list[EngineSpec]) -> list[_Lookup]:
        overrides = query.overrides
        computers: dict[int, ChainComputer] = {}  # by id of the prompt: one per rendering
        shared: dict[tuple, _Lookup] = {}
        lookups: list[_Lookup] = []
        hashers = self._hashers_of(overrides)
        for spec in specs:
            prompt = query.prompt_for(spec)
            assert prompt is not None
            if self._misdeclared is not None and self._misdeclared.excluded(spec.name):
                continue  # its events contradict its block size or hashing: it answers zeros
            size = self.block_size(spec, overrides.block_size)
            if size is None:
                continue  # its block size is not known yet: it answers zeros
            kept = hashers.get(spec.name)
            if kept is None or kept[0] is not spec or kept[1] != size:
                kept = hashers[spec.name] = (spec, size, overrides.hashing_of(spec, size))
            hashing = kept[2]
            if hashing is None or (prompt.lora_name and spec.engine_adapter.lora_learned):
                lookups.extend(self._learned_lookups(prompt, size, spec))
                continue
            as_bytes = self._token_index.publishes_bytes(spec.name)
            key = (id(prompt), hashing, as_bytes)
            lookup = shared.get(key)
            if lookup is None:
                computer = computers.setdefault(id(prompt), ChainComputer(prompt))
                lookup = shared[key] = _Lookup(computer.chain(hashing, as_bytes), {})
            lookup.add(spec)
        return [*shared.values(), *lookups]

    def _hashers_of(self, overrides: Overrides) -> dict[str, _Hasher]:
        """Each engine's hasher under ``overrides``, by name, with the spec and size it is of:
        asking the adapter for it anew was a third of a query's cost per engine."""
        hashers = self._hashers.get(overrides)
        if hashers is None or len(hashers) > ENGINES:
            if len(self._hashers) > _OVERRIDES:
                self._hashers.clear()
            hashers = self._hashers[overrides] = {}
        return hashers

    def _learned_lookups(self, prompt: Prompt, block_size: int, spec: EngineSpec) -> list[_Lookup]:
        index = self._token_index
        lookups = []
        for dp_rank in sorted(set(range(spec.dp_ranks)) | index.ranks(spec.name)):
            rank = RankId(spec.name, dp_rank)
            chain = index.walk(
                rank,
                prompt.tokens,
                block_size,
                lora_name=prompt.lora_name,
                cache_salt=prompt.cache_salt,
                mm_features=prompt.mm_features,
                adapter=spec.engine_adapter,
                lookahead_tokens=spec.lookahead_tokens,
            )
            lookups.append(_Lookup(chain, {}, rank).add(spec))
        return lookups

    async def _run(self, lookups: list[_Lookup]) -> dict[RankId, PrefixMatch]:
        called = [lookup for lookup in lookups if lookup.chain and lookup.engines]
        calls = [
            match_chain(self._store, lookup.chain, lookup.chunk_blocks, lookup.shapes)
            for lookup in called
        ]
        # One lookup (a fleet hashing alike) is awaited in place: gather would make it a
        # task, a trip through the event loop that cost as much as an embedded match.
        answers = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        found: dict[RankId, PrefixMatch] = {}
        for lookup, answer in zip(called, answers, strict=True):
            if lookup.rank is None:
                found.update(answer)
            elif lookup.rank in answer:
                found[lookup.rank] = answer[lookup.rank]
        return found

    def _answer(
        self,
        query: Query,
        specs: list[EngineSpec],
        statuses: dict[str, list[RankStatus]],
        degraded: dict[str, tuple[bool, ...]],
        found: dict[RankId, PrefixMatch],
        routed: dict[RankId, int],
        weights: TierWeights,
    ) -> PrefixMatchResponse:
        """One entry per rank, best score first, then by engine and rank.

        Runs per query for every rank of the fleet, most of which match
        nothing: an engine none of whose ranks the store or the routed entries
        answered takes its rows pre-encoded (:class:`ZeroRows`); the others'
        rows are built. Rows are made in (engine, rank) order, so the scored
        ones, stably sorted by score, then every row scoring 0 in that order,
        are the order of one stable sort by score.
        """
        answered: dict[str, set[int]] = {}  # the ranks of each engine the store or routed answer
        for engine, dp_rank in (*found, *routed):
            answered.setdefault(engine, set()).add(dp_rank)
        rows: list[EngineMatch | msgspec.Raw] = []  # scoring 0, in (engine, rank) order
        scored: list[EngineMatch] = []
        override, zero_rows = query.overrides.block_size, self._zero_rows
        sizes: set[int | None] = set()
        for spec in sorted(specs, key=_name):
            known = self.block_size(spec, override)
            sizes.add(known)
            block_size, status = known or 0, statuses[spec.name]  # 0: not known yet
            flags = degraded[spec.name]
            zeros = zero_rows.of(spec, block_size, flags)
            ranks = answered.get(spec.name)
            if ranks is None:
                rows.extend(zeros)
                continue
            built = entries(spec, block_size, status, flags, ranks, found, routed, weights)
            for dp_rank in rank_order(spec, ranks):
                entry = built.get(dp_rank)
                if entry is None:
                    rows.append(zeros[dp_rank])
                elif entry.score > 0:
                    scored.append(entry)
                else:
                    rows.append(entry)
        scored.sort(key=_score, reverse=True)  # stable: ties keep (engine, rank) order
        sizes.discard(None)  # an engine not matched for want of its block size
        block_size = override or (next(iter(sizes)) if len(sizes) == 1 else None)
        engines: list[Any] = [*scored, *rows]  # msgspec.Raw rows encode as they are
        return PrefixMatchResponse(block_size, _num_blocks(query, block_size), engines)


def _num_blocks(query: Query, block_size: int | None) -> int | None:
    if query.chain is not None:
        return len(query.chain)
    if block_size is None or query.prompt is None:
        return None
    return len(query.prompt.tokens) // block_size
