"""The golden tool cases' models, for the script that renders them with vLLM (in the vLLM
tier) and for the main suite that checks kvindex against them: one recipe, so both read
the same tokenizer folders.

A model of ``tests/fixtures/tools/requests.json`` names a tokenizer of the shared
fixtures and either a ``chat_template`` (the server's ``--chat-template``) or
``named_templates``: the tokenizer is then copied with its own template as the
``default`` one and these beside it (a tokenizer config that names its templates, as
models with a separate ``tool_use`` template have), and the server is given none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tools"
TOKENIZERS = Path(__file__).resolve().parents[2] / "shared/fixtures/vllm-0.33.0/tokenize"


def tokenizer_dir(spec: dict[str, Any], into: Path) -> Path:
    """The folder of the model's tokenizer: the shared one, or a copy under ``into``
    whose config names its templates."""
    shared = TOKENIZERS / spec["tokenizer"]
    named = spec.get("named_templates")
    if named is None:
        return shared
    folder = into / spec["tokenizer"]
    shutil.copytree(shared, folder, dirs_exist_ok=True)
    for copied in folder.iterdir():
        copied.chmod(0o644)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    templates = {"default": config["chat_template"]}
    templates |= {name: (FIXTURES / path).read_text() for name, path in named.items()}
    config["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    config_file.write_text(json.dumps(config, indent=1))
    return folder


def chat_template(spec: dict[str, Any]) -> str | None:
    """The server's ``--chat-template`` for the model, if it has one."""
    path = spec.get("chat_template")
    return None if path is None else (FIXTURES / path).read_text()


def server_flags(spec: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """A server's tool flags for the model (``PARSER``: the model's tool call parser)."""
    return {k: spec["tool_call_parser"] if v == "PARSER" else v for k, v in flags.items()}
