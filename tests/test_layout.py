"""The package layout stays one-way and readable: no import cycles, no huge modules.

``lint-imports`` (``make lint``) checks the layers between packages; these
tests check what its contracts do not: that no two modules of kvindex import
each other, directly or round a longer loop, and that no module outgrows what
a reviewer reads in one sitting (the benchmarks' and the tests' own included).
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvindex", "api", "producer", "indexer", "answers")
#: Every .py file under these folders is held to MAX_LINES.
LINE_BOUND = (*PACKAGES, "bench", "tests")
MAX_LINES = 450

#: Modules still over MAX_LINES, each with why; the list only shrinks.
OVERSIZED: dict[str, str] = {}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES)


def _cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every import loop among the modules, each as the chain of modules that closes it."""
    loops = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                loops.append((module, *back))
    return loops


def test_no_module_imports_itself_round_a_loop(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_loop() -> None:
    """The check above can fail: two modules importing each other are reported."""
    loop = grimp.ImportGraph()
    loop.add_import(importer="pkg.a", imported="pkg.b")
    loop.add_import(importer="pkg.b", imported="pkg.a")
    assert ("pkg.a", "pkg.b", "pkg.a") in _cycles(loop)


def test_indexer_and_api_import_no_higher_package(graph: grimp.ImportGraph) -> None:
    below = {"indexer": ("api", "producer", "kvindex"), "api": ("producer", "kvindex")}
    for low, highs in below.items():
        for high in highs:
            chain = graph.find_shortest_chain(importer=low, imported=high, as_packages=True)
            assert chain is None, f"{low} imports {high}: {' -> '.join(chain)}"


def _line_counts() -> dict[str, int]:
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for folder in LINE_BOUND
        for path in (REPO / folder).rglob("*.py")
    }


def test_no_module_is_over_the_line_limit() -> None:
    counts = _line_counts()
    oversized = {path for path, lines in counts.items() if lines > MAX_LINES}
    assert oversized <= OVERSIZED.keys(), f"over {MAX_LINES} lines: {oversized - OVERSIZED.keys()}"


def test_the_oversized_list_only_names_modules_still_oversized() -> None:
    """A module split below the limit leaves the list, so the list only shrinks."""
    counts = _line_counts()
    stale = {path for path in OVERSIZED if counts.get(path, 0) <= MAX_LINES}
    assert stale == set(), f"split or gone, remove from OVERSIZED: {stale}"
