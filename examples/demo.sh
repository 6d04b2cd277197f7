#!/usr/bin/env bash
# The gemini demo on a fresh machine: sets up .venv (torch CPU build, gemini), then trains
# the example GPT under `gemini run`, kills a worker mid-run and shows the recovery.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/.ci/setup.sh"
exec "${GEMINI_VENV:-$ROOT/.venv}/bin/python" "$ROOT/examples/demo.py" "$@"
