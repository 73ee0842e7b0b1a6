"""What kvindex answers for a ``messages`` query equals the ``cached_tokens`` the whole
SGLang server then reports for the same request: nothing for a conversation it has not
seen, every whole page but the last token's once it has served it."""

from __future__ import annotations

from tests.sglang_server.conftest import BY_ENDPOINTS
from tests.sglang_server.kit import PAGE, chat_exact

WORDS = ["fip", "zorbu", "quala", "mendo", "trask", "velin", "oputa", "grane", "sorvik", "lumbe"]


def test_kvindex_answers_what_sglang_reports_as_cached(sglang, kv) -> None:
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": " ".join(WORDS * 9)},
    ]
    first = chat_exact(sglang, kv, [BY_ENDPOINTS], messages)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0, first
    again = chat_exact(sglang, kv, [BY_ENDPOINTS], messages)["usage"]
    assert again["prompt_tokens"] == first["prompt_tokens"]
    whole_pages = (first["prompt_tokens"] - 1) // PAGE * PAGE
    assert again["prompt_tokens_details"]["cached_tokens"] == whole_pages > 0, again
