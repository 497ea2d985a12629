#!/usr/bin/env bash
# Create or reuse the test environments in the cache dir and print the first venv's path:
#   $BIGDIT_CACHE/venv                  Python venv with .ci/requirements.txt (runs pytest and ComfyUI 0.3.75)
#   $BIGDIT_CACHE/comfyui-0.3.75        ComfyUI 0.3.75 source
#   $BIGDIT_CACHE/venv-comfyui-0.33.0   Python venv for upstream ComfyUI 0.33.0: .ci/requirements-comfyui-0.33.0.txt
#                                       together with that host's own requirements.txt
#   $BIGDIT_CACHE/comfyui-0.33.0        its source, from shared/hosts/ beside the repository ($BIGDIT_SHARED)
# (tests/comfy_harness.py: HOSTS). BIGDIT_CACHE defaults to ~/.cache/bigdit; BIGDIT_PYTHON picks
# the interpreter for a new venv (default python3.11, else python3). Progress goes to stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export BIGDIT_CACHE=${BIGDIT_CACHE:-$HOME/.cache/bigdit}
PYTHON=${BIGDIT_PYTHON:-$(command -v python3.11 || command -v python3)}

# make_venv VENV REQUIREMENTS...: create VENV if missing; (re)install only when the requirements changed.
make_venv() {
    local venv=$1; shift
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating $venv with $PYTHON" >&2
        mkdir -p "$BIGDIT_CACHE"
        "$PYTHON" -m venv "$venv"
    fi
    local stamp=$venv/.bigdit-requirements.sha256 want args=()
    want=$(cat "$@" | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        for reqs in "$@"; do args+=(-r "$reqs"); done
        echo "installing into $venv: $*" >&2
        "$venv/bin/python" -m pip install -q --no-input --disable-pip-version-check "${args[@]}" >&2
        echo "$want" > "$stamp"
    fi
}

VENV=$BIGDIT_CACHE/venv
make_venv "$VENV" "$ROOT/.ci/requirements.txt"

# Debian's Chromium for the browser test of the web extension (skipped without it).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing chromium" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2 || echo "chromium install failed" >&2
fi

# Both hosts' sources, then the second host's venv from its own requirements.txt.
"$VENV/bin/python" "$ROOT/tests/comfy_harness.py" >&2
make_venv "$BIGDIT_CACHE/venv-comfyui-0.33.0" "$ROOT/.ci/requirements-comfyui-0.33.0.txt" \
    "$BIGDIT_CACHE/comfyui-0.33.0/requirements.txt"
echo "$VENV"
