"""Catching engines whose declared configuration their events contradict.

One wrong field fails silently: a wrong ``block_size`` makes every tokens
query hash blocks the engine never had, and an xxhash or sha256 engine running
with ``PYTHONHASHSEED`` but declared without ``hash_seed`` publishes hashes
kvindex cannot recompute, so tokens queries match nothing. The first events
tell: each ``BlockStored`` says its block size (and carries a block's worth of
token ids per hash), its KV cache group, and for the first blocks of a prompt
(no parent, no extra keys) the hash can be recomputed from the token ids with
the declared algorithm and seed and compared with the published one. An engine
hashing with lookahead says so too: its stores carry, per hash, the tokens
after the block that the hash covers (``lookahead_token_ids``), as many as the
engine's lookahead; an engine without lookahead sends none.

:class:`Misdeclared` is a subscriber observer. It reads token ids only while an
engine's registration is young (its first ``checked_stores`` stores), so the
cost ends after a few batches; a new registration (restart, update) is checked
again. A flagged engine is reported (``/engines/{name}`` ``misdeclared``, a
warning, ``kvindex_engine_misdeclared_total``) and left out of tokens matching:
an honest zero beats hashes computed from a configuration the engine does not
have.

An engine registered without a block size (``block_size`` null, as one registered
by its URL is) learns it here from its first GPU ``BlockStored``; until then
:meth:`Misdeclared.block_size` is None and tokens queries leave it out, and from
then on its hashes are checked at that size like a declared one's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from indexer import metrics
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engine_registry import EngineSpec, Registry, UnknownEngine
from indexer.engines.base import BlockHasher, Prompt

log = logging.getLogger("kvindex.misdeclared")

#: What disagrees, the label of the metric.
KINDS = ("block_size", "kv_groups", "hash", "lookahead_tokens")
#: The kinds that make the engine's computed hashes wrong.
_EXCLUDING = frozenset({"block_size", "hash", "lookahead_tokens"})


class MisdeclaredView(Protocol):
    """What the API reads of the checks: this process's, or the workers' in Redis."""

    def reasons(self, engine: str) -> list[str]:
        """Why the engine's events contradict its declaration (empty: they agree so far)."""

    def excluded(self, engine: str) -> bool:
        """Whether tokens queries must leave the engine out (its hashes cannot be trusted)."""

    def block_size(self, engine: str) -> int | None:
        """The engine's block size: declared, or learned from its events (None: not yet)."""


#: Hears what the checks found of a registration: its contradictions by kind, and its
#: block size (learned, for one registered without it; None: not yet).
Findings = Callable[[EngineSpec, dict[str, str], int | None], None]


def excludes(reasons: dict[str, str]) -> bool:
    """Whether these contradictions make the engine's computed hashes wrong."""
    return not _EXCLUDING.isdisjoint(reasons)


class _Check:
    """The checks of one registration (a spec object: re-registering starts anew)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.seen = 0
        self.reasons: dict[str, str] = {}  # by kind: the first contradiction found
        self.block_size: int | None = None
        self.hasher: BlockHasher | None = None
        if spec.block_size is not None:
            self.learn(spec.block_size)

    def learn(self, block_size: int) -> None:
        """Check the hashes at this block size from now on (the declared or learned one)."""
        self.block_size = block_size
        spec, algo = self.spec, self.spec.hash_algo
        hasher = None
        if algo:
            adapter = spec.engine_adapter
            hasher = adapter.hasher(algo, spec.hash_seed, block_size, spec.lookahead_tokens)
        self.hasher = hasher if hasher is not None and hasher.reproducible else None


class Misdeclared:
    """Engines' declared block size, KV groups and hashing against their events.

    ``on_change(spec, reasons, block_size)`` hears each new contradiction and each
    block size learned (an indexer worker publishes them for the API replicas).
    """

    def __init__(
        self,
        registry: Registry,
        checked_stores: int = 32,
        on_change: Findings | None = None,
    ) -> None:
        self._registry = registry
        self._on_change = on_change
        self._checked_stores = checked_stores
        self._checks: dict[str, _Check] = {}
        #: Engines ever flagged in a way that leaves them out; the others are not, which
        #: every tokens query asks of every engine (a set look-up, not a registry one).
        self._flagged: set[str] = set()

    def reasons(self, engine: str) -> list[str]:
        """Why the engine's events contradict its declaration (empty: they agree so far)."""
        check = self._current(engine)
        return list(check.reasons.values()) if check else []

    def excluded(self, engine: str) -> bool:
        """Whether tokens queries must leave the engine out (its hashes cannot be trusted)."""
        if engine not in self._flagged:
            return False
        check = self._current(engine)
        if check is not None and excludes(check.reasons):
            return True
        self._flagged.discard(engine)  # registered anew, or gone, since
        return False

    def block_size(self, engine: str) -> int | None:
        """The engine's block size: declared, or learned from its events (None: not yet)."""
        check = self._current(engine)
        return check.block_size if check else None

    def reads_tokens(self, engine: str) -> bool:
        """Whether batches of the engine must keep token ids: while it is being checked."""
        check = self._current(engine)
        return check is not None and check.seen < self._checked_stores

    def observe(self, rank: RankId, batch: EventBatch) -> None:
        check = self._current(rank.engine)
        if check is None or check.seen >= self._checked_stores:
            return
        for event in batch.events:
            if type(event) is BlockStored and event.medium in (None, "GPU") and event.block_hashes:
                check.seen += 1
                if check.block_size is None:
                    self._learn(check, event)
                for kind, reason in _contradictions(check, event):
                    self._flag(check, kind, reason)

    def _current(self, engine: str) -> _Check | None:
        try:
            spec = self._registry.get(engine)
        except UnknownEngine:
            self._checks.pop(engine, None)
            return None
        check = self._checks.get(engine)
        if check is None or check.spec is not spec:
            check = self._checks[engine] = _Check(spec)
        return check

    def _learn(self, check: _Check, event: BlockStored) -> None:
        """Take the block size an engine registered without one stores at."""
        shown = event.block_size or _tokens_per_block(event)
        if not shown:
            return
        check.learn(shown)
        log.info(
            "engine block size learned from its events",
            extra={"engine": check.spec.name, "block_size": shown},
        )
        self._tell(check)

    def _tell(self, check: _Check) -> None:
        if self._on_change is not None:
            self._on_change(check.spec, dict(check.reasons), check.block_size)

    def _flag(self, check: _Check, kind: str, reason: str) -> None:
        if kind in check.reasons:
            return
        check.reasons[kind] = reason
        if excludes(check.reasons):
            self._flagged.add(check.spec.name)
        metrics.MISDECLARED.labels(check.spec.name, kind).inc()
        log.warning(
            "engine misdeclared: its events contradict its declared config",
            extra={"engine": check.spec.name, "reason": reason},
        )
        self._tell(check)


