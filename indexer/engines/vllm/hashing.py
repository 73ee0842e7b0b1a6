"""vLLM 0.33.0 prefix-cache block hashing, reproduced bit for bit.

Routers may send token ids instead of block hashes. To look those up in an
index keyed by what engines publish, kvindex must compute exactly the hashes
the engine computed: the same serialisation (pickle protocol 5 or canonical
CBOR), the same digest, the same chain seed (``NONE_HASH``) and the same
per-block extra keys. The golden vectors in
``shared/fixtures/vllm-0.33.0/hash_vectors.json`` pin all of it, and those of
``tests/fixtures/lookahead_hash_vectors.json`` the lookahead below.

Each full block ``i`` hashes ``(parent, tokens_i, extra_keys_i)`` where
``parent`` is block ``i-1``'s digest, or ``NONE_HASH`` for the first block.
Partial trailing blocks are never hashed because vLLM never caches them.

With lookahead hashing (``lookahead_tokens`` L > 0: EAGLE-style drafting that drops
blocks, prefix caching on and no KV connector, or in 0.34 one that supports it) the
drafter's KV at a block's last position depends on the L tokens after the
block, so its hash covers them: its extra keys become ``(E, *next L tokens)``,
``E`` the usual keys taken over the block and those L tokens (or None). A block
is hashed only once those tokens exist: a prompt's last full blocks whose L
following tokens it lacks have no hash yet.

The xxhash variants are only reproducible when the engine ran with
``PYTHONHASHSEED``: otherwise vLLM seeds the chain with per-process random
bytes. Such a spec can still be described (``reproducible`` is False) so
callers can fall back to matching by tokens, but hashing with it raises
:class:`NotReproducible` rather than producing hashes no engine publishes.

``xxhash`` and ``cbor2`` are imported only when a spec needs them: the
``producer`` package imports this module and must run with the stdlib alone
for the default ``sha256``.
"""

from __future__ import annotations

import hashlib
import pickle
import pickletools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import getitem
from typing import Any

from indexer.engines.base import MMFeature
from indexer.engines.vllm import native

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

#: The chain seed vLLM uses for the cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_PICKLE_PROTOCOL = 5

HashFn = Callable[[Any], bytes]
#: Each full block's extra keys (None for none), or None when no block has any.
BlockExtras = list[tuple[Any, ...] | None] | None


class UnknownHashAlgo(ValueError):
    """An algorithm name vLLM 0.33 would not accept for ``--prefix-caching-hash-algo``."""

    def __init__(self, algo: str) -> None:
        super().__init__(
            f"unknown prefix-caching hash algorithm {algo!r}; expected one of {HASH_ALGOS}"
        )


class NotReproducible(ValueError):
    """The engine's hashes depend on a random per-process seed kvindex cannot know."""


