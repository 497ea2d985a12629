"""A LoRA the branch cannot compute (host/lora_branch.py: LoHa, LoKr, DoRA, full diffs, offsets...) folded into
the pack's quantized weights (requantized in the layer's own format, with fresh scales) instead of applied at each
call, and taken out exactly when it changes or goes. A layer with a LoRA branch is never folded.

Without dynamic VRAM, ComfyUI patches the layers it loads at each load through the
weight-patch protocol (ComfyQuantLinear.set_weight), and gives every layer its
partial loading leaves in RAM a per-call `LowVramPatch` in its `weight_function`:
a QuantLinear would dequantize its weight and patch it at every call, then
compute in float. `fold_offloaded_patches` (ON_LOAD) patches those layers once
per load with the patcher's own `patch_weight_to_device`, as ComfyUI patches the
layers it loads: ComfyUI's patch math, its backup of the unpatched weight (which
unpatch_model and partially_unload restore), and set_weight requantizing with the
layer's own method. The math runs on the load device; the patched weight stays in
RAM, pinned where ComfyUI had pinned the original, so ComfyUI's per-op copy and
the pack's block streaming (offload/streaming.py) move the folded weight: the
layer's own tensors, as ComfyUI keeps its own patched weights. A layer ComfyUI
offloads later (partially_unload, between loads) runs per call until the next load.

Under upstream's dynamic VRAM (`patcher.is_dynamic()`) the host loads again at
every sampling and attaches a LoRA to each paged layer as `weight_lowvram_function`,
which its cast path applies at each page fill, requantizing the result as a plain
dtype (wrong for a layer with scales). `fold_paged`, from host/dynamic_vram.py's
ON_LOAD callback, folds it instead:
- once per LoRA set and strength: the last FOLDS_KEPT folds of a layer (the
  requantized tensors) stay on it with the patches they came from, so a load with
  the same patches (the same patcher, a clone, the same LoRA loaded again, a
  strength going back and forth) writes one back without computing, other patches
  fold again, no patch restores the originals;
- layer by layer on the load device: the unpatched weight dequantized, ComfyUI's
  own patch math (comfy.lora.calculate_weight) in fp32, the layer's method with
  fresh scales; the report gives each folded weight's relative error against the
  exact patched one;
- file-backed: the folded tensors go to a scratch file FOLD_BATCH at a time and
  are kept as maps of it (host/file_backed.py `mapped_copies`), so their pages are
  reclaimable page cache, marked for the host to page from, never anonymous memory
  the host's accounting does not see; a batch is computed only into RAM that is
  really free (loaders/host_memory.py `free_ram`: not psutil's `available`, which
  counts the page cache of the files the host pages from and ignores a memory
  cgroup's limit), less RAM_HEADROOM;
- the originals (views of the model file or of its scratch file) are kept by
  reference as the layer's unpatched tensors: a restore copies nothing and is exact.
The host keeps copies of a paged layer's weight and bias: its page in VRAM, reused
while `_v_signature` matches, and its pinned copies (`_pins[subset]["pin"]`), made
at the first fault and copied from afterwards. Whenever weight or bias change
(fold, refold, restore), the page is marked for a refill as the host marks it when
the patches change (`_v_signature` None), and each pinned copy is rewritten with
the new bytes through the host's own gather copy (`cast_to_gathered`), after the
device finished any copy from it. The layer's other tensors (scales) are
force-loaded by the host at each load from its backup, which it also restores when
it unloads: the fold's go into that backup, so the layer is consistent in every
state. A layer whose host copies are not as the pack knows them (an unknown pin, a
copy in flight), whose fold would not fit in the free RAM, or whose scratch file
cannot be written, keeps the LoRA per call, and the log says why.
`unfold_paged` (ON_DETACH, when the host unloads the model) puts the originals back
and keeps the folds for the next load. The last load's line (the branch's and the
fold's) goes on the loader's node (`last run:`).
"""
from __future__ import annotations

import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import torch
from torch import nn

