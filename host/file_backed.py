"""A loaded model's paged weights backed by a file, as ComfyUI backs its own (upstream's dynamic VRAM).

Under dynamic VRAM the host pages a layer's weight and bias through its cast path:
the first time, it copies them into its own pinned memory, reading them from the
model file (the file slices its loader attaches) rather than from the tensor. Its
own models so hold one copy in RAM. The weights a loader quantized live in process
memory, and the host's pinned copy would sit beside them (measured: 42 GiB of host
memory for MiniMax-H3's 20 GiB of FP8 weights, against 23.5 GiB for ComfyUI's own
FP8 file). `back_with_file` writes those tensors to a scratch file in ComfyUI's temp
folder and loads them back with ComfyUI's own loader, so the host reads them from
the file as it reads its own, and the process memory they held is given back.
The file is unlinked once mapped (POSIX); elsewhere it goes with the model, or at
ComfyUI's next start, which empties its temp folder.

The tensors a loader keeps as the file stores them (pre-quantized layers, plain
weights) need no scratch file: `file_slice_marker` marks them, as they are read
from the model file, the way ComfyUI's loader marks its own, so the host pages them
from the model file itself. Where the load wrote its model to the quantize-once
cache (host/cache.py), that file backs the quantized weights instead of a scratch file.

`mapped_copies` does the same for tensors the pack makes later (a LoRA's fold,
host/lora_fold.py): written to a scratch file and handed back as maps of it, so
their pages are the file's (reclaimable page cache, not anonymous memory), and
marked for the host to page from where it pages from files.
"""
from __future__ import annotations

import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass

import comfy.utils
import folder_paths
import torch
from torch import nn

from ..loaders.checkpoint import TensorSource
from ..loaders.host_memory import release_pages, trim_heap
from ..loaders.safetensors_header import read_header
from ..loaders.safetensors_writer import data_bytes, write_safetensors
from ..quant.linear import QuantLinear
from ..units import format_gib
from .model import is_dynamic

try:  # upstream's dynamic VRAM: whether its loader maps files through comfy-aimdo
    import comfy.memory_management as comfy_memory
except ImportError:
    comfy_memory = None


def pages_from_files() -> bool:
    """Whether ComfyUI's loader maps files for its dynamic VRAM to page from (comfy-aimdo is on)."""
    return bool(getattr(comfy_memory, "aimdo_enabled", False)) and hasattr(comfy_memory, "TensorFileSlice")


def file_slice_marker(path: str):
    """Where ComfyUI pages from files, a function marking a tensor of `path`'s map, at a byte offset, as its
    loader marks the tensors it maps (comfy.utils.load_safetensors); else None. The file stays open while
    one of them lives."""
    if not pages_from_files():
        return None
    handle, lock = open(path, "rb"), threading.Lock()

    def mark(tensor: torch.Tensor, offset: int) -> None:
        storage = tensor.untyped_storage()
        storage._comfy_tensor_file_slice = comfy_memory.TensorFileSlice(handle, lock, offset, storage.nbytes())

    return mark


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape)


def _from_file(tensor: torch.Tensor) -> bool:
    # what the host's loader attaches to a tensor it reads from the file (comfy.utils.load_safetensors)
    return hasattr(tensor.untyped_storage(), "_comfy_tensor_file_slice")


def paged_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """The weight and bias of every layer the host pages (its cast layers and the pack's QuantLinear) that
    sit in host memory, by state-dict key."""
    found = {}
    for path, module in model.named_modules():
        if not (isinstance(module, QuantLinear) or hasattr(module, "comfy_cast_weights")):
            continue
        for name in ("weight", "bias"):
            tensor = module._parameters.get(name)
            if tensor is not None and tensor.device.type == "cpu" and tensor.numel():
                found[f"{path}.{name}" if path else name] = (module, name)
    return found