# Factories rather than functions: each binds its serialiser and digest once per
# spec, so the per-block call does no attribute lookups and no import statement.
def _sha256_pickle() -> HashFn:
    sha256, dumps = hashlib.sha256, pickle.dumps
    return lambda obj: sha256(dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor() -> HashFn:
    import cbor2

    sha256, dumps = hashlib.sha256, cbor2.dumps
    return lambda obj: sha256(dumps(obj, canonical=True)).digest()


def _xxhash_pickle() -> HashFn:
    import xxhash

    xxh3_128, dumps = xxhash.xxh3_128_digest, pickle.dumps
    return lambda obj: xxh3_128(dumps(obj, protocol=_PICKLE_PROTOCOL))


def _xxhash_cbor() -> HashFn:
    import cbor2
    import xxhash

    xxh3_128, dumps = xxhash.xxh3_128_digest, cbor2.dumps
    return lambda obj: xxh3_128(dumps(obj, canonical=True))


_HASH_FNS: dict[str, Callable[[], HashFn]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}
_RANDOM_SEED_WITHOUT_ENV = frozenset({"xxhash", "xxhash_cbor"})

# A block pickles (parent, tokens, extra) with one memo: the parent digest and
# the token tuple take its slots 0 and 1 before anything in ``extra``.
_MEMO_SLOTS_BEFORE_EXTRAS = 2


def _pickle_fragment(extra: Any) -> bytes:
    """``extra``'s opcodes as they appear inside its block's pickle.

    They are those of pickling it alone without the header (PROTO, FRAME) and
    STOP, except that a reference to an object it repeats (a memo get, as for
    the ``"mm"`` of a block's second multimodal item) points past the two slots
    taken before it. Protocol 5 memoizes without naming slots, so nothing else moves.
    """
    raw = pickle.dumps(extra, protocol=_PICKLE_PROTOCOL)
    ops = list(pickletools.genops(raw))
    ends = [pos for _, _, pos in ops[1:]] + [len(raw)]
    out = bytearray()
    for (op, arg, pos), end in zip(ops, ends, strict=True):
        if op.name in ("BINGET", "LONG_BINGET"):
            out += _memo_get(arg + _MEMO_SLOTS_BEFORE_EXTRAS)
        elif op.name not in ("PROTO", "FRAME", "STOP"):
            out += raw[pos:end]
    return bytes(out)


def _memo_get(slot: int) -> bytes:
    """The pickler's memo get: one byte of slot number while it fits, else four."""
    if slot < 256:
        return pickle.BINGET + bytes((slot,))
    return pickle.LONG_BINGET + slot.to_bytes(4, "little")


def _cbor_fragment(extra: Any) -> bytes:
    """CBOR shares nothing between items: ``extra`` encodes the same inside its block."""
    import cbor2

    return cbor2.dumps(extra, canonical=True)


_FRAGMENT_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _pickle_fragment,
    "sha256_cbor": _cbor_fragment,
    "xxhash": _pickle_fragment,
    "xxhash_cbor": _cbor_fragment,
}


def _fragments(fragment: Callable[[Any], bytes], extras: list[Any]) -> list[bytes]:
    """Each block's extra keys serialised, once per distinct object.

    Blocks share one tuple when they carry the same keys (see
    :func:`block_extra_keys`). By identity, not equality: pickle's memo is by
    identity, so equal tuples sharing different objects pickle differently.
    """
    done: dict[int, bytes] = {}
    out = []
    for extra in extras:
        key = id(extra)
        if key not in done:
            done[key] = fragment(extra)
        out.append(done[key])
    return out