from ..loaders import host_memory
from ..loaders.host_memory import trim_heap
from ..pack_logging import pack_logger
from ..quant.linear import QuantLinear
from ..units import GIB, format_gib
from .file_backed import mapped_copies
from .lora_branch import attach_branches, detach_branches
from .model import is_dynamic, weight_patched_quant_tensors

try:  # upstream's dynamic VRAM: how the host sizes a layer's pinned copy
    import comfy.memory_management as comfy_memory
except ImportError:
    comfy_memory = None
log = pack_logger(__name__)

FOLD_KEY = "bigdit_lora_fold"
_FOLDS = "_bigdit_lora_folds"  # on a layer: its last Folds, the latest first
FOLDS_KEPT = 2
FOLD_BATCH = GIB  # folded bytes computed into RAM before they go to their scratch file
PAGED = ("weight", "bias")  # what dynamic VRAM pages; a layer's other tensors it force-loads at each load
WEIGHT_PINS = ("weights", "weights-loaded")  # the subsets of a layer's pinned copies of weight and bias
LAST_LINE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (node line, log line), last load
RAM_HEADROOM = 2 * GIB  # RAM a fold leaves free, as the host leaves it free of its pinned copies (ensure_pin_budget)
NO_RAM = "not enough free RAM to compute its folded weights"


def _per_call_patch(function) -> bool:
    lowvram_patch = getattr(comfy.model_patcher, "LowVramPatch", None)
    return lowvram_patch is not None and isinstance(function, lowvram_patch)


def _percent(errors: list[float]) -> str:
    return f"max {100 * max(errors):.2f}%, mean {100 * sum(errors) / len(errors):.2f}%"


# ---- without dynamic VRAM -------------------------------------------------------------------------------------

def fold_offloaded_patches(patcher, device_to=None, *_) -> int:
    """Write the per-call weight patches of `patcher`'s offloaded QuantLinear layers into their weights;
    returns how many tensors were patched."""
    if is_dynamic(patcher):
        return 0
    pinned = getattr(patcher, "pinned", set())
    folded = 0
    for key, module, tensor_name in weight_patched_quant_tensors(patcher):
        functions = getattr(module, f"{tensor_name}_function")
        if not any(_per_call_patch(f) for f in functions):
            continue
        was_pinned = key in pinned
        patcher.unpin_weight(key)  # the unpatched tensor now only waits in the backup
        patcher.patch_weight_to_device(key, device_to=device_to)
        setattr(module, f"{tensor_name}_function", [f for f in functions if not _per_call_patch(f)])
        if was_pinned:
            patcher.pin_weight_to_device(key)
        folded += 1
    if folded:
        counter = getattr(patcher.model, "lowvram_patch_counter", None)
        if isinstance(counter, int):
            patcher.model.lowvram_patch_counter = max(0, counter - folded)
    return folded


def _static_line(patcher, offloaded: int) -> tuple[str, str] | None:
    """What a load without dynamic VRAM wrote in: the LoRA'd layers ComfyUI patched through set_weight."""
    errors = [m.patch_error for key, m, name in weight_patched_quant_tensors(patcher)
              if name == "weight" and m.patch_error is not None]
    if not errors:
        return None
    short = f"LoRA folded into {len(errors)} quantized layers (error {_percent(errors)})"
    where = f" ({offloaded} tensors ComfyUI left in RAM folded by the pack)" if offloaded else ""
    return short, (f"LoRA folded into {len(errors)} quantized layers at load{where}: relative error of the "
                   f"requantized weights against the exact patched ones {_percent(errors)}")


# ---- under dynamic VRAM ---------------------------------------------------------------------------------------

@dataclass
class Fold:
    """A LoRA folded into one layer: the host's patches it came from (by name: "weight", "bias"), the tensors
    it writes (in RAM), and the folded weight's relative error against the exact patched one."""
    patches: dict[str, tuple]
    tensors: dict[str, nn.Parameter]
    error: float | None


