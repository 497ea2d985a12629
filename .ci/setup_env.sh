#!/usr/bin/env bash
# Create or reuse the test environment in the cache dir and print the venv path:
#   $BIGDIT_CACHE/venv            Python venv with .ci/requirements.txt
#   $BIGDIT_CACHE/comfyui-0.3.75  ComfyUI source (tests/comfy_harness.py: ensure_comfyui)
# BIGDIT_CACHE defaults to ~/.cache/bigdit; BIGDIT_PYTHON picks the interpreter
# for a new venv (default python3.11, else python3). Progress goes to stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export BIGDIT_CACHE=${BIGDIT_CACHE:-$HOME/.cache/bigdit}
VENV=$BIGDIT_CACHE/venv
REQS=$ROOT/.ci/requirements.txt

if [ ! -x "$VENV/bin/python" ]; then
    PYTHON=${BIGDIT_PYTHON:-$(command -v python3.11 || command -v python3)}
    echo "creating $VENV with $PYTHON" >&2
    mkdir -p "$BIGDIT_CACHE"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the pinned requirements changed.
STAMP=$VENV/.bigdit-requirements.sha256
WANT=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "installing $REQS" >&2
    "$VENV/bin/python" -m pip install -q --no-input --disable-pip-version-check -r "$REQS" >&2
    echo "$WANT" > "$STAMP"
fi

# Debian's Chromium for the browser test of the web extension (skipped without it).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing chromium" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2 || echo "chromium install failed" >&2
fi

"$VENV/bin/python" "$ROOT/tests/comfy_harness.py" >&2
echo "$VENV"
