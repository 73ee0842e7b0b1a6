"""Whether ingest scans payloads in C (``_frames``), and if not, why.

The scanner is a Cython module built at install time. Without it every payload
goes through msgspec (:func:`indexer.engines.vllm.wire.decode_indexed`): the
same batches, only several times slower, so a missing build is said loudly:
every role warns on start (the adapter's compiled part) and ``/stats``
reports it. ``tests/test_frames.py`` fails the run when the build is missing.
"""

from __future__ import annotations

from collections.abc import Callable

from indexer.compiled import CompiledModule
from indexer.core.events import EventBatch
from indexer.engines.base import MAX_HASHES_PER_EVENT

PART = CompiledModule(
    "indexer.engines.vllm._frames",
    "compiled payload scanner not in use: ingest decodes through msgspec, several "
    "times slower; reinstall with a C compiler (pip install -e .)",
)
#: The compiled scanner's module, or None when it did not build or load.
scanner = PART.module


def index_decoder(
    stored: type, removed: type, cleared: type, batch: type
) -> Callable[[bytes], EventBatch | None] | None:
    """The compiled ``payload -> batch for the index, or None`` (None: msgspec must
    decode it), building these classes positionally (in the order of ``_frames``'
    field numbers: ``tests/test_frames.py`` fails if a field moves); None without
    the build."""
    if scanner is None:
        return None
    return scanner.IndexDecoder(stored, removed, cleared, batch, MAX_HASHES_PER_EVENT)
