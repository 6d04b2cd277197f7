#!/usr/bin/env bash
# Run gemini's whole test suite on a fresh machine: sets up .venv and etcd first.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k parity -x`; a first argument
# `unit` or `integration` runs only tests/unit (seconds) or tests/integration, e.g.
# `bash tests/run.sh unit -x`; `compat` runs the unit tests and a kill-and-resume test on
# the newest torch the package index offers (in .venv-compat); `long` runs the tests that
# take many minutes each or repeat cases others cover (marked `long`, left out of every
# other run).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = compat ]; then
    # The unit tests (among them the check of every torch internal gemini relies on) and a
    # kill-and-resume run, on the newest torch the package index offers, in .venv-compat.
    export GEMINI_VENV="${GEMINI_VENV:-$ROOT/.venv-compat}" GEMINI_TORCH_VERSION=newest
    bash "$ROOT/.ci/setup.sh" compat
    cd "$ROOT"
    "$GEMINI_VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
    exec "$GEMINI_VENV/bin/python" -m pytest -p no:xdist tests/unit \
        "tests/integration/test_checkpoint.py::test_kill_resumes_bitwise" "${@:2}"
fi
VENV="${GEMINI_VENV:-$ROOT/.venv}"
bash "$ROOT/.ci/setup.sh" test
cd "$ROOT"
if [ "$#" -gt 0 ] && { [ "$1" = unit ] || [ "$1" = integration ]; }; then
    set -- "tests/$1" "${@:2}"
elif [ "${1:-}" = long ]; then
    set -- tests -m long "${@:2}"
fi
set +e
# Two test processes (pytest-xdist; GEMINI_TEST_JOBS=N for more, 0 for one process): most
# integration tests wait on heartbeats, leases and restarts, not on the CPU.
JOBS="${GEMINI_TEST_JOBS:-2}"
PARALLEL=()
[ "$JOBS" != 0 ] && PARALLEL=(-n "$JOBS" --dist worksteal)
"$VENV/bin/python" -m pytest "${PARALLEL[@]}" --durations=60 "$@"
rc=$?
if [ "$rc" -eq 1 ] && [ "$JOBS" != 0 ]; then
    # A test that failed while another one ran beside it (both share two cores: timing)
    # runs once more alone; the suite fails if it fails again. Its first failure stays
    # above, in the log.
    echo "tests/run.sh: running the tests that failed in the parallel run again, alone" >&2
    "$VENV/bin/python" -m pytest --last-failed --last-failed-no-failures none "$@"
    rc=$?
fi
set -e
if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests; failing on purpose" >&2
    exit 1
fi
exit "$rc"
