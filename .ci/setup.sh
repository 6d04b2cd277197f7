#!/usr/bin/env bash
# Set up everything gemini needs on a fresh machine; safe to run again (it skips what is there).
#   bash .ci/setup.sh          -> .venv with torch (CPU build, pinned), gemini, numpy
#   bash .ci/setup.sh test     -> the same plus the test tools and an etcd server binary
#   bash .ci/setup.sh compat   -> the test tools without the frameworks (GEMINI_TORCH_VERSION=newest:
#                                 the newest torch the package index offers)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GEMINI_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${GEMINI_TORCH_VERSION:-2.13.0}"
WHAT="${1:-demo}"

say() { printf '[setup] %s\n' "$*" >&2; }

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    say "gemini needs Python >= 3.10 (found: $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.x"
    exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment $VENV"
    if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        say "the venv module is missing: installing Debian's python3-venv"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
        "$PYTHON" -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if [ "$TORCH_VERSION" = newest ]; then  # tests/run.sh compat: the newest torch on the index
    say "installing the newest torch"
    "${PIP[@]}" install --upgrade torch
elif ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    say "installing torch==$TORCH_VERSION"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
EXTRAS=""
[ "$WHAT" = test ] && EXTRAS="[test,frameworks]"
[ "$WHAT" = compat ] && EXTRAS="[test]"
say "installing gemini (editable) and its dependencies"
"${PIP[@]}" install numpy -e "$ROOT$EXTRAS"

if [ "$WHAT" != demo ] && ! command -v etcd >/dev/null 2>&1; then
    say "installing etcd (Debian package etcd-server)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client >/dev/null
fi
say "ready: $VENV"
