"""``--profile``: pyinstrument profiles of the two hot paths, as text next to the report.

Ingest (decode + plan + apply of the fleet's stream into a MemoryStore) and
query (512-block prefix matches over the fleet's store): where the time goes,
function by function, to guide the next optimisation.
"""

from __future__ import annotations

from pathlib import Path

from pyinstrument import Profiler

from bench.fleet import CHUNK_BLOCKS, Fleet, rank_of
from bench.ingest import kvindex
from bench.query import ours
from indexer.stores import MemoryStore


def _profiled(fn, out: Path) -> str:
    profiler = Profiler(interval=0.0002)
    profiler.start()
    fn()
    profiler.stop()
    out.write_text(profiler.output_text(unicode=False, show_all=False))
    return out.name


def run(fleet: Fleet, store: MemoryStore, stream: list, out: Path) -> list[str]:
    listed = {rank_of(e).engine: CHUNK_BLOCKS for e in range(fleet.config.engines)}
    match, chains = ours(store, listed), fleet.chains(512, 50)

    def queries() -> None:
        for _ in range(10):
            for chain in chains:
                match(chain)

    return [
        _profiled(lambda: kvindex(stream), out / "profile-ingest.txt"),
        _profiled(queries, out / "profile-query.txt"),
    ]
