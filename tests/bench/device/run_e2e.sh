#!/usr/bin/env bash
# On the GPU machine, from the repository root, with the host's bundle carried (tests/bench/device/prepare.py made it):
#   bash tests/bench/device/run_e2e.sh [--host 0.3.75|0.33.0] [comfy_e2e.py options]
#   bash tests/bench/device/run_e2e.sh --host 0.33.0 --job [whole_job.py options]   # the whole-job benchmark
#   bash tests/bench/device/run_e2e.sh --host 0.33.0 --vae [vae_decode.py options]   # the video VAE's decode, profiled
#   bash tests/bench/device/run_e2e.sh --unpack-only   # the carried bundles (and SageAttention 2) only, e.g. for pytest -m gpu
# --host picks the ComfyUI: 0.3.75 (the default) from .e2e/, upstream 0.33.0 from .e2e-033/. Unpacks every carried
# .e2e*/bundle.tar.xz into $E2E_ROOT/e2e* (/tmp by default; skipped when the same bundle is already there, as on
# a machine still warm from the last call), puts the host's site/, fa3-fwd's (/tmp/e2e-fa3, if unpacked) and the
# PyAV stub on PYTHONPATH (and SageAttention 2, built from a carried .sage2/), and runs tests/bench/comfy_e2e.py with that host's ComfyUI, writing the results JSON, its
# .log and this run's output into $OUT. Without the host's bundle (a first call that carries only .e2e-fa3/) it
# unpacks and stops. The model file and the servers' folders go to $E2E_WORK, by default on the disk filesystem
# (not tmpfs) with the most room among /tmp and the repository's parent folder. --job runs tests/bench/whole_job.py
# instead (upstream 0.33.0 only), with .e2e-job/'s PyAV first on PYTHONPATH and its tokenizer data copied into the
# host's source (a Python older than 3.12, as in the check here, keeps its own PyAV), in memory cgroups where the
# machine allows (--ram-cgroup), its budget counted from this script's start (E2E_STARTED).
set -euo pipefail
: "${OUT:?OUT must name the folder for the results}"
host=0.3.75 job= vae= unpack_only=
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host=${2:?--host needs a version}; shift 2 ;;
    --job) job=1; shift ;;
    --vae) vae=1; shift ;;
    --unpack-only) unpack_only=1; shift ;;
    *) break ;;
  esac
done
if [ -n "$job$vae" ] && [ "$host" != 0.33.0 ]; then echo "run_e2e.sh: --job and --vae need --host 0.33.0" >&2; exit 2; fi
case "$host" in
  0.3.75) own=.e2e ;;
  0.33.0) own=.e2e-033 ;;
  *) echo "run_e2e.sh: unknown --host $host (0.3.75 or 0.33.0)" >&2; exit 2 ;;
