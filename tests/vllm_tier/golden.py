"""Write the golden data of the vLLM release in this venv (as ``shared/fixtures``
holds 0.33.0's): ``wire/``, ``hash_vectors.json`` (:mod:`.golden_vectors`) and the
chat and hybrid traces (:mod:`.golden_traces`). In the tier's venv (``scripts/vllm-tier.sh
VERSION`` builds it)::

    PYTHONPATH=$PWD ~/.cache/kvindex/vllm-0.34.0-venv/bin/python \\
        -m tests.vllm_tier.golden tests/fixtures/vllm-0.34.0

Trace names after the folder write those traces alone (``traces/`` only): 0.33.0's
traces that ``shared/fixtures`` lacks go to ``tests/fixtures/vllm-0.33.0-extra`` so::

    PYTHONPATH=$PWD ~/.cache/kvindex/vllm-0.33.0-venv/bin/python \
        -m tests.vllm_tier.golden tests/fixtures/vllm-0.33.0-extra mamba-partial-tail

``tests/vllm_tier/test_golden.py`` checks that the wire and hash files in the
checkout are what the release's code writes; the main suite checks kvindex against
all of them.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.vllm_tier.conftest import TINY_LLAMA  # first: it sets vLLM's environment


def write(out: Path, names: list[str]) -> None:
    """Every golden file into ``out``, or the traces ``names`` alone."""
    from tests.vllm_tier.golden_traces import TRACES, record
    from tests.vllm_tier.golden_vectors import hash_vectors_text, wire_files

    (out / "traces").mkdir(parents=True, exist_ok=True)
    if not names:
        (out / "wire").mkdir(exist_ok=True)
        for name, data in wire_files().items():
            (out / name).write_bytes(data)
        (out / "hash_vectors.json").write_text(hash_vectors_text())
    unknown = set(names) - {trace.name for trace in TRACES}
    assert not unknown, f"no such trace: {sorted(unknown)}"
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
        for trace in (t for t in TRACES if not names or t.name in names):
            frames, expected = record(model_dir, trace)
            (out / "traces" / f"{trace.name}.frames.msgpack").write_bytes(frames)
            (out / "traces" / f"{trace.name}.expected.json").write_text(expected)


if __name__ == "__main__":
    write(Path(sys.argv[1]), sys.argv[2:])
