"""The README's and docs/' examples are real: the config loads, the commands parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvindex.cli import parse_args
from kvindex.config import load_config

ROOT = Path(__file__).resolve().parents[1]
#: The README and the docs it links to, where the examples moved.
README = "\n".join(
    path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
)


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_config_loads(tmp_path: Path) -> None:
    (config,) = [b for b in blocks("yaml") if "engines:" in b]
    path = tmp_path / "kvindex.yaml"
    path.write_text(config)
    loaded = load_config(path)
    assert [e.name for e in loaded.engines] == ["vllm-a"]
    assert loaded.engines[0].rank_endpoint(1, replay=True) == "tcp://10.0.0.5:5559"
    assert loaded.api_settings().auth_token == "change-me"
    assert [u.name for u in loaded.url_engines()] == ["10.0.0.6:8100", "vllm-c"]


def kvindex_commands() -> list[list[str]]:
    commands = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("kvindex"):
                commands.append(words[1:])
    return commands


@pytest.mark.parametrize("argv", kvindex_commands(), ids=" ".join)
def test_readme_commands_parse(argv: list[str]) -> None:
    args = parse_args(argv)
    assert args.command == argv[0]


def test_readme_shows_serve_and_replay() -> None:
    assert {argv[0] for argv in kvindex_commands()} >= {"serve", "replay"}
