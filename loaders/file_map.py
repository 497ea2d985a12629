"""A loaded model's hold on its file's memory map.

safetensors hands out tensors that map the file, and a loader may keep them as
the model's own (upstream's dynamic VRAM loads with `assign=True`). The map then
lives as long as one of them does, and every page of it that loading touched
stays in the process's resident memory, including the pages of the weights a
quantizing loader replaced: for MiniMax-H3 quantized to FP8, 39 GiB of file pages
beside 21 GiB of weights. Where the model keeps less than half of the file,
copying what it keeps into process memory lets the map go.
"""
from __future__ import annotations

import bisect
from typing import Iterable

import torch
from torch import nn


def release_file_map(module: nn.Module, file_tensors: Iterable[torch.Tensor], file_bytes: int) -> int:
    """Copy the parameters and buffers of `module` that lie in `file_tensors` (the tensors a TensorSource
    handed out) into process memory, if they are less than half of `file_bytes`; returns the bytes copied."""
    storages = (t.untyped_storage() for t in file_tensors if t.device.type == "cpu")
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages if s.nbytes())
    starts = [start for start, _ in spans]

    def in_file(tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        return tensor.device.type == "cpu" and i >= 0 and ptr < spans[i][1]

    seen, mapped = set(), []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen and tensor.numel() and in_file(tensor):
            seen.add(id(tensor))
            mapped.append(tensor)
    kept = sum(t.numel() * t.element_size() for t in mapped)
    if not mapped or 2 * kept >= file_bytes:
        return 0  # nothing mapped, or the model mostly is the file: the map costs nothing extra
    with torch.no_grad():
        for tensor in mapped:
            tensor.data = tensor.data.clone()
    return kept
