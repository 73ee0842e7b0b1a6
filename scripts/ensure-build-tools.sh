#!/usr/bin/env bash
# pip install builds kvindex's compiled core (Cython -> C): it needs a C compiler,
# Python's headers, OpenSSL's libcrypto headers (SHA-256) and xxhash's header (XXH3).
# Install what is missing.
set -euo pipefail
PYTHON="${1:-python3}"
CC="${CC:-cc}"
missing=()
compiles() {  # does a C file including $1 preprocess with the include dirs given?
    local header="$1"
    shift
    echo "#include <$header>" | "$CC" -E -x c - "$@" >/dev/null 2>&1
}
if ! command -v "$CC" >/dev/null; then
    missing+=(gcc libssl-dev libxxhash-dev)
else
    compiles openssl/sha.h || missing+=(libssl-dev)
    compiles xxhash.h || missing+=(libxxhash-dev)
    include="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    if ! compiles Python.h "-I$include"; then
        version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        missing+=("python$version-dev")
    fi
fi
[ "${#missing[@]}" -eq 0 ] && exit 0
echo "installing ${missing[*]} from Debian's packages (to build the compiled core)" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
