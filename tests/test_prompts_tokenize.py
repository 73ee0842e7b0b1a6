"""Tokenizing prompts as vLLM does, fast: the piece cache must give exactly the
whole text's tokens and tokenizing must leave the event loop free, and the
models a config names (with their chat templates) are what gets loaded."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.engines.vllm.render import ChatMessage, PromptRefused
from indexer.prompts import ModelTokenizer, Tokenizers
from kvindex.config import ConfigError, load_config

from .prompts_kit import FIXTURES, MODELS, POOL, _conversation

# --- the piece cache is exact, and tokenizing leaves the event loop free ----------------


@pytest.mark.parametrize("tokenizer", sorted(MODELS))
def test_a_growing_conversation_tokenizes_as_if_whole(tokenizer: str) -> None:
    """Turn after turn, the cached pieces give exactly what tokenizing the whole
    rendered text gives, and the earlier turns come from the cache."""
    pool = Tokenizers({tokenizer: MODELS[tokenizer]})
    for turns in range(1, 12):
        messages = _conversation(turns)
        tokens = pool.tokens_now(tokenizer, messages=messages)
        loaded = pool._model(tokenizer, "messages")
        text = loaded.hf.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokens == loaded.hf(text, add_special_tokens=False)["input_ids"]
    assert loaded.split is not None and len(pool._cache) > 10


#: Texts made of what the tokenizers treat specially: added tokens of both, their
#: fragments, combining accents (NFC), digits, contractions and whitespace runs.
_PIECES = ["a", "é", "e\u0301", " ", "  ", "\n", "\t", "1", "日", "'s", "<|", "<|im_end|>"]
_TEXT = st.lists(st.sampled_from([*_PIECES, "<|eot_id|>", "<|begin_of_text|>"]), max_size=40).map(
    "".join
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(text=_TEXT, special=st.booleans())
def test_pieces_equal_the_whole_text_for_any_text(text: str, special: bool) -> None:
    for name in MODELS:
        loaded = POOL._model(name, "prompt")
        assert POOL._encode(loaded, text, special) == loaded.whole(text, special)


@pytest.mark.slow
async def test_tokenizing_runs_off_the_event_loop() -> None:
    pool = Tokenizers({"llama3ish": MODELS["llama3ish"]})
    await pool.tokens("llama3ish", prompt="warm up")
    seen: list[str] = []
    real = pool._encode

    def spy(*args: object) -> list[int]:
        seen.append(threading.current_thread().name)
        return real(*args)

    pool._encode = spy  # type: ignore[method-assign]
    ticks = 0
    long_text = " ".join(str(i) for i in range(20_000))
    work = asyncio.ensure_future(pool.tokens("llama3ish", prompt=long_text))
    while not work.done():
        ticks += 1
        await asyncio.sleep(0)
    assert len(await work) > 20_000 and ticks > 1
    assert seen and all(name.startswith("kvindex-tokenize") for name in seen)
    pool.close()


# --- configuration ------------------------------------------------------------------------


def test_models_are_a_top_level_config_section(tmp_path: Path) -> None:
    path = tmp_path / "kvindex.yaml"
    path.write_text(f"models:\n  m:\n    tokenizer: {FIXTURES / 'chatmlish'}\n")
    assert load_config(path).api_settings().models == {
        "m": ModelTokenizer(str(FIXTURES / "chatmlish"))
    }
    path.write_text("api:\n  models: {}\n")
    with pytest.raises(ConfigError, match="models is a section of its own"):
        load_config(path).api_settings()
    path.write_text("models:\n  m:\n    tokeniser: x\n")
    with pytest.raises(ConfigError, match="tokeniser"):
        load_config(path)


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    pool = Tokenizers(
        {
            "file": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=str(template)),
            "text": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template=template.read_text()),
            "typo": ModelTokenizer(str(FIXTURES / "chatmlish"), chat_template="no/such.jinja"),
        }
    )
    messages = [ChatMessage(role="user", content="hi")]
    assert pool.tokens_now("file", messages=messages) == pool.tokens_now("text", messages=messages)
    with pytest.raises(PromptRefused, match="neither a file nor a template"):
        pool.tokens_now("typo", messages=messages)
