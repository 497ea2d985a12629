"""Host-to-device copies of the weights a loader quantizes, through one reused page-locked buffer.

A weight handed over by the loader maps the file (safetensors is zero-copy), so
`weight.to("cuda")` is a pageable copy: the driver touches the mapped pages one
at a time on one thread, faulting each in. Here the weight is first copied into
a pinned buffer by torch's multi-threaded CPU copy, then moved in one DMA. The
buffer is allocated once, for the largest weight the plan will stage, so the
host memory this adds is bounded by one layer.
"""
from __future__ import annotations

import time

import torch


class PinnedStaging:
    """`to_device(tensor)` for CPU tensors bound for a CUDA `device`; anything else is moved as it is."""

    def __init__(self, device: torch.device, largest_bytes: int):
        self.device = torch.device(device)
        self.largest_bytes = largest_bytes
        self.enabled = self.device.type == "cuda" and largest_bytes > 0
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last DMA out of the buffer
        self.seconds = 0.0  # host time spent staging (the CPU copy; the DMA is asynchronous)
        self.staged_bytes = 0

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.enabled or tensor.device.type != "cpu" or nbytes > self.largest_bytes:
            return tensor.to(self.device)
        start = time.perf_counter()
        if self._buffer is None:
            self._buffer = torch.empty(self.largest_bytes, dtype=torch.uint8, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()  # the previous weight has left the buffer
        staged = self._buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.seconds += time.perf_counter() - start
        self.staged_bytes += nbytes
        return out

    def close(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        self._buffer = self._copied = None