def _same(a, b) -> bool:
    """Whether two patch entries are the same patch: strengths and offsets equal, tensors the very same (a weight
    adapter by its tensors: the same LoRA file loaded again through ComfyUI's LoRA cache)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) is type(b) and hasattr(a, "weights"):
        return _same(a.weights, b.weights)
    try:
        return bool(a == b)
    except Exception:  # a comparison that is no bool
        return False


def _written(layer: QuantLinear, fold: Fold) -> bool:
    return layer._unpatched is not None and all(
        layer._parameters.get(name) is fold.tensors[name] for name in PAGED if name in fold.tensors)


def _same_data(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    # the host wraps what it restores in a new Parameter (comfy.utils.set_attr_param): the data is what counts
    return a is b or (a is not None and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.data_ptr() == b.data_ptr())


def _in_place(patcher, path: str, layer: QuantLinear, fold: Fold) -> bool:
    """Whether the fold is written and its other tensors are where the host keeps them (its backup of a tensor it
    force-loaded, else the layer)."""
    backup = getattr(patcher, "backup", {})
    return _written(layer, fold) and all(
        _same_data(backup[f"{path}.{name}"].weight if f"{path}.{name}" in backup else layer._parameters.get(name),
                   tensor)
        for name, tensor in fold.tensors.items() if name not in PAGED)


def _wanted(patcher, path: str, layer: QuantLinear) -> tuple[dict[str, tuple], str | None]:
    """The host's patches of the layer that it attached for its cast path, by name; why they cannot be folded."""
    wanted = {}
    for name in PAGED:
        function = getattr(layer, f"{name}_lowvram_function", None)
        if function is None:
            continue
        key = f"{path}.{name}"
        if getattr(function, "key", None) != key or key not in patcher.patches:
            return wanted, "its per-call patch is not ComfyUI's own patch of that tensor"
        wanted[name] = tuple(patcher.patches[key])
    return wanted, None


def _weight_pins(layer: QuantLinear) -> list[torch.Tensor]:
    pins = layer.__dict__.get("_pins") or {}
    return [pins[s]["pin"] for s in WEIGHT_PINS if isinstance(pins.get(s), dict) and pins[s].get("pin") is not None]


def _host_copies_unknown(patcher, path: str, layer: QuantLinear) -> str | None:
    """Why the pack cannot keep the host's copies of this layer right after changing it, or None."""
    if "_prefetch" in layer.__dict__:
        return "the host has a copy of its weight in flight"
    pins = layer.__dict__.get("_pins") or {}
    if not isinstance(pins, dict) or set(pins) - set(WEIGHT_PINS):
        return f"ComfyUI keeps pinned copies of it the pack does not know ({', '.join(map(str, pins))})"
    pinned = _weight_pins(layer)
    if pinned:
        if not (hasattr(comfy.model_management, "cast_to_gathered") and hasattr(comfy_memory, "vram_aligned_size")):
            return "this ComfyUI pins its weight but has no cast_to_gathered to rewrite the pinned copy"
        size = comfy_memory.vram_aligned_size([layer.weight, layer.bias])
        if any(p.dim() != 1 or p.element_size() != 1 or p.numel() != size for p in pinned):
            return "its pinned copy is not laid out as the pack expects"
    backup = getattr(patcher, "backup", {})
    for name in layer._parameters:
        entry = backup.get(f"{path}.{name}")
        if name not in PAGED and entry is not None and not hasattr(entry, "_replace"):
            return "ComfyUI's backup of its tensors is not as the pack expects"
    return None


