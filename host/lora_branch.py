"""A LoRA on the pack's quantized layers as a low-rank branch beside the quantized GEMM: y = W_q x + s * B(A x).

ComfyUI hands a LoRA to a model as weight patches (`patcher.patches[key]`, entries
(strength, adapter, strength_model, offset, function)), which comfy.lora.calculate_weight
adds to the dequantized weight. Where every entry of a layer's weight and bias is one the
branch computes exactly, the layer's quantized tensors stay as they are and, after its own
GEMM, the layer adds for each LoRA `strength * alpha / rank * up(mid(down(x)))` (F.linear in
the activations' dtype; the last product fused with the scale and the sum by addmm, or, for a
lone LoRA on an INT8 layer run by the Triton kernels, down(x) from the path's own INT8 rows and
the up projection in its GEMM's epilogue: quant/int8_lora.py) and for each bias diff
`strength * diff`: calculate_weight's patched weight applied to x, up to the rounding of the
branch in bf16 (on the INT8 path, its rounding of the input). Nothing is folded, requantized or copied in RAM; ConvRot's
rotation and packed 4-bit layers are untouched (the branch works on the layer's input).

Exactly expressible (`branch_part`): a LoRA adapter (comfy.weight_adapter.LoRAAdapter, on
both hosts) without DoRA scale or reshape, with or without a 1x1 mid (LoCon's linear part),
and a bias diff; each with strength_model 1, no offset and no function, on a layer with no
other per-call function. Anything else (LoHa, LoKr, GLoRA, OFT, BOFT, DoRA, full weight
diffs, `set`, offsets) keeps the fold of host/lora_fold.py on that layer, and the report says
why. Upstream's adapters compute the same product as their bypass mode's `h`; the pack
computes it itself on both hosts: `h` reads the strength from the adapter object (which the
patchers holding it share), cannot take a 4-D mid on a Linear, and scales and adds in two more
passes over the output.

The adapter's tensors go to the load device once, in the layer's compute dtype, and stay with
the layer's branch; where ComfyUI's loader left them file-backed (upstream's dynamic VRAM) they are read from
their file straight to the device as ComfyUI reads its own (`read_tensor_file_slice_into`), not through the
file's map, whose pages a copy would leave in the process's resident memory (the turbo LoRA's 1.8 GiB). A load
whose LoRAs have the same tensors (another strength: LoraLoader keeps the file's tensors and makes new adapters
of them) reuses them and changes only the scalars. `attach_branches` runs in the ON_LOAD callbacks
(host/dynamic_vram.py under dynamic VRAM, host/lora_fold.py without) before the fold:
- under dynamic VRAM, the host attaches a LoRA to each paged layer as `weight_lowvram_function`,
  which its cast path would apply while paging the weight in: it goes;
- without, ComfyUI gives a layer it leaves in RAM a per-call `LowVramPatch` (it goes), and writes
  the LoRA into the layers it loads through set_weight, a fold with fresh scales computed on the
  load device at each load with new patches (ComfyUI has no hook before it): the fold is taken
  out again, the layer's original tensors back (`take_out_loaded_fold`);
- a per-call LowVramPatch that ComfyUI adds later (its partial unload) is one the branch already
  applies: the layer leaves it out (host/layers.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import comfy.model_patcher
import comfy.weight_adapter
import torch
from torch import nn

from ..quant.low_rank import LowRank, like as _like
from ..units import format_gib
from .layers import ComfyQuantLinear

try:  # upstream's dynamic VRAM: a file-backed tensor read from its file into a tensor on a device
    from comfy.memory_management import read_tensor_file_slice_into
except ImportError:
    read_tensor_file_slice_into = None

PAGED = ("weight", "bias")
_LORA = getattr(comfy.weight_adapter, "LoRAAdapter", None)
_ADAPTER_NAMES = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr", "glora": "GLoRA", "oft": "OFT", "boft": "BOFT"}


def _lowvram_patch(function) -> bool:
    patch_type = getattr(comfy.model_patcher, "LowVramPatch", None)
    return patch_type is not None and isinstance(function, patch_type)


@dataclass(eq=False)
class BiasDiff:
    """A diff of the layer's bias, `scale * diff` added to its output; `source`: the host's (diff,)."""
    source: tuple
    diff: torch.Tensor
    scale: float
    rank = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.diff]

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.add_(_like(self.diff, out), alpha=self.scale)


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _same_entries(a, b) -> bool:
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


class LoraBranch:
    """A layer's branch: its parts, and the host's patches it computes ({"weight" or "bias": (key, entries)})."""

    def __init__(self, parts: list, patches: dict[str, tuple[str, tuple]]):
        self.parts, self.patches = parts, patches

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x2d, out2d = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for part in self.parts:
            part.add_to(x2d, out2d)
        return out

    def low_rank(self) -> LowRank | None:
        """A lone LoRA's part, for a method that adds it itself (QuantLinear's output_branches); None for any other
        branch, which adds its parts itself."""
        return self.parts[0] if len(self.parts) == 1 and isinstance(self.parts[0], LowRank) else None

    def covers(self, function) -> bool:
        """Whether `function` is ComfyUI's per-call patch (LowVramPatch) of patches this branch computes."""
        key, patches = getattr(function, "key", None), getattr(function, "patches", None)
        return _lowvram_patch(function) and isinstance(patches, dict) and any(
            key == own_key and _same_entries(patches.get(key), entries) for own_key, entries in self.patches.values())

    @property
    def rank(self) -> int:
        return sum(part.rank for part in self.parts)

    def device_bytes(self) -> int:
        tensors = {id(t): t for part in self.parts for t in part.tensors()}
        return sum(t.nbytes for t in tensors.values())


