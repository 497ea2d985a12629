"""Prepare, here, what the GPU machine needs for tests/bench/comfy_e2e.py and lacks: the ignored folder .e2e/.

    python tests/bench/device/prepare.py [--comfyui DIR] [--without-fa3]
    python tests/bench/device/prepare.py --host 0.33.0            # upstream ComfyUI: .e2e-033/

The GPU machine has python3 with torch, triton, safetensors, aiohttp, numpy and
the rest of ComfyUI's start-up imports, but no package registry. .e2e/bundle.tar.xz
holds the rest, xz-compressed (fa3-fwd's library shrinks 3x against its wheel):
- comfyui/: ComfyUI 0.3.75's source without its tests and tokenizer data (the run
  loads no text encoder);
- site/: comfy-kitchen 0.2.40 without its HIP backend, fa3-fwd 0.0.3 (Hopper
  FlashAttention, the `flash` configuration), torchsde 0.2.6 and trampoline 0.1.2
  (ComfyUI's k-diffusion samplers import them), unpacked from cp312 x86-64 wheels.
What 0.3.75's start-up imports and the run never calls is left out: the frontend package
(the server gets an empty --front-end-root), workflow templates and embedded docs
(ComfyUI logs their absence), alembic/SQLAlchemy (ComfyUI warns and runs without
its database), pydantic (only custom-node pyproject parsing), kornia and spandrel
(two image nodes fail to import); PyAV is stubbed by tests/bench/device/stubs/av,
which travels with the working tree.

`--host 0.33.0` packs upstream ComfyUI 0.33.0 instead, from shared/hosts/comfyui-0.33.0.tar.gz
beside the repository ($BIGDIT_SHARED; or --comfyui with an unpacked copy), into .e2e-033/:
its source (same cuts), comfy-kitchen 0.2.31 (the host's pin, without its HIP backend),
comfy-aimdo 0.4.13 (dynamic VRAM: its CUDA library aimdo.so, without the ROCm one),
torchsde and trampoline, and what upstream's server imports unconditionally:
SQLAlchemy (asset queries) and pydantic with pydantic-core, annotated-types,
typing-inspection and typing-extensions (asset routes). Its other start-up imports
that the image lacks are never used on this path: simpleeval (one math node), blake3
(asset hashing), PyOpenGL and comfy-angle (the GLSL node), alembic (no database), and
the rest of the list above (the frontend, templates, docs, kornia, spandrel). No fa3-fwd:
the 0.3.75 bundle carries it.

`--job` packs what the whole-job benchmark (tests/bench/whole_job.py) needs beyond .e2e-033/, into .e2e-job/:
PyAV (its SaveVideo writes the video file; the image lacks it, and the stub stands in only for imports),
simpleeval (the template's Math Expression node: upstream's nodes_math does not import without it) and
upstream 0.33.0's tokenizer data for the Qwen encoder (the H3 text encoder tokenizes the prompt), CLIP-L (the
benchmark's check of QuantizedCLIPLoader loads one) and T5 (with Qwen's, the tokenizers of the Qwen3-0.6B encoder
of tests/test_text_encoder_gpu.py); the host bundle leaves tokenizer data out. run_e2e.sh --job puts the wheels on
PYTHONPATH and copies the tokenizer data into the host's source.

Wheels are downloaded once into the test cache ($BIGDIT_CACHE, ~/.cache/bigdit)
under e2e-wheels/. The folder .e2e/ is added to git's info/exclude, so it travels
only when a device call names it in `carry`. The script prints the bundle's size
and what the call would carry in all (limit 64 MiB). tests/bench/device/README.md
says how to run it there.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "tests"))
from comfy_harness import cache_dir, comfyui_version, shared_dir  # noqa: E402

SAMPLERS = ("torchsde==0.2.6", "trampoline==0.1.2")
# upstream's server imports its asset routes (pydantic schemas) and database queries (SQLAlchemy) unconditionally
UPSTREAM_SERVER = ("sqlalchemy==2.1.9", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
                   "typing-inspection==0.4.5", "typing-extensions==4.16.0")
# host version -> (wheels, default folder, whether fa3-fwd may join)
HOSTS = {
    "0.3.75": (("comfy-kitchen==0.2.40", *SAMPLERS), ".e2e", True),
    "0.33.0": (("comfy-kitchen==0.2.31", "comfy-aimdo==0.4.13", *SAMPLERS, *UPSTREAM_SERVER), ".e2e-033", False),
}
# compiled wheels also unpacked for the Python of this machine's test venvs (3.11), beside the 3.12 build, so that
# the bundle runs in the check here (README: "Checking the device path here"); abi3 and pure wheels need no second
CHECK_PYTHON = "3.11"
CHECK_ABI_WHEELS = ("pydantic-core==2.50.5",)
FA3 = "fa3-fwd==0.0.3"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
DROP_IN_WHEELS = ("comfy_kitchen/backends/hip/", "comfy_aimdo/aimdo_rocm.so")
# a wheel's part the run cannot do without: checked after unpacking
REQUIRED_FILES = {"comfy_aimdo": "comfy_aimdo/aimdo.so", "comfy_kitchen": "comfy_kitchen/backends/cuda/_C.abi3.so"}
# never imported on the benchmark's path: tests, examples and tokenizer data
DROP_IN_COMFYUI = ("tests", "tests-unit", "script_examples", ".git", ".github", ".ci")
CARRY_LIMIT = 64 * 2 ** 20
# --job: the whole-job benchmark's wheels, and the files of upstream 0.33.0's source it needs that the host bundle
# leaves out
JOB_WHEELS = ("av==19.0.2", "simpleeval==1.0.8")
JOB_HOST = "0.33.0"
JOB_FILES = ("comfy/text_encoders/qwen25_tokenizer", "comfy/sd1_tokenizer", "comfy/text_encoders/t5_tokenizer")
# a job's two calls (tests/bench/device/README.md): the first carries these to unpack them (SageAttention 2 installed),
# the second, within the 30 s the machine stays warm, the host's bundle, and runs the job
JOB_CALLS = ((".e2e-job", ".sage2"), (".e2e-033",))


def download(requirements, dest: Path, python: str = "3.12") -> list[Path]:
    dest = dest if python == "3.12" else dest / f"py{python}"
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for req in requirements:
        name, version = req.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = sorted(dest.glob(stem + "*.whl"))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", python, "--implementation", "cp", "-d", str(dest), req]
            for platform in PLATFORMS:
                cmd += ["--platform", platform]
            subprocess.run(cmd, check=True)
            found = sorted(dest.glob(stem + "*.whl"))
        if len(found) != 1:
            raise RuntimeError(f"expected one wheel for {req} in {dest}, found {[p.name for p in found]}")
        wheels.append(found[0])
    return wheels


def unpack_wheel(wheel: Path, site: Path) -> int:
    """Install by unpacking (what pip does for these wheels: no scripts, no compiled bytecode)."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or any(name.startswith(p) for p in DROP_IN_WHEELS):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):  # purelib/platlib go to site-packages
                if parts[1] not in ("purelib", "platlib"):
                    raise RuntimeError(f"{wheel.name}: cannot place {name}")
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
            count += 1
    return count


