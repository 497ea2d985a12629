#!/usr/bin/env bash
# On the GPU machine, from the repository root: the `gpu` tests against upstream 0.33.0 (or ComfyUI 0.3.75's kitchen).
#   bash tests/bench/device/gpu_tests.sh [--host 0.33.0|0.3.75] [pytest arguments]
# A first call carries .e2e-job/ and .sage2/ with `run_e2e.sh --unpack-only` (PyAV, the tokenizer data, SageAttention
# 2); this one, within the 30 s the machine stays warm, carries the host's bundle (.e2e-033/, or .e2e/ for 0.3.75's
# comfy-kitchen 0.2.40 beside upstream 0.33.0's source, unpacked by an earlier call). It unpacks it, copies the
# tokenizer data into upstream's source, puts SageAttention 2, PyAV and the bundle's site-packages on PYTHONPATH and
# runs `pytest -m gpu tests`, its log into $OUT/gpu-tests-<gpu>-<date>-<commit>-kitchen<version>.log ($COMMIT names
# the commit where the copy has no .git).
set -euo pipefail
: "${OUT:?OUT must name the folder for the log}"
host=0.33.0
if [ "${1:-}" = --host ]; then host=${2:?--host needs a version}; shift 2; fi
root=${E2E_ROOT:-/tmp}
bash tests/bench/device/run_e2e.sh --host "$host" --unpack-only > /dev/null
case "$host" in
  0.33.0) site=$root/e2e-033/site ;;
  0.3.75) site=$root/e2e/site ;;
  *) echo "gpu_tests.sh: unknown --host $host" >&2; exit 2 ;;
esac
comfyui=$root/e2e-033/comfyui
[ -d "$comfyui" ] || { echo "gpu_tests.sh: no upstream 0.33.0 unpacked in $comfyui (carry .e2e-033 first)" >&2; exit 2; }
[ -d "$root/e2e-job/comfyui" ] && cp -r "$root/e2e-job/comfyui/." "$comfyui/"
path=$site
[ -d "$root/e2e-job/site" ] && path=$root/e2e-job/site-py312:$root/e2e-job/site:$path
[ -d "$root/e2e-sage2/site" ] && path=$root/e2e-sage2/site:$path
export PYTHONPATH="$path" BIGDIT_COMFYUI="$comfyui"
kitchen=$(python3 -c 'import importlib.metadata as m; print(m.version("comfy-kitchen"))')
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | sed 's/-80gb-hbm3//')
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo tree)}  # the copy there may have no .git
log="$OUT/gpu-tests-$gpu-$(date +%F)-$commit-kitchen$kitchen.log"
python3 -m pytest -m gpu tests -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$log" | tail -40
exit "${PIPESTATUS[0]}"
