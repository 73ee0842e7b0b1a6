#!/usr/bin/env bash
# make test-latest: the tests on the newest releases pyproject.toml's ranges allow, not the lock's,
# so an upstream release that breaks kvindex shows up here as a report, not as a red CI on an
# unrelated change. Runs in a copy of this checkout (its files as they are in the working tree,
# its own venv and compiled core) with ../shared beside it: .venv stays as the lock made it.
# Prints what differs from locks/dev.txt, then runs pytest (extra arguments go to pytest).
# Usage: scripts/test-latest.sh [PYTHON] [PYTEST-ARGS...]
set -euo pipefail
PYTHON=${1:-python3}
shift || true
cd "$(dirname "$0")/.."
WORK=${KVINDEX_LATEST_DIR:-${TMPDIR:-/tmp}/kvindex-latest}
echo "== test-latest: copying the checkout to $WORK/main"
rm -rf "$WORK/main"
mkdir -p "$WORK/main"
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$WORK/main"
ln -sfn "$(cd ../shared && pwd)" "$WORK/shared"
cd "$WORK/main"
echo "== test-latest: the newest releases of kvindex[test] into $WORK/main/.venv (minutes)"
"$PYTHON" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[test]'
.venv/bin/python scripts/lock_drift.py locks/dev.txt
echo "== test-latest: pytest on those releases"
exec .venv/bin/pytest -q "$@"
