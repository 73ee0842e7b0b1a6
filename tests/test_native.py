"""The compiled core is the one in use, and kvindex says so loudly when it is not.

``test_the_compiled_core_is_in_use`` fails the run when the extension did not
build: CI runs ``make test``, so what CI tests is the compiled core. There is
no opt-out.
"""

from __future__ import annotations

import logging
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import SimpleNamespace

import pytest

from indexer.engines.vllm import hashing, native

from .apikit import Api
from .conftest import REPO, run_without, serve_warning_without

EXTENSION = "indexer.engines.vllm._chainhash"


def test_the_compiled_core_is_in_use() -> None:
    assert native.PART.available, f"the compiled core did not build or load: {native.PART.error}"
    assert native.PART.error is None
    module_file = Path(native.chainhash.__file__)
    assert module_file.parent == REPO / "indexer" / "engines" / "vllm"
    assert any(module_file.name.endswith(suffix) for suffix in EXTENSION_SUFFIXES)


def test_block_hashes_runs_on_the_compiled_core(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    compiled = native.chainhash

    def chain(*args):
        calls.append(args[0])
        return compiled.chain(*args)

    monkeypatch.setattr(native, "chainhash", SimpleNamespace(chain=chain))
    for algo in hashing.HASH_ALGOS:
        spec = hashing.HashSpec(algo, "0", 4)
        want = hashing.block_hashes(spec, range(12), compiled=False)
        assert hashing.block_hashes(spec, range(12)) == want
    assert calls == list(hashing.HASH_ALGOS)


def test_without_the_extension_hashes_stay_exact_and_status_says_why() -> None:
    script = (
        "import json\n"
        "from indexer.engines.vllm import native\n"
        "from indexer.engines.vllm.hashing import HashSpec, block_hashes\n"
        "print(json.dumps([native.PART.status(), block_hashes(HashSpec('sha256', None, 16), "
        "list(range(48)))]))\n"
    )
    spec = hashing.HashSpec("sha256", None, 16)
    want = hashing.block_hashes(spec, list(range(48)), compiled=False)
    assert run_without(EXTENSION, script) == want


def test_serve_warns_on_start_without_the_extension() -> None:
    assert serve_warning_without(EXTENSION).startswith("compiled core not in use")


def test_warning_is_silent_when_the_core_is_in_use(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvindex.native"):
        assert native.PART.warn_if_unavailable("serve") is True
    assert caplog.records == []


async def test_stats_report_whether_the_compiled_core_is_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = Api()
    try:
        stats = (await api.client.get("/stats")).json()
        assert stats["compiled_core"] is True
        assert stats["compiled_core_error"] is None
        monkeypatch.setattr(native.PART, "module", None)
        monkeypatch.setattr(native.PART, "error", "ImportError: no _chainhash")
        stats = (await api.client.get("/stats")).json()
        assert stats["compiled_core"] is False
        assert stats["compiled_core_error"] == "ImportError: no _chainhash"
    finally:
        await api.close()