@dataclass(frozen=True)
class HashSpec:
    """How one engine hashes blocks: its algorithm, PYTHONHASHSEED, block size and
    lookahead tokens (vLLM's ``num_hash_lookahead_tokens``, 0 for none).

    ``seed`` is the engine's PYTHONHASHSEED exactly as set (None when unset).
    Invalid specs fail at construction so misconfiguration surfaces at startup.
    """

    algo: str
    seed: str | None
    block_size: int
    lookahead_tokens: int = 0
    _fn: HashFn = field(init=False, repr=False, compare=False)
    _none_hash: bytes | None = field(init=False, repr=False, compare=False)
    _no_extras_fragment: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algo not in _HASH_FNS:
            raise UnknownHashAlgo(self.algo)
        _check_int("block_size", self.block_size)
        if self.seed is not None and not isinstance(self.seed, str):
            # vLLM hashes the environment string; hashing an int 0 would differ from "0".
            raise TypeError(f"seed must be the PYTHONHASHSEED string, not {self.seed!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        _check_int("lookahead_tokens", self.lookahead_tokens)
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must not be negative, got {self.lookahead_tokens}")
        fn = _HASH_FNS[self.algo]()
        object.__setattr__(self, "_fn", fn)
        none_hash = None
        if self.reproducible:
            none_hash = fn(DEFAULT_NONE_HASH_SEED if self.seed is None else self.seed)
        object.__setattr__(self, "_none_hash", none_hash)
        object.__setattr__(self, "_no_extras_fragment", _FRAGMENT_FNS[self.algo](None))

    @property
    def reproducible(self) -> bool:
        """False when the engine seeds its chain with random bytes (xxhash, no PYTHONHASHSEED)."""
        return self.seed is not None or self.algo not in _RANDOM_SEED_WITHOUT_ENV

    def hashed_blocks(self, n_tokens: int) -> int:
        """How many blocks of ``n_tokens`` tokens this spec hashes."""
        return hashed_blocks(n_tokens, self.block_size, self.lookahead_tokens)

    @property
    def none_hash(self) -> bytes:
        """The digest the first block of every chain uses as its parent."""
        if self._none_hash is None:
            raise NotReproducible(
                f"{self.algo} without PYTHONHASHSEED uses a random per-process seed in vLLM; "
                "its block hashes cannot be reproduced (set PYTHONHASHSEED on the engine, "
                "or match by tokens instead)"
            )
        return self._none_hash


def hashed_blocks(n_tokens: int, block_size: int, lookahead: int) -> int:
    """How many blocks of ``n_tokens`` tokens have a hash: the full ones that
    ``lookahead`` more tokens follow."""
    return max(n_tokens - lookahead, 0) // block_size


def _check_int(name: str, value: object) -> None:
    """A count must be an ``int``, and ``True`` is one to ``isinstance``: refuse it too."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")


_LOW_8 = slice(-8, None)


def published_ints(digests: list[bytes]) -> list[int]:
    """The form vLLM publishes with int block hashes: each digest's low 64 bits,
    unsigned (its last 8 bytes, big-endian); by the compiled core when built: a
    tokens query converts every digest of its prompt (512: 30 us here, 7 there)."""
    if native.chainhash is not None:
        return native.chainhash.published(digests)
    return _reference_ints(digests)


def _reference_ints(digests: Iterable[bytes]) -> list[int]:
    return list(map(int.from_bytes, map(getitem, digests, repeat(_LOW_8)), repeat("big")))


def block_hashes(
    spec: HashSpec,
    tokens: Sequence[int],
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_features: Sequence[MMFeature] = (),
    as_bytes: bool = False,
    compiled: bool = True,
) -> list[int] | list[bytes]:
    """The hashes an engine publishes for a prompt's full blocks, in order.

    Token ids must be plain ``int`` (not numpy scalars or bools): pickle and
    CBOR encode other types differently, so the digest would silently differ.
    A LoRA needs
    both name and path because vLLM keys blocks by both. The compiled core
    computes them when it is built (:mod:`indexer.engines.vllm.native`); ``compiled=False``
    runs the pure-Python reference, block by block: the executable spec the
    compiled core is tested and measured against.
    """
    use_compiled = compiled and native.chainhash is not None
    chain = _compiled_chain if use_compiled else _reference_chain
    extras = _prompt_extras(spec, tokens, lora_name, lora_path, cache_salt, mm_features)
    return chain(spec, tokens, extras, as_bytes)


def _prompt_extras(
    spec: HashSpec,
    tokens: Sequence[int],
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
    mm_features: Sequence[MMFeature],
) -> BlockExtras:
    """Each full block's extra keys, after checking the request."""
    if (lora_name is None) != (lora_path is None):
        raise ValueError("lora_name and lora_path must be given together")
    if lora_name is None and not cache_salt and not mm_features:
        return None
    n_blocks = spec.hashed_blocks(len(tokens))
    lora = ("lora", lora_name, lora_path) if lora_name is not None else None
    return list(
        block_extra_keys(
            n_blocks, spec.block_size, lora, cache_salt, mm_features, spec.lookahead_tokens
        )
    )


def _hashed_extra(extra: Any, toks: Sequence[int], end: int, lookahead: int) -> Any:
    """A block's extra keys as its hash input holds them: with lookahead, a tuple of
    its keys (None for none) and the ``lookahead`` tokens after the block, which
    ends at ``end``; vLLM hashes ``(E, token)`` for one such token, the same tuple."""
    return (extra, *toks[end : end + lookahead]) if lookahead else extra


def _reference_chain(
    spec: HashSpec, tokens: Sequence[int], extras: BlockExtras, as_bytes: bool
) -> list[int] | list[bytes]:
    parent = spec.none_hash
    fn = spec._fn
    size, lookahead = spec.block_size, spec.lookahead_tokens
    # Slices of a tuple are tuples: one allocation per block instead of list slice + tuple().
    toks = tokens if type(tokens) is tuple else tuple(tokens)
    n_blocks = spec.hashed_blocks(len(toks))
    keys = repeat(None, n_blocks) if extras is None else extras
    digests: list[bytes] = []
    append = digests.append
    for start, extra in zip(range(0, n_blocks * size, size), keys, strict=True):
        end = start + size
        parent = fn((parent, toks[start:end], _hashed_extra(extra, toks, end, lookahead)))
        append(parent)
    if as_bytes:
        return digests
    return _reference_ints(digests)


def _compiled_chain(
    spec: HashSpec, tokens: Sequence[int], extras: BlockExtras, as_bytes: bool
) -> list[int] | list[bytes]:
    size, lookahead = spec.block_size, spec.lookahead_tokens
    none_hash = spec.none_hash
    toks = tokens if type(tokens) is list or type(tokens) is tuple else tuple(tokens)
    if extras is None:
        fragments = [spec._no_extras_fragment] * spec.hashed_blocks(len(toks))
    else:
        fragments = _fragments(_FRAGMENT_FNS[spec.algo], extras)

    def fallback(block: int, parent: bytes) -> bytes:
        """A block the compiled code does not encode, hashed by the reference."""
        start, end = block * size, (block + 1) * size
        extra = _hashed_extra(None if extras is None else extras[block], toks, end, lookahead)
        return spec._fn((parent, tuple(toks[start:end]), extra))

    # The lookahead tokens are the compiled code's to write, like the block's own.
    return native.chainhash.chain(  # type: ignore[union-attr]
        spec.algo, none_hash, toks, size, fragments, not as_bytes, fallback, lookahead
    )


def block_extra_keys(
    n_blocks: int,
    size: int,
    lora: tuple[str, str | None, str | None] | None,
    cache_salt: str | None,
    mm: Sequence[MMFeature],
    lookahead: int = 0,
) -> Iterator[tuple[Any, ...] | None]:
    """Per-block extra keys in vLLM's order: LoRA, multimodal items, cache salt.

    vLLM drops an empty salt (it tests truthiness), so this does too. With
    ``lookahead`` the keys cover what the block's hash does, the block and the
    tokens after it: an item overlapping only those is the block's too, and
    the walk steps back to it for the next block (as vLLM's does).
    """
    # Most blocks carry only the LoRA key: share one tuple instead of building one per block.
    common = (lora,) if lora is not None else ()
    mm_idx = 0
    for start in range(0, n_blocks * size, size):
        keys: list[Any] = []
        if mm:
            mm_idx = _mm_keys(mm, start, start + size + lookahead, mm_idx, keys)
            if lookahead:
                mm_idx = _rewound(mm, start + size, mm_idx)
        if start == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        yield common + tuple(keys) if keys else common or None


def _mm_keys(mm: Sequence[MMFeature], start: int, end: int, idx: int, keys: list[Any]) -> int:
    """Append the keys of items overlapping ``[start, end)``; return the next item to check.

    Mirrors vLLM's walk step for step (including its early exit and its stop
    at an item the block does not finish), so even unsorted or overlapping
    items give the engine's keys. The offset is relative to the block start
    and negative when the item began in an earlier block.
    """
    last = mm[-1]
    if last.offset + last.length <= start:
        return idx
    while idx < len(mm):
        item = mm[idx]
        if end <= item.offset:
            break
        item_end = item.offset + item.length
        if start >= item_end:
            idx += 1
            continue
        keys.append(("mm", item.identifier, item.offset - start))
        if end < item_end:
            break
        idx += 1
    return idx


def _rewound(mm: Sequence[MMFeature], end: int, idx: int) -> int:
    """The walk's next item stepped back over those reaching past the block's ``end``
    (its lookahead window took them in): the next block starts its walk there."""
    while idx > 0 and mm[idx - 1].offset + mm[idx - 1].length > end:
        idx -= 1
    return idx
