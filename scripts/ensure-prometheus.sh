#!/usr/bin/env bash
# tests/test_prometheus.py runs a real Prometheus (Debian's package) that scrapes
# a running kvindex and answers every dashboard panel's query; make sure it exists.
set -euo pipefail
if command -v prometheus >/dev/null; then
    exit 0
fi
echo "installing prometheus from Debian's packages" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
# The package's service is not wanted (the test starts its own server): no daemon start.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