def give_back_pages(tensors) -> None:
    """The pages of the pack's own private maps (loaders.checkpoint.TensorSource) that reading `tensors` brought
    in, given back: tensors marked with their file slice are paged by the host from the file, not from the map.
    A map of ComfyUI's own loader (which holds `_comfy_tensor_mmap_refs`) is left alone."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if (tensor.device.type == "cpu" and hasattr(storage, "_comfy_tensor_file_slice")
                and not hasattr(storage, "_comfy_tensor_mmap_refs")):
            release_pages(storage.data_ptr(), storage.nbytes())


@dataclass(frozen=True)
class WrittenFile:
    """A file a load wrote its model to (the quantize-once cache), to back its paged weights: its path, and
    {the model's state-dict key: (the file's key, a weak reference to the tensor written there)}; weak, so that
    a tensor rebound to the file is freed at once."""
    path: str
    tensors: dict[str, tuple[str, weakref.ref]]


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rebind(tensors: dict[str, tuple[nn.Module, str]], mapped: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, (module, name) in tensors.items():
            module._parameters[name] = nn.Parameter(mapped[key], requires_grad=False)


def back_with_file(patcher, label: str, written: WrittenFile | None = None) -> str | None:
    """Have the host page `patcher`'s weights from a file (see the module's docstring): `written`, where the load
    wrote them to one, else a scratch file; returns the report's line, or None where the host does not page from
    files. Any failure leaves the model as it was and says why."""
    if not (is_dynamic(patcher) and pages_from_files()):
        return None
    paged = paged_tensors(patcher.model)
    in_ram = {key: found for key, found in paged.items() if not _from_file(found[0]._parameters[found[1]])}
    kept = data_bytes([(key, module._parameters[name]) for key, (module, name) in paged.items() if key not in in_ram])
    lines = []
    if kept:
        lines.append(f"ComfyUI pages the {format_gib(kept)} of weights kept as stored from the model file itself")
    if in_ram and written is not None:
        line, in_ram = _written_file(in_ram, written)
        lines += [line] if line else []
    if in_ram:
        lines.append(_scratch_file(patcher, in_ram, label))
    return "; ".join(lines) or None


def _written_file(tensors: dict[str, tuple[nn.Module, str]], written: WrittenFile):
    """Rebind those of `tensors` that `written` holds to its file as ComfyUI maps it; (the report's line, the
    tensors left in RAM)."""
    start = time.perf_counter()
    held = {key: found for key, found in tensors.items()
            if key in written.tensors and written.tensors[key][1]() is found[0]._parameters[found[1]]}
    if not held:
        return None, tensors
    rest = {key: found for key, found in tensors.items() if key not in held}
    nbytes = data_bytes([(key, module._parameters[name]) for key, (module, name) in held.items()])
    try:
        loaded = comfy.utils.load_torch_file(written.path)
        mapped = {key: loaded[written.tensors[key][0]] for key in held}
        if not all(_from_file(tensor) for tensor in mapped.values()):
            raise RuntimeError("ComfyUI's loader did not map the file")
        # a load of the same key elsewhere may have renamed its own file over this one since (auto measures anew)
        if any(_layout(mapped[key]) != _layout(module._parameters[name]) for key, (module, name) in held.items()):
            raise RuntimeError("the file holds other tensors than this load wrote")
    except Exception as e:  # the file went or changed meanwhile: a scratch file instead
        return f"could not page from {written.path} ({type(e).__name__}: {e})", tensors
    _rebind(held, mapped)
    del loaded, mapped
    trim_heap()
    return (f"ComfyUI pages the {format_gib(nbytes)} of quantized weights from the cache file, as from its own "
            f"files: one copy in RAM ({time.perf_counter() - start:.1f} s)"), rest


def _scratch_file(patcher, tensors: dict[str, tuple[nn.Module, str]], label: str) -> str:
    """Rebind `tensors` to a scratch file ComfyUI maps; the report's line."""
    start = time.perf_counter()
    folder = folder_paths.get_temp_directory()
    path = os.path.join(folder, f"bigdit-{secrets.token_hex(6)}-{os.path.basename(label)}")
    if not path.endswith(".safetensors"):
        path += ".safetensors"
    entries = [(key, module._parameters[name].data) for key, (module, name) in tensors.items()]
    nbytes = data_bytes(entries)
    try:
        os.makedirs(folder, exist_ok=True)
        write_safetensors(path, entries, durable=False)
        del entries
        loaded = comfy.utils.load_torch_file(path)
        if not all(_from_file(loaded[key]) for key in tensors):
            raise RuntimeError("ComfyUI's loader did not map the file")
    except Exception as e:  # disk full, temp folder not writable...: the weights stay in RAM
        _remove(path)
        return (f"kept the {format_gib(nbytes)} of paged weights in RAM beside ComfyUI's pinned copy: "
                f"no scratch file in {folder} ({type(e).__name__}: {e})")
    _rebind(tensors, loaded)
    del loaded
    trim_heap()
    _remove(path)  # POSIX: the map keeps the file's data until the model goes
    if os.path.exists(path):
        weakref.finalize(patcher.model, _remove, path)
    return (f"put the {format_gib(nbytes)} of paged weights in a scratch file ComfyUI pages from, as from "
            f"its own files: one copy in RAM ({time.perf_counter() - start:.1f} s)")


def mapped_copies(tensors: dict[str, torch.Tensor], label: str) -> dict[str, torch.Tensor]:
    """`tensors` written to a scratch file in ComfyUI's temp folder and handed back, by the same names, as slices of
    a private map of it (see the module's docstring). The file is unlinked once mapped (POSIX; elsewhere ComfyUI
    empties its temp folder at its next start). Raises where the file cannot be written or mapped (no room on the
    disk, a temp folder that is not writable); `tensors` are left as they were."""
    folder = folder_paths.get_temp_directory()
    path = os.path.join(folder, f"bigdit-{secrets.token_hex(6)}-{label}.safetensors")
    try:
        os.makedirs(folder, exist_ok=True)
        write_safetensors(path, list(tensors.items()), durable=False)
        source = TensorSource(path, read_header(path), file_slice_marker(path))
        mapped = {key: source(key) for key in tensors}
        source.close()
    finally:
        _remove(path)
    return mapped
