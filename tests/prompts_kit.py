"""The golden prompt cases and the tokenizers that render them, loaded once for
every prompt test module: loading a tokenizer is the slow part of a test, and
each module must check the same cases against the same pool."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec

from indexer.engines import catalog
from indexer.engines.vllm.render import ChatMessage, ChatOptions
from indexer.prompts import ModelTokenizer, Tokenizers

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/vllm-0.33.0/tokenize"
GOLDEN = json.loads((FIXTURES / "cases.json").read_text())
CASES = GOLDEN["cases"]
MODELS = {name: ModelTokenizer(str(FIXTURES / d)) for name, d in GOLDEN["tokenizers"].items()}
BLOCK = GOLDEN["block_size"]
REQUEST_FIELDS = ("add_special_tokens", "add_generation_prompt", "continue_final_message")
VLLM = catalog.adapter("vllm")
#: One pool for all the prompt tests: loading a tokenizer is the slow part of a test.
POOL = Tokenizers(MODELS)


def _id(case: dict) -> str:
    return f"{case['tokenizer']}-{case['name']}"


ACCEPTED = [c for c in CASES if "expected_error" not in c]
REFUSED = [c for c in CASES if "expected_error" in c]


def _tokens(case: dict, pool: Tokenizers = POOL) -> list[int]:
    request = case["request"]
    messages = request.get("messages")
    return pool.tokens_now(
        case["tokenizer"],
        prompt=request.get("prompt"),
        messages=msgspec.convert(messages, list[ChatMessage]) if messages is not None else None,
        options=ChatOptions(**{k: request[k] for k in REQUEST_FIELDS if k in request}),
    )


def _conversation(turns: int, seed: int = 3) -> list[ChatMessage]:
    rng = random.Random(seed)
    words = ["kv", "cache", "re\u0301sume", "日本語", "12345", "\n\n", "  ", "<|eot_id|>", "x"]
    return [
        ChatMessage(
            role="user" if i % 2 == 0 else "assistant",
            content=" ".join(rng.choice(words) for _ in range(rng.randint(0, 60))),
        )
        for i in range(turns)
    ]
