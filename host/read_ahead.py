"""Reading ahead the model files a queued prompt names (loaders/read_ahead.py), for prompts with the pack's nodes.

ComfyUI calls each on-prompt handler with a prompt's JSON as it is queued (`PromptServer.add_on_prompt_handler`);
ours reads nothing for a prompt without a node of the pack, never changes the prompt, and a failure of its own is
logged, never the prompt's. The files: the values of the prompt's file inputs (FILE_INPUTS: an input's name ->
ComfyUI's models folder; the host's loaders and the pack's use these names), in the order a job needs them whole:
text encoders and checkpoints, then LoRAs (their loaders read them whole before sampling starts; in the H3 turbo job
the LoRA's loader read its file behind the reader's DiT, model_load 8.7 s against 4.6 without the read-ahead), then
diffusion models, then VAEs; only those of nodes that can run (`running_nodes`: the input an If/Else Switch with a
known switch does not take never runs, as the template's LoRA with its Lightning toggle off). A file read ahead once
is not read again by this server.

When a diffusion model the pack loaded or changed (its loaders, QuantizeModelINT8, SetAttentionBackend) starts sampling
(`hook_sampling`), the prompt's conditioning exists, so its text encoders were loaded: `release_held` drops their pages
(ComfyUI holds their weights), whose room the job's next files need (in the H3 turbo job at 64 GiB the read-ahead read
46.6 GiB for 39.2 GiB of files before it did: the kernel dropped read-ahead pages not yet used before the text
encoder's spent ones). The diffusion models are read no further then: under dynamic VRAM the first step pages them in
itself, and comfy-aimdo drops the pages it read (`posix_fadvise(DONTNEED)` after each `pread` into its `mark_cold`
host buffers), so a reader behind it reads them a second time (in the turbo job at 64 GiB, whole_job on an H100,
2026-12-07, the job read 47.3 GiB with the read-ahead against 38.2 without; with the stop, 39.4 GiB: every file
once). Reading the model's file in its blocks' order a window ahead of the model instead gained nothing there (first
job 49.1 s against the stop's 49.4) and read 46.7 GiB: what the reader reads ahead, comfy-aimdo reads again. Where
the prompt names a diffusion model and has such a node, its VAEs are read once that model's first call returned (else
as it is queued), where the RAM then holds them: the disk waits through the other steps, where at the queue they
were read beside the first step's.

The RAM room: loaders/host_memory.py's `ram_room` (what is really free, never more than psutil's `available`). On
unless BIGDIT_READ_AHEAD=0 is in the server's environment: in that run it took the first job from 60.5 s to 57.3
(whole_job's pack_fast against pack_fast_no_read_ahead), the encoder stage from 16.6 s to 11.9, and left the second
alike; where the RAM does not hold the files (32 GiB) it reads nothing.
"""
from __future__ import annotations

import os

import comfy.patcher_extension
import folder_paths

from ..loaders.host_memory import ram_room
from ..loaders.read_ahead import AheadFile, Reader, plan
from ..pack_logging import pack_logger
from ..units import format_gib

log = pack_logger(__name__)

FILE_INPUTS = {"clip_name": "text_encoders", **{f"clip_name{i}": "text_encoders" for i in range(1, 5)},
               "ckpt_name": "checkpoints", "unet_name": "diffusion_models", "lora_name": "loras", "vae_name": "vae"}
ORDER = ("text_encoders", "checkpoints", "loras", "diffusion_models", "vae")
AFTER_FIRST_STEP = frozenset({"vae"})  # read once a diffusion model's first call returned, where the prompt has one
SAMPLED = frozenset({"checkpoints", "diffusion_models"})  # a prompt naming these runs a diffusion model
HELD = frozenset({"text_encoders"})  # ComfyUI keeps a text encoder's weights in its own memory once loaded
SWITCHES = frozenset({"ComfySwitchNode"})  # upstream's If/Else Switch: the untaken input is lazy, never evaluated
SWITCH_BRANCHES = ("on_true", "on_false")
SWITCH = "BIGDIT_READ_AHEAD"
CALLBACK_KEY = "bigdit_read_ahead"
_handler: PromptReadAhead | None = None  # the server's handler, once installed