def keep_comfyui_file(rel: Path) -> bool:
    parts = rel.parts
    if parts[0] in DROP_IN_COMFYUI or "__pycache__" in parts or rel.name == "extra_model_paths.yaml":
        return False
    # tokenizer folders (comfy/sd1_tokenizer, comfy/text_encoders/*_tokenizer): data for text encoders only
    return not any(p.endswith("_tokenizer") for p in parts[:-1]) or rel.suffix == ".py"


def copy_comfyui(src: Path, dest: Path) -> int:
    count = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and keep_comfyui_file(rel):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            count += 1
    return count


def unpack_source(source: Path, tmp: Path, version: str) -> Path:
    """The ComfyUI folder of `source`: the folder itself, or the one tarball folder holding comfyui_version.py."""
    if source.is_dir():
        return source
    with tarfile.open(source) as tf:
        tf.extractall(tmp, filter="data")
    found = [p.parent for p in tmp.glob("*/comfyui_version.py")] + [p.parent for p in tmp.glob("comfyui_version.py")]
    if len(found) != 1:
        raise SystemExit(f"{source}: expected one ComfyUI {version} folder inside, found {len(found)}")
    return found[0]


def compress(staging: Path, bundle: Path) -> None:
    """tar | xz -9 (all cores) where xz exists, else Python's lzma (one core, same format)."""
    tmp = bundle.with_name(bundle.name + ".tmp")
    members = sorted(p.name for p in staging.iterdir())
    if shutil.which("xz") and shutil.which("tar"):
        with open(tmp, "wb") as out:
            tar = subprocess.Popen(["tar", "-C", str(staging), "--owner=0", "--group=0", "-cf", "-", *members],
                                   stdout=subprocess.PIPE)
            xz = subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=out)
            tar.stdout.close()
            if tar.wait() or xz.returncode:
                raise RuntimeError("tar | xz failed")
    else:
        with tarfile.open(tmp, "w:xz", preset=9) as tf:
            for name in members:
                tf.add(staging / name, arcname=name)
    tmp.replace(bundle)