class HostCopies:
    """Brings the host's copies of a paged layer's weight and bias (its page, its pinned copies) up to date with the
    layer, once the device has finished copying from them."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.synchronized = False

    def __call__(self, layer: QuantLinear) -> None:
        layer._v_signature = None  # refilled at the next fault, as ModelPatcherDynamic.load marks a changed patch set
        pins = _weight_pins(layer)
        if pins and not self.synchronized and self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.synchronized = True
        for pin in pins:
            comfy.model_management.cast_to_gathered([layer.weight, layer.bias], pin)


@contextmanager
def _at_rest(patcher, path: str | None, layer: QuantLinear):
    """The layer as the host keeps it between loads for the duration: each tensor the host force-loaded this load
    replaced by its backup; afterwards the backup takes what the layer then holds and the layer a copy of it where
    the host had put its own, as the host's load does."""
    backup = getattr(patcher, "backup", {}) if path is not None else {}
    loaded = {}
    for name, param in list(layer._parameters.items()):
        entry = backup.get(f"{path}.{name}")
        if name not in PAGED and param is not None and entry is not None:
            loaded[name] = (entry, param.device)
            rest = entry.weight
            layer._parameters[name] = (rest if isinstance(rest, nn.Parameter)
                                       else nn.Parameter(rest, requires_grad=False))
    try:
        yield
    finally:
        for name, (entry, device) in loaded.items():
            rest = layer._parameters[name]
            backup[f"{path}.{name}"] = entry._replace(weight=rest)
            layer._parameters[name] = nn.Parameter(rest.to(device), requires_grad=False)


def _ram_room() -> float:
    """The bytes of RAM a fold may take now: what is really free, never more than psutil's `available`
    (loaders/host_memory.py `ram_room`), less RAM_HEADROOM; unbounded where the system says nothing."""
    room = host_memory.ram_room()
    return float("inf") if room is None else float(room) - RAM_HEADROOM


def _fold_bytes(layer: QuantLinear, wanted) -> int:
    """The RAM a fold of `wanted` into the layer takes: as much as the tensors it replaces."""
    return sum(t.nbytes for name, t in layer._parameters.items()
               if t is not None and (name != "bias" or "bias" in wanted) and (name == "bias" or "weight" in wanted))


def _compute(layer: QuantLinear, path: str, wanted: dict[str, tuple], device) -> Fold:
    """The fold of `wanted` into the (unpatched) layer, computed on `device`, kept in RAM beside the originals."""
    tensors, error = {}, None
    home = layer.weight.device
    with torch.no_grad():
        if "weight" in wanted:
            exact = comfy.lora.calculate_weight(list(wanted["weight"]), layer.dequantized(device, torch.float32),
                                                f"{path}.weight", intermediate_dtype=torch.float32)
            fresh, error = layer.quantized_patch(exact)
            del exact
            tensors.update(fresh)
        if "bias" in wanted:
            tensors["bias"] = comfy.lora.calculate_weight(list(wanted["bias"]), layer.bias.to(device, torch.float32),
                                                          f"{path}.bias", intermediate_dtype=torch.float32)
    for name, tensor in tensors.items():
        held = layer._parameters[name]
        if tensor.shape != held.shape:
            raise ValueError(f"the patch changes {name}'s shape {tuple(held.shape)} to {tuple(tensor.shape)}")
        tensors[name] = nn.Parameter(tensor.to(home, held.dtype), requires_grad=False)
    return Fold(wanted, tensors, error)


def _write(patcher, path: str, layer: QuantLinear, fold: Fold, refresh: HostCopies) -> None:
    before = [layer._parameters.get(name) for name in PAGED]
    with _at_rest(patcher, path, layer):
        layer.write_patched_tensors(fold.tensors, keep_weight=True, error=fold.error)
    if any(layer._parameters.get(name) is not held for name, held in zip(PAGED, before)):
        refresh(layer)


def _restore(patcher, path: str | None, layer: QuantLinear, refresh: HostCopies) -> None:
    with _at_rest(patcher, path, layer):
        layer.restore_unpatched()
    refresh(layer)


