#!/usr/bin/env bash
# make test-latest / make test-floors: the tests on other releases than the lock's, so an
# upstream release that breaks kvindex shows up as a report, not as a red CI on an unrelated
# change, and the floors pyproject.toml promises library and plugin users are known to work.
#   latest  the newest releases the ranges allow
#   floors  kvindex's runtime dependencies at their lower bounds (scripts/unlocked.py floors),
#           the test tools at whatever resolves beside them
# Runs in a copy of this checkout (its files as they are in the working tree, its own venv and
# compiled core) with ../shared beside it: .venv stays as the lock made it. Prints what differs
# from locks/dev.txt, then runs pytest (extra arguments go to pytest).
# Usage: scripts/test-unlocked.sh latest|floors [PYTEST-ARGS...]
set -euo pipefail
MODE=$1
shift
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
WORK=${TMPDIR:-/tmp}/kvindex-test-$MODE
echo "== test-$MODE: copying the checkout to $WORK/main"
rm -rf "$WORK/main"
mkdir -p "$WORK/main"
git ls-files -z --cached --others --exclude-standard |
    tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$WORK/main"
ln -sfn "$(cd ../shared && pwd)" "$WORK/shared"
cd "$WORK/main"
"$PYTHON" -m venv .venv
.venv/bin/pip install -q --upgrade pip packaging setuptools
case "$MODE" in
latest) constraints=() ;;
floors)
    .venv/bin/python scripts/unlocked.py floors >floors.txt
    constraints=(-c floors.txt)
    ;;
*) echo "usage: $0 latest|floors [PYTEST-ARGS...]" >&2 && exit 2 ;;
esac
echo "== test-$MODE: kvindex[test] into $WORK/main/.venv (minutes)"
.venv/bin/pip install -q -e '.[test]' "${constraints[@]}"
.venv/bin/python scripts/unlocked.py drift locks/dev.txt
echo "== test-$MODE: pytest on those releases"
exec .venv/bin/pytest -q "$@"
