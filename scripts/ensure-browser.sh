#!/usr/bin/env bash
# tests/test_ui.py drives the operator page in a real headless browser: Debian's
# chromium and the chromedriver built from the same release (Selenium, from the
# `test` extra, is given the driver's path, so nothing is downloaded at run time).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
echo "installing chromium and chromium-driver from Debian's packages" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