@dataclass
class FoldSummary:
    """What one load did with the LoRA on its paged layers."""
    computed: int = 0
    reused: int = 0
    restored: int = 0
    seconds: float = 0.0
    file_bytes: int = 0
    errors: list = field(default_factory=list)
    per_call: Counter = field(default_factory=Counter)

    def lines(self) -> tuple[str, str] | None:
        folded = self.computed + self.reused
        kept = sum(self.per_call.values())
        if not (folded or self.restored or kept):
            return None
        short, full = [], []
        if folded:
            how = f"{self.computed} computed in {self.seconds:.1f} s" if self.computed else "reused"
            if self.computed and self.reused:
                how += f", {self.reused} reused"
            error = f"error {_percent(self.errors)}" if self.errors else "bias only"
            short.append(f"LoRA folded into {folded} quantized layers ({error})")
            full.append(f"LoRA folded into {folded} quantized layers ({how}): relative error of the folded weights "
                        f"against the exact patched ones {_percent(self.errors) if self.errors else 'none (bias only)'}"
                        f"; {format_gib(self.file_bytes)} of folded weights mapped from scratch files (reclaimable)")
        if self.restored:
            short.append(f"LoRA taken out of {self.restored} layers")
            full.append(f"LoRA taken out of {self.restored} quantized layers: their original tensors are back")
        if kept:
            reasons = "; ".join(f"{why} ({n})" for why, n in self.per_call.items())
            short.append(f"LoRA per call on {kept} layers")
            full.append(f"LoRA applied per call on {kept} quantized layers, not folded: {reasons}")
        return ", ".join(short), "; ".join(full)


class _Batch:
    """Folds computed into RAM, then moved to a scratch file together (host/file_backed.py `mapped_copies`)."""

    def __init__(self, label: str):
        self.label, self.folds, self.nbytes = label, [], 0
        self.failed: dict[int, str] = {}  # id(fold) -> why its file could not be written

    def add(self, fold: Fold) -> None:
        self.folds.append(fold)
        self.nbytes += sum(t.nbytes for t in fold.tensors.values())

    def flush(self) -> None:
        if not self.folds:
            return
        tensors = {f"{i}.{name}": t.data for i, fold in enumerate(self.folds) for name, t in fold.tensors.items()}
        try:
            mapped = mapped_copies(tensors, self.label)
        except Exception as e:  # the folds stay in RAM only until their layers fall back to per call
            for fold in self.folds:
                self.failed[id(fold)] = f"no scratch file for its folded weights ({type(e).__name__}: {e})"
        else:
            for i, fold in enumerate(self.folds):
                fold.tensors = {name: nn.Parameter(mapped[f"{i}.{name}"], requires_grad=False) for name in fold.tensors}
        del tensors
        self.folds, self.nbytes = [], 0
        trim_heap()


def _keep(layer: QuantLinear, fold: Fold) -> None:
    """`fold` first among the layer's folds, which keep at most FOLDS_KEPT."""
    folds = [f for f in layer.__dict__.get(_FOLDS, []) if f is not fold]
    layer.__dict__[_FOLDS] = [fold, *folds][:FOLDS_KEPT]


def fold_paged(patcher, device_to=None) -> FoldSummary:
    """Under dynamic VRAM, fold the LoRA the host attached to the pack's paged layers that have no LoRA branch (see
    the module's docstring); the layers left with their per-call patch are those it could not fold."""
    summary = FoldSummary()
    refresh = HostCopies(device_to)
    batch = _Batch("lora-fold")
    chosen = []  # (path, layer, fold, wanted): the folds to write, computed or reused
    for path, layer in patcher.model.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        folds = layer.__dict__.get(_FOLDS, [])
        written = next((f for f in folds if _written(layer, f)), None)
        if getattr(layer, "lora_branch", None) is not None:  # the branch computes its LoRA
            if written is not None:
                _restore(patcher, path, layer, refresh)
            continue
        wanted, why = _wanted(patcher, path, layer)
        if written is not None and (why or not _same(written.patches, wanted)):
            _restore(patcher, path, layer, refresh)  # its patches went or changed: the originals come back
            summary.restored += not wanted
            written = None
        if not wanted:
            continue
        fold = written or next((f for f in folds if _same(f.patches, wanted)), None)
        if why is None and written is None:  # weight or bias are to change
            why = _host_copies_unknown(patcher, path, layer)
        if why is None and fold is None:
            if layer._unpatched is not None:
                why = "a weight patch is written into it already"
            else:
                fold, why = _computed(layer, path, wanted, device_to, batch, summary)
        elif why is None:
            summary.reused += 1
        if why is not None:
            summary.per_call[why] += 1
            continue
        chosen.append((path, layer, fold, wanted))
    batch.flush()
    for path, layer, fold, wanted in chosen:
        if id(fold) in batch.failed:
            summary.computed -= 1
            summary.per_call[batch.failed[id(fold)]] += 1
            continue
        _keep(layer, fold)
        if not _in_place(patcher, path, layer, fold):
            _write(patcher, path, layer, fold, refresh)
        for name in wanted:
            setattr(layer, f"{name}_lowvram_function", None)
        summary.file_bytes += sum(fold.tensors[name].nbytes for name in PAGED if name in fold.tensors)
        if fold.error is not None:
            summary.errors.append(fold.error)
    return summary


