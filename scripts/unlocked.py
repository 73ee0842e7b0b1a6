"""The versions ``make test-latest`` and ``make test-floors`` run, against the lock's.

Run with a venv's python (``packaging`` is needed)::

    python scripts/unlocked.py floors            # pyproject.toml's floors, as constraints
    python scripts/unlocked.py drift locks/dev.txt

``floors`` prints ``name==floor`` for each lower bound of kvindex's runtime
dependencies and its ``tokenize`` extra (what a user installs kvindex with; the test
tools are left to resolve): installing with them as constraints runs the tests on the
oldest releases the ranges admit. ``drift`` prints each installed package whose version
is not one the lock pins; it always exits 0: it reports, the tests that follow judge.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: a pinned line of a uv/pip-compile lock: ``name==version`` (markers and hashes follow)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def floors() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["tokenize"]
    return [
        f"{req.name}=={spec.version}"
        for req in map(Requirement, lines)
        for spec in req.specifier
        if spec.operator == ">="
    ]


def pinned(lock: Path) -> dict[str, set[str]]:
    """Every version the lock pins per package (a universal lock may pin one per marker)."""
    pins: dict[str, set[str]] = {}
    for line in lock.read_text().splitlines():
        if match := PIN.match(line):
            pins.setdefault(canonicalize_name(match[1]), set()).add(match[2])
    return pins


def drift(lock: str) -> list[str]:
    pins = pinned(Path(lock))
    lines = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name != "kvindex" and dist.version not in pins.get(name, set()):
            was = " or ".join(sorted(pins[name])) if name in pins else "not in the lock"
            lines.append(f"  {name} {dist.version} (lock: {was})")
    return [f"{len(lines)} packages differ from {lock}", *sorted(lines)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["floors"]:
        print("\n".join(floors()))
    elif argv[:1] == ["drift"] and len(argv) == 2:
        print("\n".join(drift(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
