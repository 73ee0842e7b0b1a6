"""GET prompt parsing: the whole-text fast path reads exactly what the strict per-item rules do.

Valid prompts are parsed by msgspec's JSON decoder, which also takes things a
comma-separated decimal list must refuse (whitespace, signs, exponents) and
refuses one thing ``int()`` takes (leading zeros). Whatever the text, the
answer must be the strict per-item reading: the same ints, or a 422 naming
the first bad item.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from api.errors import ApiError
from api.parsing import parse_hashes, parse_tokens
from api.schemas import MAX_TOKEN, MAX_UINT64

#: Items a router might send: plain or zero-padded decimals, values at and past the
#: bounds, and what JSON would accept around a number but the API must not.
_ITEM = st.one_of(
    st.integers(0, MAX_UINT64 + 1).map(str),
    st.integers(0, 999).map(lambda n: f"00{n}"),
    st.sampled_from(["", " 1", "1 ", "-0", "-1", "1e3", "1.0", "+1", "[1]", "null", "0x1f"]),
    st.just("\u0661"),  # a non-ASCII digit
)


def strict(items: list[str], max_digits: int, ceiling: int) -> list[int] | int:
    """The reference: every item's int, or the index of the first bad item."""
    for i, item in enumerate(items):
        if not re.fullmatch(rf"[0-9]{{1,{max_digits}}}", item) or int(item) > ceiling:
            return i
    return [int(item) for item in items]


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(_ITEM, min_size=1, max_size=12))
@example(["9223372036854775808", "\u0661"])  # out of range, then malformed: name the first
def test_tokens_parse_as_the_strict_rules_say(items: list[str]) -> None:
    expected = [] if items == [""] else strict(items, 19, MAX_TOKEN)  # "" is no tokens
    if isinstance(expected, list):
        assert parse_tokens(",".join(items), 100) == expected
    else:
        with pytest.raises(ApiError) as refused:
            parse_tokens(",".join(items), 100)
        assert refused.value.status == 422
        assert f"tokens[{expected}]" in refused.value.message


@settings(max_examples=400, deadline=None)
@given(st.lists(_ITEM.filter(lambda item: not item.startswith("0x")), min_size=1, max_size=12))
def test_decimal_hashes_parse_as_the_strict_rules_say(items: list[str]) -> None:
    expected = strict(items, 20, MAX_UINT64)
    if isinstance(expected, list):
        assert parse_hashes(items, 100) == expected
    else:
        with pytest.raises(ApiError) as refused:
            parse_hashes(items, 100)
        assert refused.value.status == 422
        assert f"block_hashes[{expected}]" in refused.value.message
