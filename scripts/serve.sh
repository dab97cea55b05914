#!/usr/bin/env bash
# Set up if needed, then serve. With no flags: the bundled SmolLM2-135M-Instruct on http://127.0.0.1:8000.
#   bash scripts/serve.sh --model Qwen/Qwen2.5-7B-Instruct --device cuda --dtype bfloat16
# Every flag is listed by `bash scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2  # setup talk on stderr: stdout is the server's (e.g. --help)
exec "${PEREGRINE_VENV:-.venv}/bin/python" main.py "$@"
