#!/usr/bin/env bash
# Run gemini's whole test suite on a fresh machine: sets up .venv and etcd first.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k parity -x`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GEMINI_VENV:-$ROOT/.venv}"
bash "$ROOT/.ci/setup.sh" test
cd "$ROOT"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; failing on purpose" >&2
    exit 1
fi
exit "$rc"