def _link(value) -> str | None:
    """The node id an input's value links to ([id, output]), None for a literal."""
    return str(value[0]) if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) else None


def _switch_taken(prompt: dict, node: dict) -> str | None:
    """For an If/Else Switch whose switch is a literal boolean, or a Boolean primitive's: the input it evaluates
    ("on_true" or "on_false"; the other, lazy, never runs); None otherwise."""
    if node.get("class_type") not in SWITCHES:
        return None
    value = node.get("inputs", {}).get("switch")
    link = _link(value)
    source = prompt.get(link) if link is not None else None
    if isinstance(source, dict) and source.get("class_type") == "PrimitiveBoolean":
        value = source.get("inputs", {}).get("value")
    return ("on_true" if value else "on_false") if isinstance(value, bool) else None


def running_nodes(prompt: dict) -> dict:
    """The prompt's nodes that can run: those some node without a consumer (an output, or a node on its own)
    reaches through its inputs, an If/Else Switch with a known switch through the input it takes only."""
    consumed = {_link(v) for node in prompt.values() if isinstance(node, dict)
                for v in (node.get("inputs") or {}).values()} - {None}
    todo = [key for key in prompt if key not in consumed]
    reached: dict = {}
    while todo:
        key = todo.pop()
        node = prompt.get(key)
        if key in reached or not isinstance(node, dict):
            continue
        reached[key] = node
        taken = _switch_taken(prompt, node)
        for name, value in (node.get("inputs") or {}).items():
            link = _link(value)
            if link is not None and (taken is None or name not in SWITCH_BRANCHES or name == taken):
                todo.append(link)
    return reached


def prompt_files(nodes: dict) -> list[tuple[str, AheadFile]]:
    """(models folder, file) of the model files `nodes` (a prompt's, API format: its running_nodes) name that exist,
    each once, in ORDER."""
    found: dict[str, tuple[int, str, AheadFile]] = {}
    for node in nodes.values():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        for name, value in (inputs.items() if isinstance(inputs, dict) else ()):
            folder = FILE_INPUTS.get(name)
            if folder is None or not isinstance(value, str):
                continue
            path = folder_paths.get_full_path(folder, value)
            if path and path not in found and os.path.isfile(path):
                found[path] = (ORDER.index(folder), folder, AheadFile(path, os.path.getsize(path), folder in HELD))
    return [(folder, f) for _, folder, f in sorted(found.values(), key=lambda entry: entry[0])]


class PromptReadAhead:
    """The on-prompt handler: reads ahead the files of a prompt with a node in `pack_nodes`; `hooked`: those of them
    whose model runs `hook_sampling`."""

    def __init__(self, pack_nodes: set[str], hooked: set[str]):
        self.pack_nodes, self.hooked = frozenset(pack_nodes), frozenset(hooked)
        self.reader = Reader(log)
        self.deferred: list[AheadFile] = []  # the last prompt's files for after a diffusion model's first call
        self.sampled: set[str] = set()  # the paths of the diffusion models and checkpoints queued

    def __call__(self, json_data):
        try:
            prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
            if isinstance(prompt, dict) and any(isinstance(n, dict) and n.get("class_type") in self.pack_nodes
                                                for n in prompt.values()):
                self.read_ahead(prompt)
        except Exception:  # noqa: BLE001 - the prompt runs whatever happens here
            log.exception("read-ahead failed; the prompt runs without it")
        return json_data

    def read_ahead(self, prompt: dict) -> None:
        nodes = running_nodes(prompt)
        named = prompt_files(nodes)
        hooked = any(node.get("class_type") in self.hooked for node in nodes.values())
        later = AFTER_FIRST_STEP if hooked and any(folder in SAMPLED for folder, _ in named) else frozenset()
        named = [(folder, f) for folder, f in named if not self.reader.seen(f)]
        self.deferred = [f for folder, f in named if folder in later]
        files = [f for folder, f in named if folder not in later]
        deferred = (f"; after a diffusion model's first step: {_names(self.deferred)}" if self.deferred else "")
        if not files:
            if deferred:
                log.info("read-ahead: none now%s", deferred)
            return
        chosen, why = plan(files, ram_room())
        if why:
            log.info("read-ahead: none (%s)%s", why, deferred)
            return
        queued = self.reader.submit(chosen, "a queued prompt")
        self.sampled.update(f.path for folder, f in named if folder in SAMPLED and f in queued)
        log.info("read-ahead: %d files, %s, queued: %s%s", len(queued), format_gib(sum(f.size for f in queued)),
                 _names(queued), deferred)

    def read_deferred(self) -> None:
        """Read the deferred files where the RAM holds them now; they are not deferred again."""
        files, self.deferred = [f for f in self.deferred if not self.reader.seen(f)], []
        if not files:
            return
        chosen, why = plan(files, ram_room())
        if why:
            log.info("read-ahead after a diffusion model's first step: none (%s): %s", why, _names(files))
            return
        self.reader.submit(chosen, "a diffusion model's first step")


