"""A loader's hold on its file's memory map, and how it lets go of it layer by layer.

A loader's tensors map the file (one private map per file, as safetensors does). A
page of the map that loading reads stays in the process's resident memory as
long as the map lives: a quantizing loader that reads every weight once would
hold the whole file beside the quantized copy (for MiniMax-H3 quantized to FP8,
39 GiB of file pages beside 21 GiB of weights). `FileMap.release` gives the
pages of a tensor back once it was consumed (quantized, or copied into the
model), with madvise(MADV_DONTNEED): the tensor stays valid, and reading it again
faults its pages in from the file (the page cache keeps them, they are just no
longer the process's). Only whole pages inside the tensor are given back, so a
neighbour's pages are never touched (loaders/host_memory.py).

A loader may also keep tensors that map the file as the model's own (upstream's
dynamic VRAM loads with `assign=True`). The map then lives as long as one of them
does; where they are less than half of the file, `release_file_map` copies them into
process memory, giving back each one's pages, so the map can go. Where the host pages
weights from their file itself (upstream's dynamic VRAM), it reads them there, so they
stay in the map with their pages given back.
"""
from __future__ import annotations

import torch
from torch import nn

from .host_memory import release_pages


class FileMap:
    """The address range of one file's memory map, and the pages given back from it so far."""

    def __init__(self, start: int, nbytes: int):
        self.start, self.end = start, start + nbytes
        self.released_bytes = 0  # whole pages inside released tensors, each tensor counted once
        self._released: set[int] = set()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s data lies in the map."""
        ptr = tensor.data_ptr()
        return tensor.device.type == "cpu" and self.start <= ptr and ptr + _nbytes(tensor) <= self.end

    def release(self, *tensors: torch.Tensor | None) -> None:
        """Give back the pages of the map under each tensor (those in the map; others are left alone).

        Only for a tensor nothing will write to (a consumed one): a written page of a private map is
        discarded, not kept."""
        for tensor in tensors:
            if tensor is not None and tensor.is_contiguous() and self.holds(tensor):
                released = release_pages(tensor.data_ptr(), _nbytes(tensor))
                if tensor.data_ptr() not in self._released:  # released again after a read: the same pages
                    self._released.add(tensor.data_ptr())
                    self.released_bytes += released


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def release_file_map(module: nn.Module, file_map: FileMap, file_bytes: int, paged_from_file: bool = False) -> int:
    """Copy the parameters and buffers of `module` that lie in `file_map` into process memory, giving back
    their pages, if they are less than half of `file_bytes`; returns the bytes copied.

    With `paged_from_file` (the host reads them from the file, by the marks TensorSource gave them), nothing
    is copied, which would lose the marks: their pages are given back, and the map stays as their storage."""
    seen, mapped = set(), []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen and tensor.numel() and file_map.holds(tensor):
            seen.add(id(tensor))
            mapped.append(tensor)
    if paged_from_file:
        file_map.release(*(t.data for t in mapped))
        return 0
    kept = sum(_nbytes(t) for t in mapped)
    if not mapped or 2 * kept >= file_bytes:
        return 0  # nothing mapped, or the model mostly is the file: the map costs nothing extra
    with torch.no_grad():
        for tensor in mapped:
            data = tensor.data
            tensor.data = data.clone()
            file_map.release(data)
    return kept