def carried_tree_bytes() -> int:
    """Bytes of what every device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        path = REPO / os.fsdecode(name)
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def exclude(folder: str) -> Path:
    path = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip())
    path = path if path.is_absolute() else REPO / path
    lines = path.read_text().splitlines() if path.exists() else []
    if f"/{folder}/" not in lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"/{folder}/\n")
    return path


def write_bundle(staging: Path, out: Path, wheels: list, comfyui) -> int:
    """bundle.tar.xz, its sha256 and manifest from `staging`; returns the folder's bytes."""
    raw = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    print(f"staged {raw / 2**20:.1f} MiB; compressing")
    bundle = out / "bundle.tar.xz"
    compress(staging, bundle)
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    (out / "bundle.sha256").write_text(digest + "\n")
    (out / "MANIFEST.json").write_text(json.dumps({
        "comfyui": comfyui, "wheels": [w.name for w in wheels], "dropped_from_wheels": DROP_IN_WHEELS,
        "uncompressed_bytes": raw, "bundle_bytes": bundle.stat().st_size, "sha256": digest}, indent=2))
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def prepare_job(opts):
    out = Path(opts.out or REPO / ".e2e-job").resolve()
    if out.parent == REPO:
        print(f"ignored by git through {exclude(out.name)}")
    out.mkdir(parents=True, exist_ok=True)
    wheels = download(JOB_WHEELS, cache_dir() / "e2e-wheels")
    source = Path(opts.comfyui or shared_dir() / "hosts" / f"comfyui-{JOB_HOST}.tar.gz")
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "staging"
        for wheel in wheels:  # compiled ones apart: a Python older than theirs (the check here) keeps its own
            unpack_wheel(wheel, staging / ("site-py312" if "-cp312-" in wheel.name else "site"))
        comfyui = unpack_source(source, Path(tmp) / "source", JOB_HOST)
        if comfyui_version(comfyui) != JOB_HOST:
            raise SystemExit(f"{source} does not hold ComfyUI {JOB_HOST}")
        for rel in JOB_FILES:
            shutil.copytree(comfyui / rel, staging / "comfyui" / rel)
        folder = write_bundle(staging, out, wheels, JOB_HOST)
    tree = carried_tree_bytes()
    for carried in JOB_CALLS:
        sizes = {name: (folder if name == out.name else
                        sum(p.stat().st_size for p in (REPO / name).rglob("*") if p.is_file()))
                 for name in carried if name == out.name or (REPO / name).is_dir()}
        total = sum(sizes.values()) + tree
        parts = [f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()] + [f"the working tree {tree / 2**20:.1f} MiB"]
        missing = set(carried) - set(sizes)
        print(f"a job call carrying {' and '.join(carried)}: {', '.join(parts)}, {total / 2**20:.1f} MiB of "
              f"{CARRY_LIMIT / 2**20:.0f} MiB" + (f" ({', '.join(sorted(missing))} not here yet)" if missing else ""))
        if total > CARRY_LIMIT:
            raise SystemExit("over the device's carry limit: carry .sage2/ with its source rather than a wheel")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", choices=sorted(HOSTS), default="0.3.75", help="the ComfyUI to pack (0.3.75)")
    parser.add_argument("--comfyui", default=None,
                        help="its folder or source tarball (default: 0.3.75 from $BIGDIT_COMFYUI or the test cache, "
                             "0.33.0 from shared/hosts/comfyui-0.33.0.tar.gz beside the repository)")
    parser.add_argument("--out", default=None, help="the folder to fill (default .e2e, .e2e-033 for 0.33.0)")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--without-fa3", action="store_true", help="leave fa3-fwd out (about 9 MB less)")
    parts.add_argument("--fa3-only", action="store_true",
                       help="fa3-fwd alone (for a first call of two: use with --out .e2e-fa3)")
    parts.add_argument("--job", action="store_true",
                       help="the whole-job benchmark's PyAV and tokenizer data (.e2e-job; the source of --comfyui "
                            "or shared/hosts/comfyui-0.33.0.tar.gz)")
    opts = parser.parse_args()
    if opts.job:
        return prepare_job(opts)
    host_wheels, default_out, with_fa3 = HOSTS[opts.host]
    if opts.comfyui is None:
        opts.comfyui = (shared_dir() / "hosts" / f"comfyui-{opts.host}.tar.gz" if opts.host != "0.3.75"
                        else os.environ.get("BIGDIT_COMFYUI") or cache_dir() / "comfyui-0.3.75")
    source = Path(opts.comfyui)
    if not with_fa3 and opts.fa3_only:
        parser.error(f"--fa3-only: fa3-fwd travels in the 0.3.75 bundle (prepare.py --fa3-only, no --host)")
    out = Path(opts.out or REPO / default_out).resolve()
    if out.parent == REPO:
        print(f"ignored by git through {exclude(out.name)}")
    out.mkdir(parents=True, exist_ok=True)
    fa3 = () if opts.without_fa3 or not with_fa3 else (FA3,)
    requirements = (FA3,) if opts.fa3_only else host_wheels + fa3
    wheels = download(requirements, cache_dir() / "e2e-wheels")
    wheels += download([r for r in CHECK_ABI_WHEELS if r in requirements], cache_dir() / "e2e-wheels", CHECK_PYTHON)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp) / "staging"
        files = {w.name: unpack_wheel(w, staging / "site") for w in wheels}
        for package, required in REQUIRED_FILES.items():
            if (staging / "site" / package).is_dir() and not (staging / "site" / required).is_file():
                raise SystemExit(f"{required} is missing from its wheel: the bundle would run without it")
        if not opts.fa3_only:
            comfyui = unpack_source(source, Path(tmp) / "source", opts.host)
            if comfyui_version(comfyui) != opts.host:
                raise SystemExit(f"{source} does not hold ComfyUI {opts.host} (run `bash .ci/setup_env.sh`)")
            files["comfyui"] = copy_comfyui(comfyui, staging / "comfyui")
        raw = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        print(f"staged {raw / 2**20:.1f} MiB ({', '.join(f'{k}: {v} files' for k, v in files.items())}); "
              f"compressing")
        bundle = out / "bundle.tar.xz"
        compress(staging, bundle)
    digest = hashlib.sha256(bundle.read_bytes()).hexdigest()
    (out / "bundle.sha256").write_text(digest + "\n")
    (out / "MANIFEST.json").write_text(json.dumps({
        "comfyui": None if opts.fa3_only else opts.host, "wheels": [w.name for w in wheels],
        "dropped_from_wheels": DROP_IN_WHEELS, "uncompressed_bytes": raw, "bundle_bytes": bundle.stat().st_size,
        "sha256": digest}, indent=2))
    folder = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    tree = carried_tree_bytes()
    total = folder + tree
    print(f"{bundle}: {bundle.stat().st_size / 2**20:.1f} MiB; the folder {folder / 2**20:.1f} MiB + the working "
          f"tree {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB carried of {CARRY_LIMIT / 2**20:.0f} MiB")
    if total > CARRY_LIMIT:
        raise SystemExit("over the device's carry limit: see tests/bench/device/README.md (--without-fa3, or two "
                         "calls with --fa3-only; a call carries one host's bundle)")


if __name__ == "__main__":
    main()
