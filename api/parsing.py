"""Request inputs parsed strictly: tokens, block hashes, lists, JSON bodies.

``int()`` alone would accept ``" 12"``, ``"1_000"`` and non-ASCII digits;
a router sending those has a bug worth a 422 that points at the item.
A long GET prompt is read whole in C (:mod:`indexer.engines.intlist`), which
takes exactly what the per-item rules take; without that build, by msgspec's
JSON decoder (five times ``map(int, ...)``'s speed) once whole-string checks
have ruled out what JSON allows and a decimal list does not. Anything else
(leading zeros, which ``int()`` takes and JSON does not, or a bad item) is
walked item by item, to parse it or to name the culprit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from api.errors import ApiError, ErrorBody
from api.openapi import answers
from api.schemas import HASH_PATTERN, MAX_TOKEN, MAX_UINT64, Token
from indexer.core.events import BlockHash
from indexer.engines import intlist

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)

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


def _whole(text: str, digits: int, ceiling: int, decoder: msgspec.json.Decoder) -> list[int] | None:
    """``text``'s comma-separated decimals of 1..``digits`` digits up to ``ceiling``, read
    at once (in C); None if it is not only those, or if only the item-by-item walk can
    tell (the caller then takes that walk)."""
    compiled = intlist.PART.module
    if compiled is not None:
        return compiled.decimals(text, digits, ceiling)
    return _json_ints(text, decoder)


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
    """``"1,2,3"`` to token ids; 413 past ``limit`` tokens, 422 on a bad item (a
    prompt over the limit is a 413 whatever its items: it is counted first, by its
    commas, before any item is read)."""
    check_size(text.count(",") + 1 if text else 0, "tokens", limit)
    tokens = _whole(text, 19, MAX_TOKEN, _TOKEN_LIST)
    if tokens is not None:
        return tokens
    items = split_list(text)
    if not items:
        return []
    tokens = _decimals(items, 19)
    if tokens is None or max(tokens) > MAX_TOKEN:
        raise _first_bad_token(items)
    return tokens


def _is_token(item: str) -> bool:
    return _TOKEN.fullmatch(item) is not None and int(item) <= MAX_TOKEN


def _first_bad_token(items: list[str]) -> ApiError:
    """The 422 for the first item that is not a token, whether malformed or out of range."""
    i, item = next((i, t) for i, t in enumerate(items) if not _is_token(t))
    if _TOKEN.fullmatch(item) is None:
        return ApiError(422, f"tokens[{i}] is not a non-negative integer: {item[:40]!r}")
    return ApiError(422, f"tokens[{i}] is out of range (0..2^63-1): {item}")


def parse_hash(item: int | str, where: str = "hash") -> BlockHash:
    """A decimal uint64 (int or text) or a ``0x`` hex digest (bytes)."""
    if type(item) is int:
        if item > MAX_UINT64:
            raise ApiError(422, f"{where} is out of range for a uint64: {item}")
        return item
    if _HASH.fullmatch(item) is None:
        if _past_uint64(item):  # said as of a JSON number, which a GET item may have been
            raise ApiError(422, f"{where} is out of range for a uint64: {item}")
        raise ApiError(
            422, f"{where} is neither a decimal uint64 nor 0x-hex bytes: {str(item)[:80]!r}"
        )
    if item.startswith("0x"):
        return bytes.fromhex(item[2:])
    value = int(item)
    if value > MAX_UINT64:
        raise ApiError(422, f"{where} is out of range for a uint64: {item}")
    return value


def _past_uint64(item: str) -> bool:
    """Whether ``item`` is ASCII digits of a value past the uint64 range."""
    digits = item.lstrip("0")
    decimal = item.isascii() and item.isdigit()
    return decimal and (len(digits) > 20 or int(digits or "0") > MAX_UINT64)


def hash_items(text: str) -> list[int | str]:
    """A GET ``block_hashes`` as the body's list: every item an int when all are
    decimals (parsed at once, in C), else the items as given, for :func:`parse_hashes`
    to parse one by one or name the bad one."""
    values: list[int | str] | None = _whole(text, 20, MAX_UINT64, _HASH_LIST)
    return split_list(text) if values is None else values


def parse_hashes(items: list[int | str], limit: int) -> list[BlockHash]:
    """Block hashes of a query; 413 past ``limit`` blocks."""
    check_size(len(items), "blocks", limit)
    if _all_uint64(items):  # JSON numbers (checked >= 0 already), or a GET's decimals
        return list(items)
    if all(type(item) is str for item in items):  # decimal strings of a JSON body
        values = _whole(",".join(items), 20, MAX_UINT64, _HASH_LIST) or _decimals(items, 20)
        if values is not None and len(values) == len(items) and max(values) <= MAX_UINT64:
            return values  # (an item holding a comma reads as two: the walk refuses it)
    return [parse_hash(item, f"block_hashes[{i}]") for i, item in enumerate(items)]


def _all_uint64(items: list[int | str]) -> bool:
    """Whether every item is an int of at most 64 bits (``max`` compares an int with a
    str only to raise: a list that starts with an int and has a max is all ints)."""
    if not items or type(items[0]) is not int:
        return False
    try:
        return max(items) <= MAX_UINT64  # type: ignore[type-var]
    except TypeError:
        return False


def hash_text(block_hash: BlockHash) -> str:
    """The text form :func:`parse_hash` reads back."""
    return "0x" + block_hash.hex() if type(block_hash) is bytes else str(block_hash)


async def decode_body(request: Request, decode: Callable[[bytes], T], what: str) -> T:
    """A JSON body through a msgspec decoder: 400 if not JSON, 422 if not a valid ``what``
    or if an object repeats a key (msgspec, like most decoders, keeps the last value)."""
    raw = await request.body()
    try:
        value = decode(raw)
    except msgspec.ValidationError as e:
        raise ApiError(422, f"invalid {what}: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"body is not JSON: {e}") from None
    refuse_repeated_keys(raw)
    return value


#: A JSON key: a string followed by a colon. In valid JSON only a key's closing quote
#: is followed by a colon, so this finds exactly the keys, never text inside a value.
_KEY = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:')


def refuse_repeated_keys(raw: bytes) -> None:
    """422 naming a key some object of a valid JSON body holds twice. Bodies whose keys
    are all different texts (a prompt by tokens or hashes) are settled by one scan for
    keys; only others (chat messages repeat "role" and "content" across objects, an
    escaped key may spell another) are parsed again to look object by object."""
    keys = _KEY.findall(raw)
    if len(set(keys)) == len(keys) and not any(b"\\" in key for key in keys):
        return
    with contextlib.suppress(RecursionError, ValueError):  # what only msgspec reads (an int
        json.loads(raw, object_pairs_hook=_unique_keys)  # of 5,000 digits): no key to name


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = Counter(key for key, _ in pairs)
    repeated = [key for key, n in counts.items() if n > 1]
    if repeated:
        raise ApiError(422, f"body: key {repeated[0][:40]!r} is given more than once in an object")
    return dict(pairs)


def parse_query(request: Request, struct: type[S]) -> S:
    """A route's query parameters as ``struct``, in one msgspec pass (FastAPI parses
    parameter by parameter, which for prefix-match cost more than the match itself);
    422 naming the malformed one. An integer is plain ASCII digits, as tokens are
    (msgspec's own str-to-int takes ``1e3`` and ``null``). A repeated parameter
    never gets here (:class:`StrictQueryRoute` refuses it)."""
    given: dict[str, Any] = dict(request.query_params)
    for name in _int_fields(struct):
        value = given.get(name)
        if value is not None and value.isascii() and value.isdigit():
            given[name] = int(value)
    try:
        return msgspec.convert(given, struct)
    except msgspec.ValidationError as e:
        raise ApiError(422, f"invalid query parameter: {e}") from None


@functools.cache
def _int_fields(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    fields = msgspec.inspect.type_info(struct).fields  # type: ignore[attr-defined]
    return tuple(f.name for f in fields if _takes_int(f.type))


def _takes_int(t: msgspec.inspect.Type) -> bool:
    options = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
    return any(isinstance(option, msgspec.inspect.IntType) for option in options)


def query_parameters(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """``openapi_extra`` listing the query parameters :func:`parse_query` reads into
    ``struct`` (every one optional), laid out as FastAPI lays out its own: a field's
    description beside the parameter and, with its pattern, atop its schema."""
    _, components = msgspec.json.schema_components([struct])
    fields = components[struct.__name__]["properties"]
    return {"parameters": [_parameter(name, schema) for name, schema in fields.items()]}


def _parameter(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    schema = {key: value for key, value in schema.items() if key != "default"}
    given = schema.get("anyOf", [schema])[0]
    lifted = {key: given.pop(key) for key in ("description", "pattern") if key in given}
    parameter = {"in": "query", "name": name, "required": False}
    if "description" in lifted:
        parameter["description"] = lifted["description"]
    title = name.replace("_", " ").title()
    return {**parameter, "schema": {**schema, **lifted, "title": title}}


_UNKNOWN_QUERY = "an unknown query parameter, or one given twice"


class StrictQueryRoute(APIRoute):
    """A route that answers 422 to query parameters it does not take, naming them,
    and to one given twice.

    FastAPI ignores them, so a misspelt filter (``engine=`` for ``engines=``)
    would answer as if no filter had been given: a wrong answer that looks
    right; of a repeated one it keeps one value and drops the others. Bodies
    already refuse unknown fields (and repeated keys); this makes query strings
    agree. Every such route documents the 422 (added to its own, if any).
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        responses = dict(kwargs.get("responses") or {})
        own = responses.get(422)
        if own is None:
            responses |= answers(_422=(ErrorBody, _UNKNOWN_QUERY))
        else:
            responses[422] = {**own, "description": f"{own['description']}; or {_UNKNOWN_QUERY}"}
        super().__init__(path, endpoint, **{**kwargs, "responses": responses})

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        listed = (self.openapi_extra or {}).get("parameters", [])  # see query_parameters
        known = _query_names(self.dependant) | {p["name"] for p in listed if p["in"] == "query"}

        async def strict_handler(request: Request) -> Response:
            unknown = [name for name in dict.fromkeys(request.query_params) if name not in known]
            if unknown:
                raise ApiError(422, _unknown_query_message(unknown, known))
            refuse_repeated_parameters(request)
            return await handler(request)

        return strict_handler


def refuse_repeated_parameters(request: Request) -> None:
    """422 naming a query parameter given twice: one of its values would be dropped."""
    counts = Counter(name for name, _ in request.query_params.multi_items())
    repeated = [name for name, n in counts.items() if n > 1]
    if repeated:
        raise ApiError(422, f"query parameter {repeated[0][:40]!r} is given more than once")


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route reads, its dependencies' included."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return frozenset(names)


def _unknown_query_message(unknown: list[str], known: frozenset[str]) -> str:
    named = ", ".join(repr(name[:40]) for name in unknown[:5])
    plural = "s" if len(unknown) > 1 else ""
    takes = f"takes {', '.join(sorted(known))}" if known else "takes no query parameters"
    return f"unknown query parameter{plural} {named}: this endpoint {takes}"
