"""Which installed packages differ from a lock: what ``make test-latest`` runs beyond it.

Run with the venv's python: ``python scripts/lock_drift.py locks/dev.txt``. Prints one line per
package whose installed version is not one the lock pins (or that the lock does not name);
always exits 0: it reports, the tests that follow judge.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

#: a pinned line of a uv/pip-compile lock: ``name==version`` (markers and hashes follow)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pinned(lock: Path) -> dict[str, set[str]]:
    """Every version the lock pins per package (a universal lock may pin one per marker)."""
    pins: dict[str, set[str]] = {}
    for line in lock.read_text().splitlines():
        if match := PIN.match(line):
            pins.setdefault(canonicalize_name(match[1]), set()).add(match[2])
    return pins


def main(lock: str) -> int:
    pins = pinned(Path(lock))
    drift = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name != "kvindex" and dist.version not in pins.get(name, set()):
            was = " or ".join(sorted(pins[name])) if name in pins else "not in the lock"
            drift.append(f"  {name} {dist.version} (lock: {was})")
    print(f"== test-latest: {len(drift)} packages differ from {lock}")
    print("\n".join(sorted(drift)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
