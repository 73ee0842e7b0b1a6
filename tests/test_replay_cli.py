"""`kvindex replay` end to end: a subprocess, a fixture trace, vLLM's answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import (
    HYBRID_TRACE_NAMES,
    LOOKAHEAD_TRACE_NAMES,
    STORAGE_TRACE_NAMES,
    TAIL_TRACE_NAMES,
    TRACE_NAMES,
    expected_path,
    load_expected_json,
    probe_answers,
    trace_path,
)


def replay(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvindex.cli", "replay", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


def run_replay(*args: str) -> dict:
    return json.loads(replay(*args).stdout)


@pytest.mark.parametrize(
    "name",
    TRACE_NAMES
    + HYBRID_TRACE_NAMES
    + LOOKAHEAD_TRACE_NAMES
    + STORAGE_TRACE_NAMES
    + TAIL_TRACE_NAMES,
)
def test_replay_answers_like_vllm(name: str) -> None:
    done = replay(str(trace_path(name)), "--probe", str(expected_path(name)))
    report = json.loads(done.stdout)
    expected = load_expected_json(name)
    n = len(expected["probes"])
    assert done.stderr.splitlines() == [f"{n}/{n} probes match"]  # checked by kvindex itself
    assert report["blocks"] == {
        "GPU": len(expected["expected"]["gpu_refcounts"]),
        "CPU": len(expected["expected"]["cpu_refcounts"]),
        "STORAGE": len(expected["expected"].get("storage_refcounts", {})),
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


def test_replay_says_which_probes_do_not_match_and_fails(tmp_path) -> None:
    expected = load_expected_json("chat-sha256")
    probes = expected["probes"]
    probes[1]["gpu_tokens"] += 16  # vLLM "said" one block more
    wrong = tmp_path / "wrong.expected.json"
    wrong.write_text(json.dumps(expected))
    done = replay(str(trace_path("chat-sha256")), "--probe", str(wrong), check=False)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[-1] == f"{len(probes) - 1}/{len(probes)} probes match"
    assert lines[0].startswith("probe 1: kvindex {'gpu_tokens': ")
    assert f"vLLM {{'gpu_tokens': {probes[1]['gpu_tokens']}," in lines[0]
    assert json.loads(done.stdout)["probes"]  # the report is still printed


def test_probes_read_the_full_attention_group_by_its_kind(tmp_path) -> None:
    """A model listing its sliding-window group first: vLLM's per-group hits in that
    order, and the full-attention hit read from the group whose kind says so."""
    expected = load_expected_json("hybrid-sliding")
    groups = expected["engine"]["groups"]
    assert [g["kind"] for g in groups] == ["full_attention", "sliding_window"]
    groups.reverse()
    for probe in expected["probes"]:
        probe["gpu_tokens_by_group"].reverse()
    assert any(len(set(p["gpu_tokens_by_group"])) > 1 for p in expected["probes"])
    swapped = tmp_path / "sliding-first.expected.json"
    swapped.write_text(json.dumps(expected))
    done = replay(str(trace_path("hybrid-sliding")), "--probe", str(swapped))
    n = len(expected["probes"])
    assert done.stderr.splitlines() == [f"{n}/{n} probes match"]