def _contradictions(check: _Check, event: BlockStored) -> list[tuple[str, str]]:
    spec, found = check.spec, []
    if check.block_size is None:
        return found  # nothing to hold the event to before its block size is known
    groups = spec.kv_groups
    group = None
    if groups is not None and event.group_idx is not None:
        if event.group_idx >= len(groups):
            found.append(
                (
                    "kv_groups",
                    f"kv_groups: events show group_idx {event.group_idx},"
                    f" {len(groups)} group(s) declared",
                )
            )
        else:
            group = groups[event.group_idx]
            kind = event.kv_cache_spec_kind
            if kind is not None and kind != group.kind:
                found.append(
                    (
                        "kv_groups",
                        f"kv_groups[{event.group_idx}]: declared kind {group.kind!r},"
                        f" events show {kind!r}",
                    )
                )
    size = (group.block_size if group is not None else None) or check.block_size
    shown = event.block_size or _tokens_per_block(event)
    if shown and shown not in (size, check.block_size if group is not None else size):
        how = "declared" if spec.block_size else "learned from its first events"
        found.append(("block_size", f"block_size: {how} {size}, events show {shown}"))
    elif lookahead := _lookahead_contradiction(spec.lookahead_tokens, event):
        found.append(("lookahead_tokens", lookahead))
    elif check.hasher is not None and shown == size and not _hash_agrees(check, event, size):
        found.append(
            (
                "hash",
                f"hash: block hashes recomputed from the token ids with hash_algo"
                f" {spec.hash_algo!r} and {'the declared' if spec.hash_seed else 'no'}"
                " hash_seed differ from the published ones (a missing or wrong hash_seed,"
                " or another hash_algo)",
            )
        )
    return found


def _lookahead_contradiction(declared: int, event: BlockStored) -> str:
    """How the event's ``lookahead_token_ids`` contradict the declared lookahead ("": they
    do not): an engine hashing with L tokens of lookahead lists L tokens per hash."""
    lists = event.lookahead_token_ids
    if lists is None:
        if not declared:
            return ""
        return f"lookahead_tokens: declared {declared}, events carry no lookahead_token_ids"
    shown = sorted({len(ids) for ids in lists})
    if shown == [declared] or not shown:
        return ""
    return f"lookahead_tokens: declared {declared}, events show {', '.join(map(str, shown))}"


def _tokens_per_block(event: BlockStored) -> int:
    """Token ids per block of an event that does not state its block size (0: unknown)."""
    tokens, blocks = len(event.token_ids), len(event.block_hashes)
    return tokens // blocks if tokens and tokens % blocks == 0 else 0


def _hash_agrees(check: _Check, event: BlockStored, size: int) -> bool:
    """Whether a chain's first blocks hash as declared; True when it cannot be told
    (a block with a parent, extra keys or tokens other than whole blocks)."""
    extras = event.extra_keys
    if (
        event.parent_block_hash is not None
        or event.lora_name is not None
        or extras is None
        or any(e is not None for e in extras)
        or len(event.token_ids) != size * len(event.block_hashes)
    ):
        return True
    # The tokens the last block's hash covers past it: the others' lie in token_ids.
    after = event.lookahead_token_ids[-1] if event.lookahead_token_ids else []
    digests = check.hasher.digests(Prompt((*event.token_ids, *after)))
    units = size // check.block_size  # a block larger than the hash unit: its last hash
    digests = digests[units - 1 :: units]
    published = digests if type(event.block_hashes[0]) is bytes else check.hasher.published(digests)
    return list(published) == list(event.block_hashes)
