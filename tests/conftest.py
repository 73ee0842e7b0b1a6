"""Shared test fixtures: the golden data from vLLM 0.33.0 (../shared/fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "vllm-0.33.0"
TRACE_NAMES = ("chat-sha256", "chat-gpu-only", "chat-placeholders", "chat-clear")


def trace_path(name: str) -> Path:
    return FIXTURES / "traces" / f"{name}.frames.msgpack"


def expected_path(name: str) -> Path:
    return FIXTURES / "traces" / f"{name}.expected.json"


def load_expected_json(name: str) -> dict:
    return json.loads(expected_path(name).read_text())


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"golden fixtures missing: {FIXTURES} (clone with ../shared beside it)")
    return FIXTURES
