#!/usr/bin/env bash
# tests/test_compose.py validates docker-compose.yml with Debian's docker-compose
# (it checks the file against the compose specification without a Docker daemon).
set -euo pipefail
if command -v docker-compose >/dev/null; then
    exit 0
fi
echo "installing docker-compose from Debian's packages" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker-compose >/dev/null
