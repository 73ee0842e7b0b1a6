"""SGLang's page hashes, computed from a prompt's tokens as its radix cache does.

SGLang 0.5.23 hashes a prompt page by page (``page_size`` tokens; partial
pages are never cached): page i's digest is SHA-256 of page i-1's digest
(nothing for the first page) followed by the page's tokens as little-endian
uint32 words, or, when a token does not fit 32 bits, the byte ``0xff`` and the
tokens as uint64 words. Its events publish the digest's first 8 bytes as a
signed big-endian int64; kvindex keys that as unsigned (:mod:`.wire`).

A request's ``cache_salt`` seeds the chain: the first page's prior digest is
SHA-256 of ``b"sglang-cache-salt-v1\\0"`` and the salt. With speculative
decoding (bigram keys) each page's words are the pairs ``t_j, t_j+1``, so a
page's hash covers the one token after it: the engine's ``lookahead_tokens``
of 1. A LoRA adapter's pages are namespaced by SGLang's internal adapter id,
which its events do not carry: those hashes cannot be computed here, and a
query naming an adapter is answered 422 (give its block hashes).

There is no seed and one algorithm (the engine's ``hash_algo`` is ``sha256``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from indexer.engines.base import Prompt

#: The algorithm names an SGLang engine may declare: its one chain.
HASH_ALGOS = ("sha256",)
_SALT_TAG = b"sglang-cache-salt-v1\0"
_WIDE_TAG = b"\xff"
_U32_MAX = (1 << 32) - 1


def _words(units: Sequence[int]) -> bytes:
    """A page's words as SGLang's hash reads them."""
    if max(units, default=0) > _U32_MAX:
        return _WIDE_TAG + struct.pack(f"<{len(units)}Q", *units)
    return struct.pack(f"<{len(units)}I", *units)


def salt_prior(cache_salt: str | None) -> bytes:
    """The digest a salted chain starts from (empty: none)."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(_SALT_TAG + cache_salt.encode("utf-8")).digest()


def hashed_pages(n_tokens: int, page_size: int, lookahead_tokens: int) -> int:
    """How many pages of a prompt are hashed: whole ones, each followed by its lookahead."""
    return max(0, (n_tokens - lookahead_tokens) // page_size)


def page_digests(
    tokens: Sequence[int], page_size: int, *, prior: bytes = b"", bigram: bool = False
) -> list[bytes]:
    """The digests of the prompt's whole pages, chained from ``prior``."""
    digests = []
    for i in range(hashed_pages(len(tokens), page_size, int(bigram))):
        start, end = i * page_size, (i + 1) * page_size
        if bigram:
            units = [u for j in range(start, end) for u in (tokens[j], tokens[j + 1])]
        else:
            units = tokens[start:end]
        prior = hashlib.sha256(prior + _words(units)).digest()
        digests.append(prior)
    return digests


def published_ints(digests: list[bytes]) -> list[int]:
    """Digests as kvindex keys SGLang's hashes: the first 8 bytes, unsigned."""
    return [int.from_bytes(d[:8], "big") for d in digests]


@dataclass(frozen=True, slots=True)
class SglangHasher:
    """SGLang's chain at one page size; ``lookahead_tokens`` 1: bigram keys (EAGLE)."""

    page_size: int
    lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.lookahead_tokens not in (0, 1):
            raise ValueError(
                "SGLang hashes pages of a positive size, with no or one lookahead token"
            )

    reproducible = True

    def digests(self, prompt: Prompt) -> list[bytes]:
        if prompt.lora_name is not None:
            raise ValueError(
                "SGLang namespaces a LoRA adapter's hashes by an id its events do not"
                " state: give the adapter's block_hashes"
            )
        if prompt.mm_features:
            raise ValueError("SGLang's multimodal pages are not hashed by kvindex")
        bigram = self.lookahead_tokens == 1
        prior = salt_prior(prompt.cache_salt)
        return page_digests(prompt.tokens, self.page_size, prior=prior, bigram=bigram)

    def published(self, digests: list[bytes]) -> list[int]:
        return published_ints(digests)
