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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from indexer import metrics
from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.engines.base import Prompt
from indexer.registry import EngineSpec, Registry, UnknownEngine

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


def excludes(reasons: dict[str, str]) -> bool:
    """Whether these contradictions make the engine's computed hashes wrong."""
    return not _EXCLUDING.isdisjoint(reasons)


class _Check:
    """The checks of one registration (a spec object: re-registering starts anew)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.seen = 0
        self.reasons: dict[str, str] = {}  # by kind: the first contradiction found
        algo = spec.hash_algo
        hasher = None
        if algo:
            adapter = spec.engine_adapter
            hasher = adapter.hasher(algo, spec.hash_seed, spec.block_size, spec.lookahead_tokens)
        self.hasher = hasher if hasher is not None and hasher.reproducible else None


class Misdeclared:
    """Engines' declared block size, KV groups and hashing against their events.

    ``on_flag(spec, reasons)`` hears each new contradiction (an indexer worker
    publishes them for the API replicas).
    """

    def __init__(
        self,
        registry: Registry,
        checked_stores: int = 32,
        on_flag: Callable[[EngineSpec, dict[str, str]], None] | None = None,
    ) -> None:
        self._registry = registry
        self._on_flag = on_flag
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
        if self._on_flag is not None:
            self._on_flag(check.spec, dict(check.reasons))


def _contradictions(check: _Check, event: BlockStored) -> list[tuple[str, str]]:
    spec, found = check.spec, []
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
    size = (group.block_size if group is not None else None) or spec.block_size
    shown = event.block_size or _tokens_per_block(event)
    if shown and shown != size:
        found.append(("block_size", f"block_size: declared {size}, events show {shown}"))
    elif lookahead := _lookahead_contradiction(spec.lookahead_tokens, event):
        found.append(("lookahead_tokens", lookahead))
    elif check.hasher is not None and not _hash_agrees(check, event, size):
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
    published = digests if type(event.block_hashes[0]) is bytes else check.hasher.published(digests)
    return list(published) == list(event.block_hashes)