esac
root=${E2E_ROOT:-/tmp}
PY=${PYTHON:-python3}
t0=$(date +%s)
export E2E_STARTED=$t0
for bundle in .e2e*/bundle.tar.xz; do
  [ -e "$bundle" ] || continue
  folder=$(dirname "$bundle"); dest=$root/${folder#.}
  if ! cmp -s "$folder/bundle.sha256" "$dest/bundle.sha256"; then
    rm -rf "$dest" && mkdir -p "$dest"
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$bundle" "$dest"
    cp "$folder/bundle.sha256" "$dest/bundle.sha256"
  fi
  echo "$bundle ready in $dest after $(( $(date +%s) - t0 )) s"
done
# SageAttention 2 (issue 22): built once per machine from a carried .sage2/ (its source tarball and build-sage2.sh,
# README section 4), about two minutes for SAGE_ARCHS=9.0; skipped when the same source is already built there
# A wheel built by an earlier call (it came back in $OUT) and carried in .sage2/ is installed instead of building.
if [ -e .sage2/build-sage2.sh ] || ls .sage2/sageattention-*.whl > /dev/null 2>&1; then
  src=$(ls .sage2/sageattention-*.whl .sage2/SageAttention-*.tar.gz 2>/dev/null | head -1 || true)
  dest=$root/e2e-sage2
  if ! { [ -d "$dest/site/sageattention" ] && sha256sum < "$src" | cmp -s - "$dest/source.sha256"; }; then
    rm -rf "$dest" && mkdir -p "$dest/wheel"
    if [ "${src%.whl}" != "$src" ]; then
      cp "$src" "$dest/wheel/"
    elif ! bash .sage2/build-sage2.sh "$src" "$dest/wheel" > "$dest/build.log" 2>&1; then
      tail -40 "$dest/build.log"; cp "$dest/build.log" "$OUT/sage2-build.log"; exit 1
    fi
    cp "$dest"/wheel/sageattention-*.whl "$OUT/" 2>/dev/null || true
    "$PY" -m pip install --no-deps --no-index --target "$dest/site" "$dest"/wheel/sageattention-*.whl > /dev/null
    sha256sum < "$src" > "$dest/source.sha256"
  fi
  echo "SageAttention 2 ($(ls "$dest"/wheel)) ready in $dest/site after $(( $(date +%s) - t0 )) s"
fi
if [ -n "$unpack_only" ] || [ ! -e "$own/bundle.tar.xz" ]; then
  echo "unpacked only (--unpack-only, or no $own/ carried for ComfyUI $host)"; exit 0
fi
site=$root/${own#.}/site
if [ -z "$job" ]; then
  site=$PWD/tests/bench/device/stubs:$site
else  # the job writes a video: the bundle's PyAV (a Python 3.12 build; an older Python keeps its own), no stub
  site=$root/e2e-job/site:$site
  if "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then site=$root/e2e-job/site-py312:$site; fi
fi
[ -d "$root/e2e-sage2/site" ] && site=$root/e2e-sage2/site:$site  # first: it shadows any sageattention 1.x
[ -d "$root/e2e-fa3/site" ] && site=$site:$root/e2e-fa3/site
if [ -z "${E2E_WORK:-}" ]; then
  best=/tmp; room=-1
  for d in /tmp "$(dirname "$PWD")"; do
    read -r fs avail < <(df -PTk "$d" | awk 'NR==2 {print $2, $5}')
    if [ "$fs" != tmpfs ] && [ "$avail" -gt "$room" ]; then best=$d; room=$avail; fi
  done
  E2E_WORK=$best/bigdit-e2e-work
fi
echo "PYTHONPATH gets $site; work in $E2E_WORK"
df -hT /tmp "$(dirname "$E2E_WORK")" | uniq; free -g | head -2
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "$job" ]; then
  if [ ! -d "$root/e2e-job/comfyui" ]; then echo "no .e2e-job/ carried (prepare.py --job)" >&2; exit 2; fi
  cp -r "$root/e2e-job/comfyui/." "$root/${own#.}/comfyui/"
  "$PY" tests/bench/whole_job.py --comfyui "$root/${own#.}/comfyui" --work "$E2E_WORK" --out-dir "$OUT" \
    --ram-cgroup "$@" 2>&1 | tee "$OUT/whole-job-stdout.log"
  exit "${PIPESTATUS[0]}"
fi
if [ -n "$vae" ]; then
  "$PY" tests/bench/vae_decode.py --comfyui "$root/${own#.}/comfyui" --work "$E2E_WORK" --out-dir "$OUT" "$@" 2>&1 \
    | tee "$OUT/vae-decode-stdout.log"
  exit "${PIPESTATUS[0]}"
fi
"$PY" tests/bench/comfy_e2e.py --comfyui "$root/${own#.}/comfyui" --work "$E2E_WORK" --out-dir "$OUT" "$@" 2>&1 \
  | tee "$OUT/comfy-e2e-stdout.log"
