#!/usr/bin/env bash
# Tests start their own redis-server processes; make sure the binaries exist.
set -euo pipefail
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
    && command -v redis-benchmark >/dev/null; then
    exit 0
fi
echo "installing redis-server and redis-tools from Debian's packages" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
