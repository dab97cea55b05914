#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (every marker: unit, engine, API, slow, interop).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-ray >&2  # the Ray Serve tests are part of the suite
exec "${PEREGRINE_VENV:-.venv}/bin/python" -m pytest -q --durations=25 -m "" "$@"
