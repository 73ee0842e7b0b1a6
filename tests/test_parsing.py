"""GET prompt parsing: the whole-text fast paths read exactly what the strict per-item rules do.

Valid prompts are read by the compiled decimal-list reader, or without it by
msgspec's JSON decoder, which also takes things a comma-separated decimal list
must refuse (whitespace, signs, exponents) and refuses one thing ``int()`` takes
(leading zeros). Whatever the text and whichever path, the answer must be the
strict per-item reading: the same ints, or a 422 naming the first bad item.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from api.errors import ApiError
from api.parsing import hash_items, parse_hashes, parse_tokens
from api.schemas import MAX_TOKEN, MAX_UINT64
from indexer.engines import intlist

from .conftest import run_without, serve_warning_without

#: Both whole-text readers: the compiled one, and msgspec's (what runs without the build).
READERS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "msgspec"])

#: Items a router might send: plain or zero-padded decimals, values at and past the
#: bounds, and what JSON would accept around a number but the API must not.
_ITEM = st.one_of(
    st.integers(0, MAX_UINT64 + 1).map(str),
    st.integers(0, 999).map(lambda n: f"00{n}"),
    st.sampled_from(["", " 1", "1 ", "-0", "-1", "1e3", "1.0", "+1", "[1]", "null", "0x1f"]),
    st.just("\u0661"),  # a non-ASCII digit
)


@contextmanager
def reader(compiled: bool) -> Iterator[None]:
    """Parse with the compiled reader, or as kvindex does when it did not build."""
    module = intlist.PART.module
    intlist.PART.module = module if compiled else None
    try:
        yield
    finally:
        intlist.PART.module = module


def outcome(parse: Callable[[], list[int]]) -> list[int] | tuple[int, str]:
    """What a parse answers: its ints, or its error's status and message."""
    try:
        return parse()
    except ApiError as e:
        return e.status, e.message


def test_the_compiled_reader_is_built() -> None:
    assert intlist.PART.available, f"the decimal-list reader did not build: {intlist.PART.error}"
    assert intlist.PART.status() == {"compiled_core": True, "compiled_core_error": None}


@pytest.mark.slow
def test_without_the_build_serve_warns_and_stats_say_why() -> None:
    module = "indexer.engines._intlist"
    assert serve_warning_without(module).startswith("compiled decimal-list reader not in use")
    script = (
        "import json\n"
        "from api.operators import compiled_status\n"
        "from api.parsing import parse_tokens\n"
        "print(json.dumps([compiled_status(), parse_tokens('1,007,2', 10)]))\n"
    )
    assert run_without(module, script) == [1, 7, 2]  # the status /stats reports names it


def strict(items: list[str], max_digits: int, ceiling: int) -> list[int] | int:
    """The reference: every item's int, or the index of the first bad item."""
    for i, item in enumerate(items):
        if not re.fullmatch(rf"[0-9]{{1,{max_digits}}}", item) or int(item) > ceiling:
            return i
    return [int(item) for item in items]


def assert_strict(got: list[int] | tuple[int, str], expected: list[int] | int, what: str) -> None:
    """``got`` is the ints expected, or the 422 naming item ``expected`` of ``what``."""
    if isinstance(expected, list):
        assert got == expected
    else:
        assert isinstance(got, tuple)
        assert got[0] == 422
        assert f"{what}[{expected}]" in got[1]


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(_ITEM, min_size=1, max_size=12))
@example(["9223372036854775808", "\u0661"])  # out of range, then malformed: name the first
@READERS
def test_tokens_parse_as_the_strict_rules_say(compiled: bool, items: list[str]) -> None:
    expected = [] if items == [""] else strict(items, 19, MAX_TOKEN)  # "" is no tokens
    with reader(compiled):
        got = outcome(lambda: parse_tokens(",".join(items), 100))
    assert_strict(got, expected, "tokens")


@settings(max_examples=400, deadline=None)
@given(st.lists(_ITEM.filter(lambda item: not item.startswith("0x")), min_size=1, max_size=12))
@READERS
def test_decimal_hashes_parse_as_the_strict_rules_say(compiled: bool, items: list[str]) -> None:
    get = [] if items == [""] else strict(items, 20, MAX_UINT64)  # GET's "" is no hashes
    for as_given, expected in ((items, strict(items, 20, MAX_UINT64)), (None, get)):
        with reader(compiled):
            given = hash_items(",".join(items)) if as_given is None else as_given  # GET, POST
            got = outcome(lambda: parse_hashes(given, 100))  # noqa: B023 (called here)
        assert_strict(got, expected, "block_hashes")


#: Text near a decimal list: digits, commas and what a list of numbers must not hold.
_TEXT = st.text(st.sampled_from("0123456789,,, -+e.x\u0661"), max_size=60) | st.lists(
    st.integers(0, 2 * MAX_UINT64).map(str), max_size=6
).map(",".join)


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(_TEXT)
@example("1,,2")
@example("18446744073709551616")
@example("0" * 20 + "1")
def test_any_text_reads_the_same_with_or_without_the_build(text: str) -> None:
    for parse in (lambda: parse_tokens(text, 4), lambda: parse_hashes(hash_items(text), 4)):
        with reader(True):
            compiled = outcome(parse)
        with reader(False):
            fallback = outcome(parse)
        assert compiled == fallback


@READERS
def test_a_post_hash_holding_a_comma_is_refused_not_split(compiled: bool) -> None:
    with reader(compiled):
        got = outcome(lambda: parse_hashes(["1,2", "3"], 100))
    assert got == (422, "block_hashes[0] is neither a decimal uint64 nor 0x-hex bytes: '1,2'")
