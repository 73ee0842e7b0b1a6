"""SGLang's own chat rules, golden-tested against its server: for conversations of each
shape kvindex renders by SGLang's rules (indexer/engines/sglang/render.py), what kvindex
answers equals the ``cached_tokens`` SGLang reports, and it hashes as many whole pages as
SGLang's ``prompt_tokens`` make (:func:`~tests.sglang_server.kit.exact`). Where a rule
differs from vLLM's, the difference is placed in a whole page, so that a rendering by
the other rule would change the hashes and show."""

from __future__ import annotations

from tests.sglang_server.conftest import BY_ENDPOINTS
from tests.sglang_server.kit import PAGE, chat_exact, exact, text

ENGINES = [BY_ENDPOINTS]
SYSTEM = {"role": "system", "content": "answer in one word"}


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def held(kv, messages: list[dict]) -> int:
    return kv.match(BY_ENDPOINTS, messages=messages)["prefix_tokens"]


def test_a_conversation_turn_by_turn_with_sglang_s_own_replies(sglang, kv) -> None:
    messages = [SYSTEM, {"role": "user", "content": text(50, 101)}]
    before = 0
    for turn in range(3):
        answer = chat_exact(sglang, kv, ENGINES, messages)
        if turn:  # every turn starts with the previous one's prompt, which SGLang holds
            assert cached(answer) >= before > 0, answer
        before = answer["usage"]["prompt_tokens"] // PAGE * PAGE
        reply = answer["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": text(30, 102 + turn)},
        ]


def test_text_parts_join_with_a_space(sglang, kv) -> None:
    """A template that reads content as a string (the tiny model's) gets the text parts
    joined with one space; vLLM joins them with a newline."""
    head, tail = text(3, 201), text(60, 202)
    parts = [{"type": "text", "text": head}, {"type": "text", "text": tail}]
    messages = [SYSTEM, {"role": "user", "content": parts}]
    chat_exact(sglang, kv, ENGINES, messages)
    again = chat_exact(sglang, kv, ENGINES, messages)
    assert cached(again) >= 3 * PAGE, again
    as_one = [SYSTEM, {"role": "user", "content": f"{head} {tail}"}]
    by_newline = [SYSTEM, {"role": "user", "content": f"{head}\n{tail}"}]
    assert held(kv, as_one) == held(kv, messages) > held(kv, by_newline)
    # and SGLang takes the one string as the same prompt
    assert cached(chat_exact(sglang, kv, ENGINES, as_one)) == cached(again)


def test_a_final_assistant_message_is_rendered_as_the_user_s(sglang, kv) -> None:
    """SGLang renders a conversation ending with an assistant's text as if the user had
    said it (vLLM renders it as the assistant's)."""
    opening = [SYSTEM, {"role": "user", "content": text(4, 301)}]
    last = text(60, 302)
    messages = [*opening, {"role": "assistant", "content": last}]
    chat_exact(sglang, kv, ENGINES, messages)
    again = chat_exact(sglang, kv, ENGINES, messages)
    assert cached(again) >= 3 * PAGE, again
    as_user = [*opening, {"role": "user", "content": last}]
    assert held(kv, as_user) == held(kv, messages)
    assert cached(chat_exact(sglang, kv, ENGINES, as_user)) == cached(again)


def test_a_completion_prompt_is_tokenized_with_special_tokens(sglang, kv) -> None:
    body = {"prompt": text(70, 401)}
    exact(sglang, kv, ENGINES, "/v1/completions", body)
    again = exact(sglang, kv, ENGINES, "/v1/completions", body)
    assert cached(again) >= 3 * PAGE, again
