"""Request inputs parsed strictly: tokens, block hashes, lists, JSON bodies.

``int()`` alone would accept ``" 12"``, ``"1_000"`` and non-ASCII digits;
a router sending those has a bug worth a 422 that points at the item.
A long GET prompt is parsed whole by msgspec's JSON decoder (a C loop,
five times ``map(int, ...)``'s speed) once whole-string checks have ruled
out what JSON allows and a decimal list does not; anything else (leading
zeros, which ``int()`` takes and JSON does not, or a bad item) is walked
item by item, to parse it or to name the culprit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, TypeVar

import msgspec
from starlette.requests import Request

from api.errors import ApiError
from api.schemas import HASH_PATTERN, MAX_TOKEN, MAX_UINT64, Token
from indexer.wire import BlockHash

T = TypeVar("T")

_TOKEN = re.compile(r"[0-9]{1,19}")
_HASH = re.compile(HASH_PATTERN)


def split_list(text: str) -> list[str]:
    """Comma-separated items; the empty string is the empty list."""
    return text.split(",") if text else []


def check_size(count: int, unit: str, limit: int) -> None:
    """413 for a prompt of more than ``limit`` tokens or blocks."""
    if count > limit:
        raise ApiError(413, f"prompt has {count} {unit}, over the maximum of {limit}")


#: What JSON takes in a list of numbers that a comma-separated list of decimals must not
#: hold: whitespace, and signs (``-0`` is JSON); fractions and exponents fail as non-ints.
_NOT_DECIMAL = (" ", "\t", "\n", "\r", "-")
_TOKEN_LIST = msgspec.json.Decoder(list[Token])
_HASH_LIST = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0)]])


def _json_ints(text: str, decoder: msgspec.json.Decoder) -> list[int] | None:
    """``text``'s comma-separated decimals, parsed in C; None if it is not exactly that
    (or a value is out of the decoder's range): the caller then goes item by item."""
    if any(c in text for c in _NOT_DECIMAL):
        return None
    try:
        return decoder.decode(f"[{text}]")
    except msgspec.DecodeError:  # ValidationError included
        return None


def _decimals(items: list[str], max_digits: int) -> list[int] | None:
    """Every item as an int if each is 1..``max_digits`` ASCII digits, else None."""
    digits = "".join(items)
    decimal = digits.isascii() and digits.isdigit() and "" not in items
    if not decimal or max(map(len, items)) > max_digits:
        return None
    return list(map(int, items))


def parse_tokens(text: str, limit: int) -> list[int]:
    """``"1,2,3"`` to token ids; 413 past ``limit`` tokens, 422 on a bad item."""
    check_size(text.count(",") + 1 if text else 0, "tokens", limit)
    if not text:
        return []
    tokens = _json_ints(text, _TOKEN_LIST)
    if tokens is not None:
        return tokens
    items = text.split(",")
    tokens = _decimals(items, 19)
    if tokens is None:
        i, item = next((i, t) for i, t in enumerate(items) if _TOKEN.fullmatch(t) is None)
        raise ApiError(422, f"tokens[{i}] is not a non-negative integer: {item[:40]!r}")
    if max(tokens) > MAX_TOKEN:
        i = next(i for i, t in enumerate(tokens) if t > MAX_TOKEN)
        raise ApiError(422, f"tokens[{i}] is out of range (0..2^63-1): {tokens[i]}")
    return tokens


def parse_hash(item: int | str, where: str = "hash") -> BlockHash:
    """A decimal uint64 (int or text) or a ``0x`` hex digest (bytes)."""
    if type(item) is int:
        if item > MAX_UINT64:
            raise ApiError(422, f"{where} is out of range for a uint64: {item}")
        return item
    if _HASH.fullmatch(item) is None:
        raise ApiError(
            422, f"{where} is neither a decimal uint64 nor 0x-hex bytes: {str(item)[:80]!r}"
        )
    if item.startswith("0x"):
        return bytes.fromhex(item[2:])
    value = int(item)
    if value > MAX_UINT64:
        raise ApiError(422, f"{where} is out of range for a uint64: {item}")
    return value


def parse_hashes(items: list[int | str], limit: int) -> list[BlockHash]:
    """Block hashes of a query; 413 past ``limit`` blocks."""
    check_size(len(items), "blocks", limit)
    if items and set(map(type, items)) == {str}:  # GET: try the all-decimal case
        values = _json_ints(",".join(items), _HASH_LIST) or _decimals(items, 20)
        if values is not None and max(values) <= MAX_UINT64:
            return values
    return [parse_hash(item, f"block_hashes[{i}]") for i, item in enumerate(items)]


def hash_text(block_hash: BlockHash) -> str:
    """The text form :func:`parse_hash` reads back."""
    return "0x" + block_hash.hex() if type(block_hash) is bytes else str(block_hash)


async def decode_body(request: Request, decode: Callable[[bytes], T], what: str) -> T:
    """A JSON body through a msgspec decoder: 400 if not JSON, 422 if not a valid ``what``."""
    try:
        return decode(await request.body())
    except msgspec.ValidationError as e:
        raise ApiError(422, f"invalid {what}: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"body is not JSON: {e}") from None
