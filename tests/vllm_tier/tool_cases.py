"""Golden tool-use and Responses cases, rendered by vLLM 0.33.0's own OpenAI front end.

``python -m tests.vllm_tier.tool_cases [OUT]`` (from the checkout, in the vLLM
tier's venv) reads ``tests/fixtures/tools/requests.json`` (request bodies,
the models they go to and the server tool flags each is served with) and
writes what vLLM makes of each (``tests/fixtures/tools/cases.json`` by default): the prompt
token ids and their block hashes, or vLLM's own 400 and message.

Each model is built as ``vllm serve`` builds its front end (CPU, a
``config.json``-only tiny Llama, the tokenizer and template of
:mod:`tests.tool_fixtures`): ``renderer_from_config`` and an
``OnlineRenderer`` with the server's tool flags. Chat bodies are parsed by
``ChatCompletionRequest`` and rendered by ``render_chat``; Responses bodies
by ``ResponsesRequest`` and ``render_responses`` (no stored history). Block
hashes are vLLM's: ``hash_block_tokens`` chained from ``NONE_HASH`` with
sha256, 16-token blocks. :mod:`tests.vllm_tier.test_tool_cases` renders them
again and compares with the checked-in file.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.tool_fixtures import FIXTURES, chat_template, server_flags, tokenizer_dir
from tests.vllm_tier.conftest import TINY_LLAMA

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def _front_end(tokenizer: Path, model_dir: Path) -> Any:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.registry import renderer_from_config

    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(tokenizer),
        max_model_len=MAX_MODEL_LEN,
    )
    config = VllmConfig(model_config=model_config)
    return model_config, renderer_from_config(config)


def _online(model_config: Any, renderer: Any, template: str | None, flags: dict[str, Any]) -> Any:
    from vllm.renderers.online_renderer import OnlineRenderer

    return OnlineRenderer(
        model_config,
        renderer,
        request_logger=None,
        chat_template=template,
        chat_template_content_format="auto",
        enable_auto_tools=flags.get("enable_auto_tool_choice", False),
        exclude_tools_when_tool_choice_none=flags.get("exclude_tools_when_tool_choice_none", False),
        tool_parser=flags.get("tool_call_parser"),
    )


async def _render(online: Any, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's token ids for ``body``, or its 400 and message."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import VLLMValidationError

    try:
        if kind == "chat":
            result = await online.render_chat(ChatCompletionRequest(**body, model="m"))
        else:
            result = await online.render_responses(ResponsesRequest(**body, model="m"))
    except (ValidationError, VLLMValidationError, ValueError) as e:
        return {"expected_error": {"status": 400, "message": str(e)}}
    if isinstance(result, ErrorResponse):
        return {"expected_error": {"status": result.error.code, "message": result.error.message}}
    engine_input = result[1][0] if kind == "chat" else result.engine_input
    return {"token_ids": list(engine_input["prompt_token_ids"])}


def _hashes(token_ids: list[int]) -> dict[str, Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    parent = kv_cache_utils.NONE_HASH
    digests = []
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = tuple(token_ids[start : start + BLOCK_SIZE])
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, block, None)
        digests.append(bytes(parent))
    return {
        "num_tokens": len(token_ids),
        "block_hashes_hex": [d.hex() for d in digests],
        "block_hashes_u64": [kv_cache_utils.maybe_convert_block_hash(d) for d in digests],
    }


def render_all(requests: dict[str, Any]) -> dict[str, Any]:
    """Every request of ``requests.json`` through vLLM: the content of ``cases.json``."""
    import vllm
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    cases = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
        for model, spec in requests["models"].items():
            tokenizer = tokenizer_dir(spec, Path(scratch) / model)
            model_config, renderer = _front_end(tokenizer, model_dir)
            for item in requests["requests"]:
                flags = server_flags(spec, requests["servers"][item["server"]])
                online = _online(model_config, renderer, chat_template(spec), flags)
                case = {"model": model, **item}
                body = json.loads(json.dumps(item["request"]))
                case |= asyncio.run(_render(online, item["kind"], body))
                if "token_ids" in case:
                    case |= _hashes(case["token_ids"])
                cases.append(case)
    return {
        "vllm_version": vllm.__version__,
        "block_size": BLOCK_SIZE,
        "hash_algo": "sha256",
        "none_hash_hex": bytes(kv_cache_utils.NONE_HASH).hex(),
        "models": requests["models"],
        "servers": requests["servers"],
        "cases": cases,
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES / "cases.json"
    requests = json.loads((FIXTURES / "requests.json").read_text())
    out.write_text(json.dumps(render_all(requests), indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
