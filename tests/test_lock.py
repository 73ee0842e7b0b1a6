"""The lock (``locks/``) covers what pyproject.toml asks for, and agrees with itself.

``make test``, ``make demo``, CI and the Dockerfile install from the lock alone
(``--no-deps``): a requirement added to pyproject.toml without ``make lock`` would
be missing there, or a pin outside its range would be installed; this says which.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.unlocked import pinned

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(lock: str) -> dict[str, set[str]]:
    return pinned(LOCKS / lock)


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's build requirements, dependencies and the extras named (not
    kvindex's own extras, which are expanded where they are named)."""
    lines = [*PROJECT["build-system"]["requires"], *PROJECT["project"]["dependencies"]]
    for extra in extras:
        lines += PROJECT["project"]["optional-dependencies"][extra]
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) != "kvindex"]


@pytest.mark.parametrize(
    ("lock", "extras"), [("dev.txt", ("test", "tokenize", "bench")), ("service.txt", ())]
)
def test_the_lock_pins_every_requirement_within_its_range(lock: str, extras) -> None:
    locked = pins(lock)
    wrong = [
        f"{r} (lock: {sorted(locked.get(canonicalize_name(r.name), [])) or 'missing'})"
        for r in requirements(*extras)
        if not any(r.specifier.contains(v) for v in locked.get(canonicalize_name(r.name), []))
    ]
    assert not wrong, f"run `make lock`: {wrong}"


def test_the_service_lock_is_the_dev_locks_versions() -> None:
    """The image runs what the tests ran."""
    dev = pins("dev.txt")
    differ = {name: v for name, v in pins("service.txt").items() if not v <= dev.get(name, set())}
    assert not differ, differ
