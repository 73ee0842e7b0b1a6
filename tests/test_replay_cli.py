"""`kvindex replay` end to end: a subprocess, a fixture trace, vLLM's answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import (
    HYBRID_TRACE_NAMES,
    TRACE_NAMES,
    expected_path,
    load_expected_json,
    probe_answers,
    trace_path,
)


def run_replay(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvindex.cli", "replay", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", TRACE_NAMES + HYBRID_TRACE_NAMES)
def test_replay_answers_like_vllm(name: str) -> None:
    report = run_replay(str(trace_path(name)), "--probe", str(expected_path(name)))
    expected = load_expected_json(name)
    assert report["blocks"] == {
        "GPU": len(expected["expected"]["gpu_refcounts"]),
        "CPU": len(expected["expected"]["cpu_refcounts"]),
        "STORAGE": 0,
    }
    assert report["anomalies"] == {"unknown_removals": 0}
    assert report["probes"] == probe_answers(expected)


def test_replay_without_probes_reports_blocks_only() -> None:
    report = run_replay(str(trace_path("chat-gpu-only")))
    assert report["probes"] == []
    assert report["blocks"]["GPU"] > 0


def test_replay_of_a_missing_file_fails_clearly(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvindex.cli", "replay", str(tmp_path / "none.msgpack")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "none.msgpack" in done.stderr