def _computed(layer: QuantLinear, path: str, wanted, device_to, batch: _Batch,
              summary: FoldSummary) -> tuple[Fold | None, str | None]:
    """The layer's fold computed into the batch, which goes to its file first where it is full or RAM is short;
    (the fold, None), or (None, why not)."""
    need = _fold_bytes(layer, wanted)
    if batch.nbytes + need > FOLD_BATCH or need > _ram_room():
        batch.flush()
    if need > _ram_room():
        return None, NO_RAM
    start = time.perf_counter()
    try:
        fold = _compute(layer, path, wanted, device_to or layer.weight.device)
    except Exception as e:  # the layer is untouched: it keeps the per-call patch
        return None, f"{type(e).__name__}: {e}"
    finally:
        summary.seconds += time.perf_counter() - start
    batch.add(fold)
    summary.computed += 1
    return fold, None


def unfold_paged(patcher, unpatch_all: bool = True) -> int:
    """When the host unloads the model (ModelPatcherDynamic.detach with unpatch_all: its pinned copies and pages are
    gone, its backups restored), put the original tensors back into every layer a fold is written into; the folds
    stay for the next load. A detach that only switches to another clone leaves the folds to its load."""
    if not unpatch_all:
        return 0
    restored = 0
    refresh = HostCopies(None)
    layers = {m for m in (*patcher.model.modules(), *patcher.object_patches.values()) if isinstance(m, QuantLinear)}
    for layer in layers:
        if any(_written(layer, fold) for fold in layer.__dict__.get(_FOLDS, [])):
            _restore(patcher, None, layer, refresh)
            restored += 1
    return restored


# ---- the report and the callbacks -----------------------------------------------------------------------------

def record_lines(patcher, *parts: tuple[str, str] | None) -> None:
    """Keep the load's lines (the branch's, the fold's) for the node; log them when they differ from the last load's
    (a reuse says so once)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        LAST_LINE.pop(patcher.model, None)
        return
    lines = "; ".join(p[0] for p in parts), "; ".join(p[1] for p in parts)
    (log.debug if LAST_LINE.get(patcher.model) == lines else log.info)("%s", lines[1])
    LAST_LINE[patcher.model] = lines


def install_lora_fold(patcher, run=None) -> None:
    """Give `patcher`'s quantized layers (and its clones') the LoRA as a branch, else folded, after each of its loads;
    after each sampling, the last load's line goes to `run` (a host.report.NodeRun). Under dynamic VRAM both run in
    host/dynamic_vram.py's ON_LOAD callback, between what it does before and after."""
    callbacks = comfy.patcher_extension.CallbacksMP

    def on_load(loaded, device_to=None, *_):
        if not is_dynamic(loaded):
            branches = attach_branches(loaded, device_to)
            record_lines(loaded, branches.lines(), _static_line(loaded, fold_offloaded_patches(loaded, device_to)))

    def on_detach(detached, unpatch_all=True):
        detach_branches(detached, unpatch_all)

    def on_cleanup(sampled):
        lines = LAST_LINE.get(sampled.model)
        if run is not None and lines is not None:
            run.add("lora", lines[0])

    for kind, function in ((callbacks.ON_LOAD, on_load), (callbacks.ON_DETACH, on_detach),
                           (callbacks.ON_CLEANUP, on_cleanup)):
        patcher.remove_callbacks_with_key(kind, FOLD_KEY)
        patcher.add_callback_with_key(kind, FOLD_KEY, function)