def _kind(v) -> str:
    """What a patch entry's payload is, for the report."""
    if isinstance(v, comfy.weight_adapter.WeightAdapterBase):
        name = getattr(v, "name", "")
        return _ADAPTER_NAMES.get(name, name or type(v).__name__)
    if isinstance(v, list):
        return "a nested patch"
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        return {"diff": "a full weight diff", "set": "a set weight"}.get(v[0], f"a {v[0]} patch")
    return "a full weight diff"


def device_copy(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` on `device` in `dtype`, contiguous and of its own: read from its file where it is file-backed and the
    host reads such tensors to a device (see the module's docstring), else copied."""
    if read_tensor_file_slice_into is not None and t.device.type == "cpu" and device.type != "cpu":
        into = torch.empty(t.shape, dtype=t.dtype, device=device)
        if read_tensor_file_slice_into(t, into):  # False: not file-backed (or not whole), nothing read
            return into.to(dtype).contiguous()
    return t.to(device, dtype).contiguous()


def _lora_part(v, strength: float, layer, reuse: dict, device, dtype):
    """The LowRank part of a LoRA adapter on `layer`, or why it is none."""
    weights = getattr(v, "weights", None)
    if not isinstance(weights, (tuple, list)) or len(weights) != 6:
        return "a LoRA of an unknown layout"
    up, down, alpha, mid, dora_scale, reshape = weights
    if dora_scale is not None:
        return "DoRA"
    if reshape is not None:
        return "a reshaping LoRA"
    up2, down2 = up.flatten(start_dim=1), down.flatten(start_dim=1)
    rank = down2.shape[0]
    if mid is not None and (mid.dim() != 4 or tuple(mid.shape) != (rank, rank, 1, 1)):
        return "a LoRA whose mid is not 1x1"
    if tuple(up2.shape) != (layer.out_features, rank) or down2.shape[1] != layer.in_features:
        return "a LoRA of another shape"
    # comfy.lora's LoRAAdapter.calculate_weight: weight += (strength * alpha / rank) * up @ (mid @) down
    scale = float(strength) * (float(alpha) / rank if alpha is not None else 1.0)
    source = (up, down, mid)
    old = reuse.get(tuple(map(id, source)))
    copy = (lambda t, attr: getattr(old, attr) if old is not None else device_copy(t, device, dtype))
    return LowRank(source, copy(down, "down").flatten(start_dim=1),
                   None if mid is None else copy(mid, "mid").reshape(rank, rank), copy(up, "up").flatten(start_dim=1),
                   scale, old.derived if old is not None else {}, old.blocks if old is not None else None)


def _bias_part(v, strength: float, layer, reuse: dict, device, dtype):
    """The BiasDiff part of a bias diff patch, or why it is none."""
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "diff":
        v = v[1]
    if not isinstance(v, tuple) or not v or not isinstance(v[0], torch.Tensor):
        return _kind(v)
    if len(v) > 1 and isinstance(v[1], dict) and v[1].get("pad_weight"):
        return "a padded diff"
    diff = v[0]
    if tuple(diff.shape) != (layer.out_features,):
        return "a bias diff of another shape"
    old = reuse.get((id(diff),))
    return BiasDiff((diff,), old.diff if old is not None else device_copy(diff, device, dtype), float(strength))


def branch_part(name: str, entry, layer, reuse: dict, device, dtype):
    """The branch's part for one of the host's patch entries of `layer`'s `name`: a LowRank, a BiasDiff, None (a
    zero strength: calculate_weight adds nothing), or a string saying why the branch cannot compute it exactly.
    `reuse`: parts of the layer's last branch by their sources' ids, whose device copies are taken as they are."""
    strength, v, strength_model, offset, function = entry
    if offset is not None:
        return "a patch on part of the tensor (offset)"
    if strength_model != 1.0:
        return "a model strength other than 1"
    if function is not None:
        return "a patch with a function"
    if name == "weight":
        if _LORA is None or not isinstance(v, _LORA):
            return _kind(v)
        part = _lora_part(v, strength, layer, reuse, device, dtype)
    else:
        part = _bias_part(v, strength, layer, reuse, device, dtype)
    return None if not isinstance(part, str) and strength == 0.0 else part


def _patches(patcher, path: str) -> dict[str, tuple[str, tuple]]:
    out = {}
    for name in PAGED:
        key = f"{path}.{name}"
        entries = patcher.patches.get(key)
        if entries:
            out[name] = (key, tuple(entries))
    return out


def build_branch(layer: ComfyQuantLinear, patches: dict[str, tuple[str, tuple]], device: torch.device):
    """The layer's branch for the host's `patches`, or why the branch cannot compute them exactly. The device copies
    of the layer's last branch are reused for the same tensors."""
    for name in PAGED:
        others = [f for f in getattr(layer, f"{name}_function", []) if not _lowvram_patch(f)]
        if others:
            return "ComfyUI's other per-call functions on the layer"
    old = layer.lora_branch
    device = torch.device(device)
    reuse = {} if old is None else {tuple(map(id, part.source)): part for part in old.parts
                                    if _on_device(part.tensors()[0], device)}
    parts = []
    for name, (_, entries) in patches.items():
        for entry in entries:
            part = branch_part(name, entry, layer, reuse, device, layer.compute_dtype)
            if isinstance(part, str):
                return part
            if part is not None:
                parts.append(part)
    return LoraBranch(parts, patches)


def _drop_per_call(patcher, layer: ComfyQuantLinear, branch: LoraBranch) -> None:
    """The host's per-call patches of what the branch computes taken off the layer (see the module's docstring)."""
    dropped = 0
    for name in PAGED:
        if branch.covers(getattr(layer, f"{name}_lowvram_function", None)):
            setattr(layer, f"{name}_lowvram_function", None)
        functions = getattr(layer, f"{name}_function")
        kept = [f for f in functions if not branch.covers(f)]
        if len(kept) != len(functions):
            setattr(layer, f"{name}_function", kept)
            dropped += len(functions) - len(kept)
    counter = getattr(patcher.model, "lowvram_patch_counter", None)
    if dropped and isinstance(counter, int):
        patcher.model.lowvram_patch_counter = max(0, counter - dropped)


@dataclass
class BranchSummary:
    """What one load did with the LoRA on the pack's layers: the layers that got a branch and their ranks, the bytes of
    their device copies, the folds of ComfyUI's set_weight taken out, and why the other layers got none."""
    layers: int = 0
    ranks: set = field(default_factory=set)
    device_bytes: int = 0
    taken_out: int = 0
    not_expressible: Counter = field(default_factory=Counter)

    def lines(self) -> tuple[str, str] | None:
        if not (self.layers or self.not_expressible):
            return None
        short, full = [], []
        if self.layers:
            ranks = (f"rank {min(self.ranks)}" if len(self.ranks) == 1
                     else f"ranks {min(self.ranks)}-{max(self.ranks)}")
            short.append(f"LoRA as a branch on {self.layers} layers ({ranks})")
            taken = (f"; ComfyUI's fold of {self.taken_out} layers it loaded taken out again" if self.taken_out else "")
            full.append(f"LoRA as a low-rank branch beside the quantized GEMM on {self.layers} quantized layers "
                        f"({ranks}, {format_gib(self.device_bytes)} on the device), nothing folded{taken}")
        if self.not_expressible:
            count = sum(self.not_expressible.values())
            reasons = ", ".join(f"{why} ({n})" for why, n in self.not_expressible.items())
            short.append(f"not as a branch on {count}: {reasons}")
            full.append(f"not expressible as a branch on {count} layers, which keep the fold: {reasons}")
        return ", ".join(short), "; ".join(full)


def take_out_loaded_fold(patcher, path: str, layer: ComfyQuantLinear) -> int:
    """Take out what ComfyUI wrote into `layer` at this load from the backups it keeps (a layer it loaded, or one
    upstream's dynamic VRAM force-loads): the fold its set_weight wrote into the weight, a patched bias. Each original
    tensor comes back on the device of the tensor it replaces, and the layer's other tensors stay where the host put
    them (dynamic VRAM pages weight and bias from RAM and loads the scales to the card); ComfyUI's backups of the
    originals are dropped (it would put them back over the same tensors). 1 if anything was taken out."""
    backup = getattr(patcher, "backup", {})
    placed = {name: param.device for name, param in layer._parameters.items() if param is not None}
    taken = 0
    if f"{path}.weight" in backup and layer._unpatched is not None:
        original = backup.pop(f"{path}.weight").weight
        kept_weight = "weight" in layer._unpatched
        layer.restore_unpatched(weight_too=True)
        if not kept_weight:
            layer._parameters["weight"] = original
        taken = 1
    bias = backup.pop(f"{path}.bias", None)
    if bias is not None:
        layer._parameters["bias"] = bias.weight
        taken = 1
    for name, param in layer._parameters.items():
        device = placed.get(name, layer.weight.device)
        if param is not None and (param.device != device or not isinstance(param, nn.Parameter)):
            layer._parameters[name] = nn.Parameter(param.to(device), requires_grad=False)
    return taken


def attach_branches(patcher, device: torch.device | None) -> BranchSummary:
    """Give each of the pack's layers in `patcher`'s model the branch of the host's patches where it computes them
    exactly, on `device` (else the load device); a layer without patches, or whose patches it cannot compute, has
    none (those the fold takes). See the module's docstring."""
    device = device if device is not None else patcher.load_device
    summary = BranchSummary()
    for path, layer in patcher.model.named_modules():
        if not isinstance(layer, ComfyQuantLinear):
            continue
        patches = _patches(patcher, path)
        branch = build_branch(layer, patches, device) if patches else None
        if isinstance(branch, str):
            summary.not_expressible[branch] += 1
            branch = None
        layer.lora_branch = branch
        if branch is None:
            continue
        summary.taken_out += take_out_loaded_fold(patcher, path, layer)
        _drop_per_call(patcher, layer, branch)
        summary.layers += 1
        summary.ranks.add(branch.rank)
        summary.device_bytes += branch.device_bytes()
    return summary


def detach_branches(patcher, unpatch_all: bool = True) -> None:
    """When the host unloads the model (detach with unpatch_all), the branches go with their device copies; a detach
    that only switches to another clone leaves them to its load."""
    if not unpatch_all:
        return
    for layer in (*patcher.model.modules(), *patcher.object_patches.values()):
        if isinstance(layer, ComfyQuantLinear):
            layer.lora_branch = None
