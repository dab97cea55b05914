#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (every marker: unit, engine, API, slow, interop).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`; `-n 0` runs in one process (`-s`, pdb).
# Two pytest-xdist workers by default (PEREGRINE_TEST_WORKERS): on two cores the suite alone keeps about one busy.
# Each test file runs whole on one worker (`--dist loadfile`), so a module's server starts once; tests/conftest.py
# keeps the Ray files on one worker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-ray >&2  # the Ray Serve tests are part of the suite
exec "${PEREGRINE_VENV:-.venv}/bin/python" -m pytest -q --durations=25 -m "" \
    -n "${PEREGRINE_TEST_WORKERS:-2}" --dist loadfile "$@"
