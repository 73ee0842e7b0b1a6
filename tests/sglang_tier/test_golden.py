"""The checked-in golden traces are what SGLang 0.5.23's own code produces today.

Recording again (``record.py``, SGLang's radix cache and ZMQ publisher) must give
the same batches, frame for frame but for each batch's wall-clock ``ts``, the
same answers and the same hashes: so the main suite, which checks kvindex
against these files, checks it against SGLang.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from tests.sglang_tier import record

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / f"sglang-{record.VERSION}"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sglang")
    record.main_into(out)
    return out


def _untimed(path: Path) -> list[tuple[int, list]]:
    """A trace's seqs and batches without their ts."""
    trace = msgspec.msgpack.decode(path.read_bytes())
    return [(seq, msgspec.msgpack.decode(payload)[1:]) for seq, payload in trace]


@pytest.mark.parametrize("work", record.WORKLOADS, ids=lambda w: w.name)
def test_sglang_records_the_checked_in_trace(recorded: Path, work: record.Workload) -> None:
    frames = f"{work.name}.frames.msgpack"
    assert _untimed(recorded / frames) == _untimed(FIXTURES / frames)
    expected = f"{work.name}.expected.json"
    want = json.loads((FIXTURES / expected).read_text())
    assert json.loads((recorded / expected).read_text()) == want
    assert want["batches"] == len(_untimed(FIXTURES / frames)) > 1
    assert any(p["device_prefix_len"] > 0 for p in want["probes"])
    assert any(p["device_prefix_len"] == 0 for p in want["probes"])


def test_sglang_hashes_the_checked_in_vectors(recorded: Path) -> None:
    name = "hash_vectors.json"
    assert json.loads((recorded / name).read_text()) == json.loads((FIXTURES / name).read_text())


def test_the_eagle_trace_publishes_bigram_pages() -> None:
    """What kvindex's decoder takes as one token of lookahead per page."""
    events = [
        e for _, (events, _) in _untimed(FIXTURES / "page2-eagle.frames.msgpack") for e in events
    ]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and all(len(pair) == 2 for e in stored for pair in e["token_ids"])