def _names(files: list[AheadFile]) -> str:
    return ", ".join(os.path.basename(f.path) for f in files)


def release_held() -> None:
    """As sampling starts: drop the page cache of the held files (text encoders) read ahead so far, and read no
    more of the diffusion models queued (the sampler's first step pages them in itself), where the read-ahead is on."""
    try:
        if _handler is not None and _handler.sampled:
            _handler.reader.stop(_handler.sampled)
        dropped = _handler.reader.release_held() if _handler is not None else []
    except Exception:  # noqa: BLE001 - sampling runs whatever happens here
        log.exception("read-ahead: dropping the text encoders' pages failed; sampling runs without it")
        return
    if dropped:
        log.info("read-ahead: dropped the page cache of %s (%s): ComfyUI holds their weights, and the files the job "
                 "reads next need the room", ", ".join(os.path.basename(f.path) for f in dropped),
                 format_gib(sum(f.size for f in dropped)))


def after_first_call(executor, *args, **kwargs):
    """The diffusion model's wrapper: its call, then the deferred files read (nothing once they are)."""
    out = executor(*args, **kwargs)
    if _handler is not None and _handler.deferred:
        try:
            _handler.read_deferred()
        except Exception:  # noqa: BLE001 - sampling runs whatever happens here
            log.exception("read-ahead after a diffusion model's first step failed; sampling runs without it")
    return out


def hook_sampling(patcher) -> None:
    """Have `patcher`'s sampling start with release_held (its conditioning is encoded by then), and its diffusion
    model's first call end with the deferred files read; once, however many of the pack's nodes the model passed
    through."""
    pre_run = comfy.patcher_extension.CallbacksMP.ON_PRE_RUN
    patcher.remove_callbacks_with_key(pre_run, CALLBACK_KEY)
    patcher.add_callback_with_key(pre_run, CALLBACK_KEY, lambda _patcher: release_held())
    diffusion_model = comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL
    patcher.remove_wrappers_with_key(diffusion_model, CALLBACK_KEY)
    patcher.add_wrapper_with_key(diffusion_model, CALLBACK_KEY, after_first_call)


def install(pack_nodes: set[str], hooked: set[str]) -> bool:
    """Register the handler with the running server unless the switch is off (BIGDIT_READ_AHEAD=0); False where it
    is off or there is no server. `hooked`: the pack's nodes whose model runs `hook_sampling`."""
    if os.environ.get(SWITCH, "1") == "0":
        return False
    try:
        from server import PromptServer
    except ImportError:
        return False
    instance = getattr(PromptServer, "instance", None)
    if instance is None or not callable(getattr(instance, "add_on_prompt_handler", None)):
        return False
    global _handler
    _handler = PromptReadAhead(pack_nodes, hooked)
    instance.add_on_prompt_handler(_handler)
    return True
