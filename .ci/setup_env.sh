#!/usr/bin/env bash
# Create or reuse the test environments in the cache dir and print the first venv's path:
#   $BIGDIT_CACHE/venv                  Python venv with .ci/requirements.txt (runs pytest and ComfyUI 0.3.75)
#   $BIGDIT_CACHE/comfyui-0.3.75        ComfyUI 0.3.75 source
#   $BIGDIT_CACHE/venv-comfyui-0.33.0   Python venv for upstream ComfyUI 0.33.0: .ci/requirements-comfyui-0.33.0.txt
#                                       together with that host's own requirements.txt
#   $BIGDIT_CACHE/comfyui-0.33.0        its source, from shared/hosts/ beside the repository ($BIGDIT_SHARED);
#                                       without it this host is skipped with one line saying so (an error when CI is set)
# (tests/comfy_harness.py: HOSTS), and Debian's Chromium for the browser tests when run as root.
# --demo: only what `bash .ci/demo` runs: the first venv with .ci/requirements-demo.txt (a part of
# .ci/requirements.txt) and ComfyUI 0.3.75's source.
# BIGDIT_CACHE defaults to ~/.cache/bigdit; BIGDIT_PYTHON picks the interpreter for a new venv
# (default python3.11, else python3). Progress goes to stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export BIGDIT_CACHE=${BIGDIT_CACHE:-$HOME/.cache/bigdit}
PYTHON=${BIGDIT_PYTHON:-$(command -v python3.11 || command -v python3)}
DEMO=false
case "${1:-}" in
    --demo) DEMO=true ;;
    "") ;;
    *) echo "usage: $0 [--demo]" >&2; exit 2 ;;
esac

# requirements_hash FILE...: what a venv's stamp holds once these files are installed.
requirements_hash() { cat "$@" | sha256sum | cut -d' ' -f1; }

# make_venv VENV STAMP REQUIREMENTS...: create VENV if missing; (re)install only when the
# requirements changed since VENV/STAMP was written. Every file is hashed (also one another includes).
make_venv() {
    local venv=$1 stamp=$1/$2 want args=(); shift 2
    if [ ! -x "$venv/bin/python" ]; then
        echo "creating $venv with $PYTHON" >&2
        mkdir -p "$BIGDIT_CACHE"
        "$PYTHON" -m venv "$venv"
    fi
    want=$(requirements_hash "$@")
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        for reqs in "$@"; do args+=(-r "$reqs"); done
        echo "installing into $venv: $*" >&2
        "$venv/bin/python" -m pip install -q --no-input --disable-pip-version-check "${args[@]}" >&2
        echo "$want" > "$stamp"
    fi
}

VENV=$BIGDIT_CACHE/venv
TEST_REQUIREMENTS=("$ROOT/.ci/requirements.txt" "$ROOT/.ci/requirements-demo.txt")

if $DEMO; then
    # The tests' venv holds the demo's packages too.
    if [ "$(cat "$VENV/.bigdit-requirements.sha256" 2>/dev/null)" != "$(requirements_hash "${TEST_REQUIREMENTS[@]}")" ]; then
        make_venv "$VENV" .bigdit-demo-requirements.sha256 "$ROOT/.ci/requirements-demo.txt"
    fi
    "$VENV/bin/python" "$ROOT/tests/comfy_harness.py" --only 0.3.75 >/dev/null
    echo "$VENV"
    exit 0
fi

make_venv "$VENV" .bigdit-requirements.sha256 "${TEST_REQUIREMENTS[@]}"

# Debian's Chromium for the browser test of the web extension (skipped without it).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing chromium" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2 || echo "chromium install failed" >&2
fi

# The hosts' sources (a missing one is reported, or fails under CI), then the second host's venv
# from its own requirements.txt.
hosts=$("$VENV/bin/python" "$ROOT/tests/comfy_harness.py")
if grep -qx 0.33.0 <<<"$hosts"; then
    make_venv "$BIGDIT_CACHE/venv-comfyui-0.33.0" .bigdit-requirements.sha256 \
        "$ROOT/.ci/requirements-comfyui-0.33.0.txt" "$BIGDIT_CACHE/comfyui-0.33.0/requirements.txt"
fi
echo "$VENV"
